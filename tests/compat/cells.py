"""One compatibility cell: load a pair on a backend, decode greedily at block 8 and auto, compare."""

from __future__ import annotations

import functools
from pathlib import Path

from .conftest import FAMILIES, PROMPT, N

AUTO = "auto"
BLOCKS = (8, AUTO)


def sizer(block):
    """A fixed size, or an adaptive sizer that keeps probing other sizes (the engine's ``auto``, its costs
    synthetic here: the sizes it picks move with acceptance and timing, the output must not)."""
    from kakeya.orchestrator.decode.block_sizing import BlockSizer, CostCurve

    if block != AUTO:
        return block
    return BlockSizer(CostCurve({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}), explore_share=0.5)


@functools.cache
def pair(backend: str, target: Path, draft: Path):
    """The verifier and drafter, loaded once per (backend, checkpoints); torch serves float32."""
    from kakeya.checkpoints.config import load_draft_config

    layers = load_draft_config(draft)["dflash_config"]["target_layer_ids"]
    if backend == "torch":
        from kakeya.drafter.local import TorchDrafter
        from kakeya.verifier.local import LocalVerifier
        from kakeya.verifier.torch_backend.target import TargetTorch

        return LocalVerifier(TargetTorch.load(target, "cpu", "float32"), target, layers), TorchDrafter(
            draft, target, "cpu", "float32"
        )
    from kakeya.drafter.local import MLXDrafter
    from kakeya.verifier.local import mlx_verifier

    return mlx_verifier(target, layers), MLXDrafter(draft, target)


def speculative(backend: str, target: Path, draft: Path, block) -> list[int]:
    from kakeya.orchestrator.decode.loop import run

    verifier, drafter = pair(backend, target, draft)
    gen = run(verifier.open_session(), drafter.open_session(), PROMPT, N, sizer(block))
    if block == AUTO:
        assert len({b.drafted + 1 for b in gen.blocks[1:]}) > 1, "auto never varied the block size"
    return gen.token_ids


@functools.cache
def transformers_greedy(target: Path, family: str) -> tuple[int, ...]:
    """transformers' own greedy ``generate`` of the checkpoint, in float32 (a bfloat16 file upcast exactly)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration

    cls = Gemma4ForConditionalGeneration if FAMILIES[family].multimodal else AutoModelForCausalLM
    model = cls.from_pretrained(target, dtype=torch.float32).eval()
    # No end id: our loop runs N tokens through <eos> (no stop ids); min_new_tokens would instead forbid
    # <eos> (its logit -inf), another decoding.
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(PROMPT) + N
    ids = tuple(out[0, len(PROMPT) :].tolist())
    assert len(set(ids)) >= 16, f"{family}: the random target degenerated ({len(set(ids))} distinct tokens)"
    return ids


@functools.cache
def mlx_lm_greedy(target: Path) -> tuple[int, ...]:
    """mlx-lm's own greedy decoding of the checkpoint, loaded by mlx-lm alone (its caches, its config reading)."""
    from mlx_lm.utils import load_model

    from kakeya.verifier.mlx_backend.reference import greedy_reference

    model, _ = load_model(Path(target))
    ids, _, _ = greedy_reference(model, PROMPT, N)
    assert len(set(ids)) >= 16, f"{target.name}: the quantized target degenerated ({len(set(ids))} distinct)"
    return tuple(ids)


def ring_wraps(target: Path) -> float:
    """How many times the verifier's sliding-layer ring (window - 1 + slack 16 slots) is overwritten."""
    from kakeya.checkpoints.config import load_target_config
    from kakeya.core.request import CachePolicy

    window = load_target_config(target)["sliding_window"]
    return (len(PROMPT) + N) / (window - 1 + CachePolicy().slack)
