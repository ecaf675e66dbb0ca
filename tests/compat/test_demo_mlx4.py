"""The demo target quantized to 4 bits by ``mlx_lm.convert`` (unaided: its config is in the hub's spelling),
with the demo drafter on MLX: greedy speculative output == mlx-lm's own greedy decoding of the same quantized
model, past >= 3 ring wraps, at block 8 and auto -- with a trained drafter, so blocks are really accepted.
The speed-up against mlx-lm's plain generation: ``benchmarks/first_request.py --backend mlx --quantize 4``."""

from __future__ import annotations

import importlib

import pytest

from kakeya.checkpoints.tiny import demo_pair

from .cells import BLOCKS, sizer

N = 240  # the demo's window is 64: the ring (79 slots) wraps > 3 times


@pytest.fixture(scope="module")
def q4(compat_dir):
    pair = demo_pair()
    assert pair is not None, "the demo pair ships in services/models/demo"
    out = compat_dir / "demo-q4"
    importlib.import_module("mlx_lm.convert").convert(str(pair.target), str(out), quantize=True, q_bits=4)
    return out, pair.draft


@pytest.fixture(scope="module")
def loaded(q4):
    from kakeya.checkpoints.config import load_draft_config
    from kakeya.drafter.local import MLXDrafter
    from kakeya.verifier.local import mlx_verifier

    target, draft = q4
    layers = load_draft_config(draft)["dflash_config"]["target_layer_ids"]
    return mlx_verifier(target, layers), MLXDrafter(draft, target)


@pytest.fixture(scope="module")
def prompt_and_reference(q4):
    from mlx_lm.utils import load_model
    from tokenizers import Tokenizer

    from kakeya.app.options import DEFAULT_PROMPT
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    target, _ = q4
    prompt = [2] + Tokenizer.from_file(str(target / "tokenizer.json")).encode(DEFAULT_PROMPT).ids[:40]
    model, _ = load_model(target)  # mlx-lm alone
    ids, _, _ = greedy_reference(model, prompt, N)
    return prompt, ids


@pytest.mark.parametrize("block", BLOCKS)
def test_demo_q4_equals_mlx_lm(loaded, prompt_and_reference, block):
    from kakeya.orchestrator.decode.loop import run

    verifier, drafter = loaded
    prompt, ref = prompt_and_reference
    assert (len(prompt) + N) / (verifier.info.sliding_window - 1 + 16) >= 3
    gen = run(verifier.open_session(), drafter.open_session(), prompt, N, sizer(block))
    assert gen.token_ids == ref
    assert gen.mean_acceptance > 1.5  # the trained drafter is accepted on the quantized target
