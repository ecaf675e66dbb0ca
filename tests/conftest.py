"""Fixtures shared across the suite: the embedded tiny pair, loaded once; the benchmark scripts."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# One torch intra-op thread in every test process and every server a test starts (they inherit the
# environment): the suite runs on two xdist workers on a 2-core machine, and a torch thread team as large as
# the machine stalls whenever another process holds a core -- measured on a busy machine, a 40-token
# generate of the demo pair took 20-60 s on torch's default two threads and 1.1-1.6 s on one. What the
# tests check does not depend on the thread count; tests that set one themselves still do.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# MLX's products on Linux: the tests run them on MLX's own reference BLAS, where a row's product never depends
# on the other rows of its batch, so a verify of 8 and an AR step compute a row bit for bit alike and the
# exactness tests (speculative = AR, token for token, over 600 tokens and many ring wraps) hold exactly. A
# server routes them to torch's MKL (``backends/mlx/blas.py``), which picks other kernels for products of 1-3
# rows (as torch's own CPU products do): there a long run can part from AR at a near-tie.
# ``tests/verifier/test_mlx_blas.py`` checks the route and its output in fresh processes;
# ``KAKEYA_MLX_BLAS= ./scripts/check.sh`` (set, empty: the route's default) runs the whole suite on it.
os.environ.setdefault("KAKEYA_MLX_BLAS", "reference")


# The files that take minutes, longest first (measured on the 2-core VM: `pytest -n 0 --durations=0 FILE`).
# `--dist loadfile` hands each xdist worker one whole file at a time, in collection order, and pyproject's
# `--no-loadscope-reorder` keeps that order (xdist's default reorder puts the files with the MOST tests first,
# which left these few-test, many-minute files for the end, one worker finishing minutes after the other).
# Run first, the longest files overlap each other and the hundreds of short files fill in behind them.
LONGEST_FIRST = [
    "tests/services/test_hosts.py",
    "tests/sampling/test_statistical.py",  # 119 CPU-s (pytest -n 0, loaded VM) since its prompts batch; was ~3.8 min
    "tests/verifier/test_policies.py",  # since its cases run 600 tokens: 295 s -> 128 s back to back, loaded VM
    "tests/compat/test_transformers.py",
    "tests/training/test_trainers.py",
    "tests/orchestrator/test_cli.py",
    "tests/sampling/test_identity.py",
    "tests/prefix/test_colocated.py",
    "tests/constrained/test_sampling.py",
    "tests/services/test_takeover.py",
    "tests/orchestrator/test_ngram.py",
    # Long files that collection order put in the last few minutes (services/ late, then the top level,
    # torch_backend/, training/, verifier/): one of them handed out last kept a worker busy alone while the other
    # ran out of files. Here they overlap the rest and the run ends on files of seconds. `pytest -n 0
    # --durations=0`, quiet 2-core VM: test_serve_all 55-70 s, test_split.py with test_tls.py and
    # test_torch_servers.py 108 s, then 53, 47, 41, 40, 38 and 28 s in this order; what is left after services/ is
    # about 85 s of files of at most 15 s each.
    "tests/services/test_serve_all.py",
    "tests/services/test_split.py",
    "tests/torch_backend/test_greedy_identity.py",
    "tests/test_greedy_identity.py",
    "tests/torch_backend/test_compile.py",
    "tests/training/test_demo_pair.py",
    "tests/verifier/test_mlx_blas.py",
    "tests/training/test_ftheta_recall.py",
]


def pytest_collection_modifyitems(config, items):
    """Move LONGEST_FIRST's files to the front, in that order; every other test keeps its place (a stable sort)."""
    missing = [p for p in LONGEST_FIRST if not (config.rootpath / p).is_file()]
    if missing:  # a renamed file would silently lose its place at the front
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_pair():
    from kakeya.checkpoints.tiny import default_pair

    return default_pair()


@pytest.fixture(scope="session")
def mlx_target(tiny_pair):
    from kakeya.verifier.mlx_backend.target import TargetMLX

    return TargetMLX.load(tiny_pair.target)


@pytest.fixture(scope="session")
def aux_layers(tiny_pair):
    from kakeya.checkpoints.config import load_draft_config

    return tuple(load_draft_config(tiny_pair.draft)["dflash_config"]["target_layer_ids"])


@pytest.fixture(scope="session")
def demo_pair():
    """The trained demo pair (services/models/demo): shipped in the repo, so its absence is a failure."""
    from kakeya.checkpoints.tiny import demo_pair as _demo

    pair = _demo()
    assert pair is not None, "trained demo pair missing from services/models/demo"
    return pair


@pytest.fixture(scope="session")
def benchmark_script():
    """``load(name)``: ``benchmarks/<name>.py`` imported as a fresh module (the benchmarks are scripts,
    not a package), registered in ``sys.modules`` so that its dataclasses can look themselves up."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", root / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(autouse=True)
def _root_log_handlers():
    """A test that runs ``kakeya`` in process (``main([...])``) installs a root handler on the stderr of that moment,
    pytest's capture of it. Put the handlers back after each test: left in place, a background thread that logs
    later (the backend watchdog's stall notice) writes to the closed capture and prints ``--- Logging error ---``
    into another test's stderr."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
