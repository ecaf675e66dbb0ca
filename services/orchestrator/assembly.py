"""Engine assembly: which verifier and drafter, in-process or remote, on which backend.

The one place that turns "these checkpoints (or the embedded pair), this backend" or "these addresses"
into an :class:`~kakeya.orchestrator.decode.engine.Engine`; every caller (CLI, servers, niah, trainers,
benchmarks) comes here. Backend imports are lazy, so a node with only torch (or only MLX) needs no other.
Bad input raises ``ValueError`` (the CLI prints it as one line, exit 2).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform as _platform
import sys
from pathlib import Path

log = logging.getLogger("kakeya.orchestrator")

BACKENDS = ("auto", "mlx", "torch")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a blocked module (sys.modules[name] = None) or a broken parent
        return False


def apple_silicon(system: str | None = None, machine: str | None = None) -> bool:
    system = sys.platform if system is None else system
    machine = _platform.machine() if machine is None else machine
    return system == "darwin" and machine in ("arm64", "aarch64")


def resolve_backend(
    backend: str = "auto",
    device: str | None = None,
    *,
    system: str | None = None,
    machine: str | None = None,
    installed=_installed,
    cuda_available=None,
) -> tuple[str, str | None]:
    """``(backend, device)`` for what was asked. ``"auto"``: MLX on Apple silicon, torch elsewhere (MLX on a
    Linux CPU is slower, docs/benchmarks.md), the other if only it is installed. torch's device: ``cuda``
    when available, else ``cpu``; MLX picks its own (``None``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    if backend == "auto":
        order = ("mlx", "torch") if apple_silicon(system, machine) else ("torch", "mlx")
        found = [b for b in order if installed(b)]
        if not found:
            raise ValueError("no backend installed: install torch (Linux, CUDA) or mlx (Apple silicon)")
        backend, device = found[0], None if found[0] == "mlx" and device == "cpu" else device  # auto: as before
    if backend == "mlx":
        if device:  # asked for by name, MLX would ignore it
            raise ValueError("--device/--dtype apply to --backend torch (MLX picks its own device)")
        return "mlx", None
    device = device or ("cuda" if (cuda_available or _torch_cuda_available)() else "cpu")
    if device.split(":")[0] not in ("cpu", "cuda", "mps"):  # torch's own refusal comes later, as a traceback
        raise ValueError(f"--device: expected cpu, cuda, cuda:N or mps, got {device!r}")
    return "torch", device


def refuse_torch_flags(backends: tuple, device=None, dtype=None, options=None) -> None:
    """Torch-only settings where no torch model loads: refused by flag name, never ignored (MLX picks its own device)."""
    given = {"device": device not in (None, "cpu"), "dtype": dtype} | dict.fromkeys(options or {}, True)
    if named := [f"--{k.replace('_', '-')}" for k, on in given.items() if on and "torch" not in backends]:
        raise ValueError(f"{', '.join(named)}: for --backend torch only, not {backends[0]}")


def _torch_cuda_available() -> bool:
    from kakeya.backends.torch.ops import cuda_available

    return cuda_available()


def require_backend(backend: str) -> None:
    """Fail with one clear line when ``backend``'s package is missing (before any model import)."""
    if not _installed(backend):
        mlx, torch = "MLX (pip install mlx mlx-lm; Apple silicon or Linux CPU)", "PyTorch (pip install torch)"
        extra = mlx if backend == "mlx" else torch
        raise ValueError(f"the {backend} backend needs {extra}, which is not installed here")


def torch_threads(threads: int | None, device: str | None, embedded: bool) -> int:
    """The torch intra-op thread count to pin (0: leave torch's default). ``threads=None``: 1 for the embedded demo pair
    on CPU (a larger team stalls when another process takes a core); on a CPU pinned to fewer CPUs than the machine
    has, those; else torch's default."""
    if threads is None:
        if not (device or "cpu").startswith("cpu"):
            return 0
        if embedded:
            return 1
        allowed = usable_cpus()
        return allowed if allowed < (os.cpu_count() or allowed) else 0
    if threads < 0:  # was read as 0: torch's whole team, the very stall the default of 1 avoids
        raise ValueError(f"--torch-threads must be >= 0 (0: the library's own count), got {threads}")
    return threads


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS: no affinity to read
        return os.cpu_count() or 1


def set_torch_threads(threads: int | None, device: str | None, embedded: bool, backend: str = "torch") -> int | None:
    """Pin the CPU threads of the backend's products as :func:`torch_threads` says; returns the number set
    (None: left to the library). torch: its intra-op threads. MLX: on Linux its products run in the BLAS
    ``backends/mlx/blas.py`` routes them to, pinned alike (call before the engine's first product)."""
    if backend == "mlx":
        from kakeya.backends.mlx import blas

        n = torch_threads(threads, "cpu", embedded)
        blas.set_threads(n)
        return n or None
    n = torch_threads(threads, device, embedded)
    if not n:
        return None
    from kakeya.backends.torch.ops import set_threads

    set_threads(n)
    return n


def embedded_paths() -> tuple[str, str]:
    """The embedded pair every command uses without paths: the trained demo pair when shipped."""
    from kakeya.checkpoints.tiny import embedded_pair

    pair = embedded_pair()
    return str(pair.target), str(pair.draft)


def pair_paths(target: str | None, draft: str | None) -> tuple[str, str]:
    """The checkpoint paths to load: both given, or neither (the embedded pair)."""
    if target is None and draft is None:
        return embedded_paths()
    if target is None or draft is None:
        raise ValueError("give both --target and --draft, or neither (for the embedded default models)")
    return str(target), str(draft)


def check_compile(torch_options: dict | None, device: str | None) -> None:
    """``--compile`` is for CUDA: on a CPU the demo pair's attention met more shapes than torch's recompile
    limit allows, and with the limit raised it decoded slower than eager."""
    if torch_options and torch_options.get("compile") and not str(device or "cpu").startswith("cuda"):
        why = f"--compile applies to --device cuda, not {device or 'cpu'}: leave it out there (eager is faster)"
        raise ValueError(why)


def build_local_engine(
    target: str | None,
    draft: str | None,
    backend: str = "mlx",
    device: str | None = None,
    dtype: str | None = None,
    policy=None,
    no_drafter: bool = False,
    torch_options: dict | None = None,
    prefixes=None,
    ngram: bool = True,
):
    """Load the pair in-process (the embedded default pair when no paths are given). ``device``/``dtype`` and
    ``torch_options`` apply to torch; ``prefixes``: a ``PrefixCache`` the verifier and the drafter share, or None."""
    from kakeya.checkpoints.config import check_pair, load_draft_config, load_target_config
    from kakeya.orchestrator.decode.engine import Engine
    from kakeya.orchestrator.text import TextCodec

    target, draft = pair_paths(target, draft)
    backend, device = resolve_backend(backend, device)
    refuse_torch_flags((backend,), device, dtype, torch_options)
    tcfg = load_target_config(target)
    dcfg = load_draft_config(draft)
    check_pair(tcfg, dcfg)
    aux_layers = dcfg["dflash_config"]["target_layer_ids"]
    torch_kw = {"device": device, "dtype": dtype or "float32"} if backend == "torch" else {}
    check_compile(torch_options, device)
    verifier_options = {k: v for k, v in (torch_options or {}).items() if k != "graphed_min_batch"}  # the drafter's
    vkw = torch_kw | verifier_options | ({"policy": policy} if policy else {})
    require_backend(backend)
    from kakeya.drafter.loader import local_drafter
    from kakeya.verifier.loader import local_verifier

    verifier = local_verifier(target, aux_layers, backend, prefixes=prefixes, **vkw)
    dkw = torch_kw | (torch_options or {})
    drafter = None if no_drafter else local_drafter(draft, target, backend, prefixes=prefixes, **dkw)
    draft = "" if no_drafter else draft
    codec, cached = TextCodec(target, verifier.info.vocab_size), prefixes is not None
    return Engine(verifier, drafter, codec, target, draft, device=device, prefix_cache=cached, ngram=ngram)


def split_engine(
    verifier_addr: str,
    drafter,
    tokenizer: str | None,
    wait_s: float,
    *,
    tls=None,
    token: str | None = None,
    backend_timeout_s: float | None = None,
    ngram: bool = True,
):
    """An engine whose verifier is a gRPC service; waits up to ``wait_s`` for it. ``drafter``: a ``kakeya serve
    drafter``'s address (waited for alike), a drafter loaded in this process (``drafter/loader.py``: one round trip a
    block instead of two), or None. ``tls``: a ``ClientTLS`` for the services; ``token``: the bearer token they
    require; ``backend_timeout_s``: the step deadlines' floor. The verifier's sessions return the hidden states of
    the drafter's layers (decoded here for an in-process drafter)."""
    from kakeya.orchestrator.decode.engine import Engine
    from kakeya.orchestrator.remote.deadlines import DEFAULT_BACKEND_TIMEOUT_S, StepClock
    from kakeya.orchestrator.remote.drafter import GrpcDrafter
    from kakeya.orchestrator.remote.verifier import GrpcVerifier
    from kakeya.orchestrator.text import TextCodec

    floor = backend_timeout_s or DEFAULT_BACKEND_TIMEOUT_S
    drafter_addr, aux_like = drafter, None
    if isinstance(drafter, str):
        drafter = GrpcDrafter(drafter, wait_s=wait_s, tls=tls, token=token, clock=StepClock(floor))
    elif drafter is not None:
        drafter_addr, aux_like = "this process", drafter.backend
    aux_layers = drafter.target_layer_ids if drafter is not None else ()
    listed = verifier_addr.split(":", 1)[1].split(",") if verifier_addr.startswith(("ipv4:", "ipv6:")) else ()
    replicas = {r: GrpcVerifier(r, wait_s=wait_s, tls=tls, token=token) for r in listed}  # each one's GetInfo, once
    verifier = GrpcVerifier(verifier_addr, aux_layers=aux_layers, wait_s=wait_s, aux_like=aux_like, tls=tls, token=token,
                            clock=StepClock(floor), remote=next(iter(replicas.values())).remote if listed else None)  # fmt: skip
    info = verifier.info
    for replica, one in replicas.items():  # one model behind a list: sessions go to any replica
        one.close()
        if not verifier.serves_its_model(one.remote):
            raise ValueError(f"--verifier: its replicas serve different models ({replica}: {one.remote.model_name})")
    if drafter is not None:
        problems = [f"{k} {getattr(drafter, k)} != verifier's {getattr(info, k)}" for k in ("vocab_size", "hidden_size")
                    if getattr(drafter, k) != getattr(info, k)]  # fmt: skip
        bad = [i for i in drafter.target_layer_ids if not 0 <= i < info.num_layers]
        problems += [f"target_layer_ids {bad} outside the verifier's {info.num_layers} layers"] * bool(bad)
        if problems:
            why = f"drafter in {drafter_addr} does not fit the verifier at {verifier_addr}: " + "; ".join(problems)
            raise ValueError(why)
    tok_dir = tokenizer or info.name
    codec = None
    if tokenizer or tok_dir and (Path(tok_dir) / "tokenizer.json").is_file():  # a --tokenizer without one: named
        codec = TextCodec(tok_dir, info.vocab_size)
    else:
        log.warning(
            "no tokenizer (verifier's %s is not readable here; pass --tokenizer DIR): token-id prompts only", info.name
        )
    draft_name = drafter.model_name if drafter is not None else ""
    return Engine(verifier, drafter, codec, info.name, draft_name, prefix_cache=verifier.prefix_cache, ngram=ngram)
