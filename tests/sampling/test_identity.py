"""Seeded coupled sampling is AR sampling with that seed, token for token, on every path: every fixed
block size 2..16, any schedule (scripted, and the engine's auto), mixed torch/MLX, split over gRPC,
batched with other sessions (greedy, coupled and rejection ones) and alone, and past ring wraps."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from kakeya.core.request import MAX_BLOCK_SIZE, REJECTION, CachePolicy, Request, SamplingParams
from kakeya.drafter.session import DraftItem, draft_batch
from kakeya.orchestrator.decode.block_sizing import BlockSizer, CostCurve
from kakeya.orchestrator.decode.engine import Engine
from kakeya.orchestrator.decode.loop import run
from kakeya.verifier.session import decide_batch

from .conftest import BACKENDS

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48]
N = 40
PARAMS = {
    "temperature": SamplingParams(0.8, seed=42),
    "filtered": SamplingParams(1.0, top_k=40, top_p=0.9, min_p=0.01, seed=7),
}


class Scripted(BlockSizer):
    """A schedule of block sizes, cycled (the loop treats it as auto: size-1 blocks still feed the drafter)."""

    def __init__(self, sizes):
        super().__init__(CostCurve())
        self._sizes = itertools.cycle(sizes)

    def choose(self, copy: bool = False) -> int:  # a copy's block is sized as any other here
        return next(self._sizes)

    def observe(self, block) -> None:
        pass


def generate(verifier, drafter, params, schedule, policy=None, n=N) -> list[int]:
    """``n`` tokens after PROMPT; ``schedule``: a block size, or a list of sizes (cycled)."""
    vs = verifier.open_session(policy, params)
    ds = drafter.open_session(params) if drafter is not None else None
    try:
        sizes = schedule if isinstance(schedule, int) else Scripted(schedule)
        return run(vs, ds, PROMPT, n, sizes).token_ids
    finally:
        vs.close()
        if ds is not None:
            ds.close()


@pytest.fixture(scope="module")
def ar(local):
    """Seeded AR sampling (block size 1, no drafter) per (verifier backend, params)."""
    return {(be, name): generate(local[be][0], None, p, 1) for be in BACKENDS for name, p in PARAMS.items()}


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_fixed_block_size_gives_the_ar_tokens(local, ar, backend, name):
    v, d = local[backend]
    for block_size in range(2, MAX_BLOCK_SIZE + 1):
        assert generate(v, d, PARAMS[name], block_size) == ar[backend, name], block_size
    assert generate(v, d, replace(PARAMS[name], seed=PARAMS[name].seed + 1), 8) != ar[backend, name]


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_schedule_gives_the_ar_tokens(local, ar, backend):
    v, d = local[backend]
    for schedule in ([1, 16, 3, 1, 7], [2, 5], [16, 1], [9, 4, 13, 6]):
        for name, params in PARAMS.items():
            assert generate(v, d, params, schedule) == ar[backend, name], schedule


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engines_auto_gives_the_ar_tokens_and_says_which_rule_ran(local, ar, backend):
    v, d = local[backend]
    engine = Engine(v, d, codec=None)
    for name, params in PARAMS.items():
        auto = engine.generate(Request(PROMPT, max_tokens=N, block_size=0, ignore_eos=True, sampling=params))
        assert auto.token_ids == ar[backend, name]
        assert auto.sampling == params and auto.sampling.rule == "coupled"


def test_mixed_backends_give_the_verifiers_ar_tokens(local, ar):
    """The drafter only proposes: which backend drafts changes acceptance, never a token. (In process an MLX
    verifier's aux feeds a torch drafter; the other way round runs split, in ``test_split_over_grpc...``.)"""
    v, d = local["mlx"][0], local["torch"][1]
    for name, params in PARAMS.items():
        assert generate(v, d, params, 8) == ar["mlx", name]
        assert generate(v, d, params, [3, 1, 16]) == ar["mlx", name]


def test_torch_and_mlx_targets_sample_the_same_tokens(ar):
    """In float32 the two backends' logits differ by rounding only, which changes a token only at a
    near-exact tie of two noisy scores (docs/design.md quantifies how rare that is)."""
    for name in PARAMS:
        assert ar["torch", name] == ar["mlx", name]


def test_split_over_grpc_gives_the_ar_tokens(split, ar):
    for backend in BACKENDS:  # an MLX drafter server beside a torch (mixed) or an MLX verifier server
        gv, gd = split[backend]
        for name, params in PARAMS.items():
            assert generate(gv, gd, params, 8) == ar[backend, name]
            assert generate(gv, gd, params, [1, 4, 16, 2]) == ar[backend, name]
            assert generate(gv, None, params, 1) == ar[backend, name]  # AR over the wire


def lockstep(verifier, drafter, specs, block_size: int) -> list[list[int]]:
    """Every spec's first ``N`` tokens, generated together: each round ONE ``draft_batch`` and ONE
    ``decide_batch`` over every unfinished session (what the verifier server's batched Verify does)."""
    sessions = [(verifier.open_session(sampling=p), drafter.open_session(p)) for p in specs]
    tokens, aux, live = [], [], list(range(len(specs)))
    for vs, _ in sessions:
        first, prompt_aux = vs.prefill(PROMPT)
        tokens.append([first])
        aux.append(prompt_aux)
    while live:
        drafts = draft_batch([DraftItem(sessions[i][1], aux[i], tokens[i][-1], block_size) for i in live])
        blocks = [[tokens[i][-1], *draft.tokens] for i, draft in zip(live, drafts)]
        verdicts = decide_batch([(sessions[i][0], ids[0], d) for i, ids, d in zip(live, blocks, drafts)])
        for i, ids, verdict in zip(live, blocks, verdicts):
            assert not isinstance(verdict, Exception), verdict
            tokens[i] += ids[1 : verdict.accepted + 1] + [verdict.next_token]
            aux[i] = verdict.aux
        live = [i for i in live if len(tokens[i]) < N]
    for vs, ds in sessions:
        vs.close()
        ds.close()
    return [t[:N] for t in tokens]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_with_other_sessions_gives_the_ar_tokens(local, ar, backend):
    v, d = local[backend]
    rejection = replace(PARAMS["temperature"], rule=REJECTION, seed=3)
    specs = [PARAMS["temperature"], None, rejection, PARAMS["filtered"], replace(PARAMS["temperature"], seed=43)]
    got = lockstep(v, d, specs, 6)
    assert got[0] == ar[backend, "temperature"] and got[3] == ar[backend, "filtered"]
    assert got[4] == generate(v, None, specs[4], 1)
    assert got[1] == generate(v, None, None, 1)  # the greedy neighbour is greedy AR
    # the rejection neighbour draws what it draws alone on the same schedule (its tokens depend on the schedule)
    assert got[2] == lockstep(v, d, [rejection], 6)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_past_ring_wraps_gives_the_ar_tokens(local, backend):
    """A sink-window cache far smaller than the generation: positions stay absolute, so does the noise."""
    v, d = local[backend]
    policy = CachePolicy("sink-window", sink=4, window=24)
    n = 120  # prompt 10 + 120 positions: the 24-slot ring wraps several times
    for params in PARAMS.values():
        want = generate(v, None, params, 1, policy, n)
        assert generate(v, d, params, 8, policy, n) == want
        assert generate(v, d, params, [16, 1, 5], policy, n) == want
