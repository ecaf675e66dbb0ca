"""Logprobs under speculation equal the target's own: for every committed token, its log-probability and the
top k at its position match a plain full forward of the target over prompt + output (log_softmax of the
logits at each position) within 1e-4 in float32 -- greedy and seeded sampling (both rules), speculative
blocks and AR, alone and batched, torch and MLX colocated, and through the engine (stop tokens cut them
with the tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.core.contract import SessionOptions
from kakeya.core.request import REJECTION, Request, SamplingParams
from kakeya.orchestrator.decode.engine import Engine
from kakeya.orchestrator.decode.loop import Decode, DecodeOptions, advance, run
from kakeya.verifier.session import decide_batch

from ..policy_reference import torch_plain

PROMPT = [2, 500, 788, 12, 69, 16, 308, 305, 279, 328]  # "def add(a, b):\n    return" on the demo pair
N = 24
K = 5
TOL = 1e-4
PARAMS = {
    "greedy": SamplingParams(),
    "coupled": SamplingParams(0.8, seed=42),
    "filtered": SamplingParams(1.0, top_k=40, top_p=0.9, seed=7),
    "rejection": SamplingParams(0.8, seed=3, rule=REJECTION),
}


@pytest.fixture(scope="module")
def models(demo_pair):
    """The trained demo pair (its drafter is accepted often: blocks commit several tokens), both backends."""
    import torch

    from kakeya.checkpoints.config import load_draft_config
    from kakeya.drafter.loader import local_drafter
    from kakeya.verifier.loader import local_verifier

    torch.set_num_threads(1)
    target, draft = str(demo_pair.target), str(demo_pair.draft)
    layers = load_draft_config(draft)["dflash_config"]["target_layer_ids"]
    return {be: (local_verifier(target, layers, be), local_drafter(draft, target, be)) for be in ("torch", "mlx")}


def reference(verifier, ids: list[int]) -> np.ndarray:
    """log_softmax of the target's logits after every position of ``ids``: one plain forward, no ring, no
    speculation (torch: every layer keeps every position; MLX: mlx-lm's own model call)."""
    target = verifier.target
    if target.backend == "torch":
        import torch

        hidden = torch_plain(target, len(ids))(ids, 0)
        with torch.inference_mode():
            return torch.log_softmax(target.model.logits(hidden)[0].float(), -1).numpy()
    import mlx.core as mx

    logits = target.model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def check(verifier, prompt, tokens, logprobs, k=K):
    """Each committed token's logprob and top k against the plain forward's row that predicted it."""
    assert [lp.token for lp in logprobs] == tokens
    ref = reference(verifier, prompt + tokens[:-1])[len(prompt) - 1 :]
    for row, lp in zip(ref, logprobs):
        assert abs(lp.logprob - row[lp.token]) < TOL
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=TOL)  # the k largest, in order
        for t, v in lp.top:
            assert abs(row[t] - v) < TOL  # each listed token's own logprob (ties may list either of equals)


def generate(verifier, drafter, params, block, k=K):
    vs = verifier.open_session(None, params, SessionOptions(logprobs=k))
    ds = drafter.open_session(params) if block > 1 else None
    try:
        gen = run(vs, ds, PROMPT, N, block)
    finally:
        vs.close()
        if ds is not None:
            ds.close()
    return gen.token_ids, [lp for b in gen.blocks for lp in b.logprobs], gen


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_logprobs_equal_a_plain_forward(models, backend, name):
    verifier, drafter = models[backend]
    tokens, logprobs, gen = generate(verifier, drafter, PARAMS[name], 6)
    assert len(tokens) == N and len(gen.blocks) < N  # blocks committed several tokens: speculation ran
    check(verifier, PROMPT, tokens, logprobs)
    if name not in ("greedy", "rejection"):  # AR with the same seed: the same tokens, the same logprobs
        ar_tokens, ar_logprobs, _ = generate(verifier, None, PARAMS[name], 1)
        assert ar_tokens == tokens
        np.testing.assert_allclose([a.logprob for a in ar_logprobs], [b.logprob for b in logprobs], atol=TOL)


def test_batched_sessions_get_their_own_logprobs(models):
    """Several sessions verified in one forward (greedy and sampled, with and without logprobs): each one's
    logprobs are its own rows'; a session that did not ask gets none."""
    verifier, drafter = models["torch"]
    asks = [("greedy", 3), ("coupled", 0), ("greedy", None), ("filtered", 20)]
    decodes, sessions = [], []
    for name, k in asks:
        vs = verifier.open_session(None, PARAMS[name], SessionOptions(logprobs=k))
        ds = drafter.open_session(PARAMS[name])
        sessions += [vs, ds]
        d = Decode(vs, ds, PROMPT, DecodeOptions(N, 5, frozenset()))
        first, aux = vs.prefill(PROMPT)
        d.prefilled(first, aux, 0.0)
        decodes.append(d)
    try:
        while not all(d.done for d in decodes):
            advance(decodes, drafter.draft_batch, decide_batch)
    finally:
        for s in sessions:
            s.close()
    for d, (_, k) in zip(decodes, asks):
        gen = d.generation
        if k is None:
            assert all(b.logprobs is None for b in gen.blocks)
            continue
        check(verifier, PROMPT, gen.token_ids, [lp for b in gen.blocks for lp in b.logprobs], k=min(k, 20))


def test_engine_cuts_logprobs_with_a_stop_token(models):
    """A stop token inside a block ends the generation: the logprobs end with it, one per token."""
    verifier, drafter = models["torch"]
    engine = Engine(verifier, drafter, None)
    free = engine.generate(Request(PROMPT, max_tokens=N, block_size=6, logprobs=2))
    stop = free.token_ids[N // 2]
    gen = engine.generate(Request(PROMPT, max_tokens=N, block_size=6, logprobs=2, stop_ids=(stop,)))
    assert gen.finish_reason == "stop" and gen.token_ids[-1] == stop
    logprobs = [lp for b in gen.blocks for lp in b.logprobs]
    check(verifier, PROMPT, gen.token_ids, logprobs, k=2)
    none = engine.generate(Request(PROMPT, max_tokens=4, block_size=6))
    assert all(b.logprobs is None for b in none.blocks)


def test_the_cli_lists_logprobs_in_its_json(demo_pair, capsys):
    """``kakeya generate --logprobs K --json``: one entry per token, the target's values; a bad K names the flag."""
    import json

    from kakeya.app.main import main

    pair = ["--target", str(demo_pair.target), "--draft", str(demo_pair.draft), "--backend", "torch"]
    args = ["generate", *pair, "--json", "--max-tokens", "12", "--block-size", "4", "--prompt", "def add(a, b):"]
    assert main([*args, "--logprobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from kakeya.verifier.loader import local_verifier

    verifier = local_verifier(str(demo_pair.target), [], "torch")
    ref = reference(verifier, out["prompt_token_ids"] + out["token_ids"][:-1])[len(out["prompt_token_ids"]) - 1 :]
    assert [e["token"] for e in out["logprobs"]] == out["token_ids"]
    for row, e in zip(ref, out["logprobs"]):
        assert abs(e["logprob"] - row[e["token"]]) < TOL and len(e["top"]) == 2
        assert abs(e["top"][0][1] - row.max()) < TOL
    assert main([*args, "--logprobs", "21"]) != 0
    assert "--logprobs" in capsys.readouterr().err
