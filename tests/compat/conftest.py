"""Checkpoints written by the tools users' checkpoints come from -- never by the project.

* transformers' ``save_pretrained`` of four Gemma-4 families (random weights, seeded; every tensor jittered
  in place so no norm is exactly 1): ``e`` (E-series-like: per-layer inputs, KV sharing, double-wide MLP,
  tied head), ``moe`` (26B-A4B-like: MoE block, k_eq_v full layers with their own key/value heads and head
  size, untied head), ``dense`` (31B-like: k_eq_v, 5:1 layer pattern) and ``mm`` (the multimodal
  ``Gemma4ForConditionalGeneration`` wrapper with a vision tower). float32 saves are sharded with an index
  file (``max_shard_size``); bfloat16 saves are one file.
* the ``dflash`` package's ``DFlashDraftModel.save_pretrained`` (dflash==0.1.0): z-lab's layout through May
  2026 (``block_size`` at the top level, full-attention layers) and the June 2026 one (``block_size`` in
  ``dflash_config``, mostly ``sliding_attention`` layers with a window).
* ``mlx_lm.convert`` (4 and 8 bits, group sizes 32 and 64). mlx-lm 0.32 cannot read transformers >= 5.2's
  ``per_layer_config`` itself (its convert fails with a q_proj shape error, ``test_mlx_convert.py`` pins
  that), so its ``load`` is handed Kakeya's reading of the config -- what a hub-spelled checkpoint
  (``global_head_dim``) gives it unaided; quantization and saving are mlx-lm's own.

Shapes, seeds and windows differ from every other test's (tests/torch_backend/ckpt.py, make_tiny). Hidden sizes
are multiples of 64, so mlx_lm.convert packs the embedding and most projections at group size 64 too (it
leaves a layer whose input width the group does not divide unquantized). Global head sizes are multiples of 8, as every Gemma-4's: the full layers' partial RoPE (a quarter of the head) then turns
whole pairs, which transformers and mlx-lm round alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

N = 168  # generated tokens: with the prompt, >= 3 ring wraps of every family's ring (window - 1 + slack 16)
PROMPT = [2, 17, 93, 41, 250, 8, 77, 160, 33, 129, 54, 201, 12, 88, 140]

S, F = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Family:
    name: str
    text: dict  # Gemma4TextConfig arguments
    drafter: str  # which dflash layout drafts for it ("may" / "june")
    target_layer_ids: tuple[int, ...]
    seed: int
    multimodal: bool = False


FAMILIES = {
    "e": Family(
        "e",
        dict(
            vocab_size=320,
            vocab_size_per_layer_input=320,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            global_head_dim=24,
            layer_types=[S, S, F, S, S, S, F],
            sliding_window=9,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=3,
            use_double_wide_mlp=True,
            final_logit_softcapping=25.0,
            tie_word_embeddings=True,
            rope_parameters={
                F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                S: {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        "may",
        (1, 3),
        11,
    ),
    "moe": Family(
        "moe",
        dict(
            vocab_size=288,
            vocab_size_per_layer_input=288,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=[S, S, F, S, F],
            sliding_window=11,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=12,
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,
        ),
        "june",
        (0, 2, 3),
        23,
    ),
    "dense": Family(
        "dense",
        dict(
            vocab_size=352,
            vocab_size_per_layer_input=352,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=[S, S, S, S, S, F],
            sliding_window=7,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0,
        ),
        "may",
        (2, 4),
        37,
    ),
    "mm": Family(
        "mm",
        dict(
            vocab_size=300,
            vocab_size_per_layer_input=300,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            global_head_dim=32,
            layer_types=[S, F, S, F],
            sliding_window=10,
            hidden_size_per_layer_input=4,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            final_logit_softcapping=20.0,
        ),
        "june",
        (1,),
        41,
        multimodal=True,
    ),
    "plain": Family(  # full layers of the sliding layers' shape (transformers writes per_layer_config {}), the
        "plain",  # default layer pattern, an untied head, no soft-capping
        dict(
            vocab_size=256,
            vocab_size_per_layer_input=256,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=8,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            global_head_dim=32,
            sliding_window=13,
            hidden_size_per_layer_input=0,
            tie_word_embeddings=False,
        ),
        "may",
        (1, 5),
        51,
    ),
}
TINY_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    head_dim=8, patch_size=4, position_embedding_size=64,
)  # fmt: skip


def _jitter(model, seed: int) -> None:
    """Every weight random (matrices ~ 1/sqrt(fan-in), vectors 1 + noise): no norm exactly 1, logits with a
    useful spread, so greedy decoding does not collapse into a loop."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            if name.endswith("layer_scalar"):
                p.fill_(0.9)
            elif p.ndim <= 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
                if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                    p.mul_(3.0)  # the layers outweigh the residual: a tied head would echo the input token


def save_target(fam: Family, out: Path, dtype: str) -> Path:
    """``save_pretrained`` of the family: float32 sharded with an index, bfloat16 (or float16) in one file."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    torch.manual_seed(fam.seed)
    if fam.multimodal:
        model = Gemma4ForConditionalGeneration(
            Gemma4Config(text_config=fam.text, vision_config=TINY_VISION, audio_config=None)
        )
    else:
        model = Gemma4ForCausalLM(Gemma4TextConfig(**fam.text))
    _jitter(model.eval(), fam.seed + 1)
    if dtype != "float32":
        model.to(getattr(torch, dtype)).save_pretrained(out)
    else:
        model.save_pretrained(out, max_shard_size="120KB")
    return out


def save_drafter(fam: Family, out: Path, layers: int = 0, block: int = 8, ids=(), dtype: str = "float32") -> Path:
    """The ``dflash`` package's own ``DFlashDraftModel.save_pretrained``, in one of z-lab's two layouts (2 layers
    May, 3 June, block 8, the family's target layers, float32 unless given)."""
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    t = fam.text
    common = dict(
        hidden_size=t["hidden_size"], intermediate_size=2 * t["hidden_size"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=t["vocab_size"], num_target_layers=t["num_hidden_layers"],
        rms_norm_eps=1e-6, max_position_embeddings=4096,
    )  # fmt: skip
    dflash = {"mask_token_id": t["vocab_size"] - 1, "target_layer_ids": list(ids or fam.target_layer_ids)}
    if fam.drafter == "may":  # block_size beside dflash_config, every layer full attention
        cfg = Qwen3Config(**common, num_hidden_layers=layers or 2, block_size=block, dflash_config=dflash)
    else:  # June 2026: block_size inside dflash_config, RoPE in rope_parameters, sliding layers
        layers = layers or 3
        cfg = Qwen3Config(
            **common, num_hidden_layers=layers, dflash_config={**dflash, "block_size": block},
            layer_types=[S] * (layers - 1) + [F], use_sliding_window=True, sliding_window=6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(fam.seed + 2)
    model = DFlashDraftModel(cfg).eval()
    _jitter(model, fam.seed + 3)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    return out


def save_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer saved by transformers (mlx_lm.convert loads one beside the weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t2", eos_token="t1", pad_token="t0", unk_token="t3")
    fast.save_pretrained(out)


def mlx_convert(src: Path, out: Path, bits: int, group: int, **options) -> Path:
    """``mlx_lm.convert(src, out, quantize=True, ...)`` (bits 0: unquantized, mlx-lm's names and layout alone, or
    as ``options`` say), its ``load`` handed Kakeya's reading of the config."""
    import functools
    import importlib

    mc = importlib.import_module("mlx_lm.convert")  # the module (mlx_lm exports a function of that name)

    from kakeya.checkpoints.config import load_target_config, mlx_model_config

    raw = json.loads((src / "config.json").read_text())
    patched = functools.partial(mc.load, model_config=mlx_model_config(raw, load_target_config(src)))
    original, mc.load = mc.load, patched
    try:
        mc.convert(str(src), str(out), **(dict(quantize=True, q_bits=bits, q_group_size=group) if bits else options))
    finally:
        mc.load = original
    return out


@pytest.fixture(scope="session")
def compat_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compat")


@pytest.fixture(scope="session")
def checkpoints(compat_dir):
    """Lazily built, once per session: ``checkpoints(kind, family, ...)`` -> directory."""
    built: dict[tuple, Path] = {}

    def get(kind: str, name: str, bits: int = 0, group: int = 0) -> Path:
        key = (kind, name, bits, group)
        if key not in built:
            fam = FAMILIES[name]
            out = compat_dir / f"{name}-{kind}{f'-q{bits}g{group}' if bits else ''}"
            if kind in ("float32", "bfloat16", "float16"):
                built[key] = save_target(fam, out, kind)
            elif kind == "draft":
                built[key] = save_drafter(fam, out)
            elif kind == "mlx":
                src = get("float32", name)
                if not (src / "tokenizer.json").is_file():
                    save_tokenizer(src, fam.text["vocab_size"])
                built[key] = mlx_convert(src, out, bits, group)
            else:
                raise ValueError(kind)
        return built[key]

    return get


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is fastest (and does not fight a shared CPU)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
