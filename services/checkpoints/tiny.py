"""Tiny random Gemma-4 target + DFlash drafter, in real Hugging Face format.

``make_tiny(out_dir)`` writes ``out_dir/target`` (a ``gemma4_text`` checkpoint that ``mlx_lm.load`` and
transformers open and read identically, with the real model's hybrid structure: sliding and full layers,
``global_head_dim``, ``attention_k_eq_v``, proportional partial RoPE, soft-capping, optional MoE) and
``out_dir/draft`` (a DFlash drafter in the reference layout ``dflash.model_mlx.load_draft`` opens). Weights
are random float32, each tensor from a generator seeded by ``(seed, crc32(name))``: for correctness tests,
not quality. ``default_pair()`` is the copy shipped in ``services/models/tiny``.
"""

from __future__ import annotations

import hashlib
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kakeya.checkpoints import tokenizer as tk
from kakeya.checkpoints.config import CheckpointError
from kakeya.core.contract import FULL, SLIDING

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny"

# Architecture of the tiny target. Every field is written explicitly: mlx-lm's ModelArgs and transformers'
# Gemma4TextConfig defaults differ (e.g. use_double_wide_mlp, sliding_window_pattern).
HIDDEN = 64
NUM_LAYERS = 6
LAYER_TYPES = [SLIDING, SLIDING, FULL] * 2
HEAD_DIM = 16
GLOBAL_HEAD_DIM = 32
NUM_HEADS = 4
NUM_KV_HEADS = 2
NUM_GLOBAL_KV_HEADS = 1
INTERMEDIATE = 64
MAX_POSITIONS = 131072
SOFTCAP = 30.0
RMS_EPS = 1e-6
NUM_EXPERTS = 4
TOP_K_EXPERTS = 2
MOE_INTERMEDIATE = 32

DRAFT_LAYERS = 2
MIN_IDS_VOCAB_SIZE = 16  # a pair without a tokenizer (vocab below tokenizer.MIN_VOCAB_SIZE)
DRAFT_INTERMEDIATE = 64
BLOCK_SIZE = 8
TARGET_LAYER_IDS = [1, 4]

LOGIT_STD = 4.0  # std of the LM-head logits before soft-capping
SPECIAL_LOGIT_DAMP = 0.25  # on the special tokens' LM-head rows: greedy runs rarely stop early
NORM_JITTER = 0.1  # spread of RMSNorm weights around 1: a swapped norm is caught


@dataclass(frozen=True)
class TinyPair:
    target: Path
    draft: Path


def _shared_config(vocab_size: int) -> dict[str, Any]:
    """The fields target and drafter configs share (the drafter's attention is the target's sliding layers')."""
    return {
        "dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": RMS_EPS,
        "max_position_embeddings": MAX_POSITIONS,
        "final_logit_softcapping": SOFTCAP,
        "tie_word_embeddings": False,
        "pad_token_id": tk.PAD_ID,
        "bos_token_id": tk.BOS_ID,
        "eos_token_id": tk.EOS_ID,
    }


def target_config(
    sliding_window: int = 32, moe: bool = False, vocab_size: int = tk.DEFAULT_VOCAB_SIZE
) -> dict[str, Any]:
    if sliding_window < 2:
        raise ValueError(f"sliding_window must be >= 2, got {sliding_window}")
    return _shared_config(vocab_size) | {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size_per_layer_input": vocab_size,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "layer_types": list(LAYER_TYPES),
        "sliding_window": sliding_window,
        "sliding_window_pattern": 3,
        "num_global_key_value_heads": NUM_GLOBAL_KV_HEADS,
        "global_head_dim": GLOBAL_HEAD_DIM,
        "attention_k_eq_v": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            SLIDING: {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "global_partial_rotary_factor": 0.25,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": bool(moe),
        "num_experts": NUM_EXPERTS if moe else None,
        "top_k_experts": TOP_K_EXPERTS if moe else None,
        "moe_intermediate_size": MOE_INTERMEDIATE if moe else None,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def draft_config(vocab_size: int = tk.DEFAULT_VOCAB_SIZE) -> dict[str, Any]:
    return _shared_config(vocab_size) | {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "intermediate_size": DRAFT_INTERMEDIATE,
        "num_hidden_layers": DRAFT_LAYERS,
        "num_target_layers": NUM_LAYERS,
        "layer_types": [FULL] * DRAFT_LAYERS,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "use_sliding_window": False,
        "sliding_window": None,
        "block_size": BLOCK_SIZE,
        "dflash_config": {
            "block_size": BLOCK_SIZE,
            "target_layer_ids": list(TARGET_LAYER_IDS),
            "mask_token_id": tk.MASK_ID,
            "input_embedding_scale": 1.0,
            "output_multiplier": 1.0,
        },
    }


class _Init:
    """Per-tensor deterministic generators: tensor ``name`` uses (seed, crc32(name))."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self.tensors[name] = (self._rng(name).standard_normal(shape) * std).astype(np.float32)

    def linear(self, name: str, out_dim: int, in_dim: int, gain: float = 1.0) -> None:
        self.normal(name, (out_dim, in_dim), gain / np.sqrt(in_dim))

    def norm(self, name: str, dim: int) -> None:
        self.tensors[name] = (1.0 + NORM_JITTER * self._rng(name).standard_normal(dim)).astype(np.float32)

    def attention_and_mlp(self, p: str, h: int, n_q: int, n_kv: int, hd: int, inter: int, v_proj: bool = True) -> None:
        """A decoder layer's q/k/v/o projections with q/k norms and its gated MLP, under prefix ``p``
        (Gemma-4 and the drafter name them alike)."""
        self.linear(p + "self_attn.q_proj.weight", n_q * hd, h)
        self.linear(p + "self_attn.k_proj.weight", n_kv * hd, h)
        if v_proj:
            self.linear(p + "self_attn.v_proj.weight", n_kv * hd, h)
        self.linear(p + "self_attn.o_proj.weight", h, n_q * hd)
        self.norm(p + "self_attn.q_norm.weight", hd)
        self.norm(p + "self_attn.k_norm.weight", hd)
        self.linear(p + "mlp.gate_proj.weight", inter, h)
        self.linear(p + "mlp.up_proj.weight", inter, h)
        self.linear(p + "mlp.down_proj.weight", h, inter)

    def const(self, name: str, shape: tuple[int, ...], value: float) -> None:
        self.tensors[name] = np.full(shape, value, dtype=np.float32)


def target_weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Tensors named as in transformers' Gemma4ForCausalLM state_dict."""
    w = _Init(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    inter = cfg["intermediate_size"]
    # Embedding is multiplied by sqrt(hidden) in the model: unit-RMS rows after scaling.
    w.normal("model.embed_tokens.weight", (v, h), 1.0 / np.sqrt(h))
    for i, layer_type in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        full = layer_type == FULL
        hd = cfg["global_head_dim"] if full else cfg["head_dim"]
        k_eq_v = cfg["attention_k_eq_v"] and full
        n_kv = cfg["num_global_key_value_heads"] if k_eq_v else cfg["num_key_value_heads"]
        n_q = cfg["num_attention_heads"]
        w.attention_and_mlp(p, h, n_q, n_kv, hd, inter, v_proj=not k_eq_v)
        for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            w.norm(p + n + "_layernorm.weight", h)
        if cfg["enable_moe_block"]:
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            w.linear(p + "router.proj.weight", e, h)
            w.norm(p + "router.scale", h)
            w.norm(p + "router.per_expert_scale", e)
            # gate rows first, then up rows (HF chunks the output in two; mlx-lm splits axis -2)
            w.normal(p + "experts.gate_up_proj", (e, 2 * mi, h), 1.0 / np.sqrt(h))
            w.normal(p + "experts.down_proj", (e, h, mi), 1.0 / np.sqrt(mi))
            for n in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                w.norm(p + n + ".weight", h)
        w.const(p + "layer_scalar", (1,), 1.0)
    w.norm("model.norm.weight", h)
    if not cfg["tie_word_embeddings"]:
        w.linear("lm_head.weight", v, h, gain=LOGIT_STD)
        w.tensors["lm_head.weight"][: len(tk.SPECIAL_TOKENS)] *= SPECIAL_LOGIT_DAMP
    return w.tensors


def draft_weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Tensors named as the DFlash reference drafter (dflash.model / model_mlx)."""
    w = _Init(seed + 1_000_003)  # independent of the target's streams
    h = cfg["hidden_size"]
    n_ctx = len(cfg["dflash_config"]["target_layer_ids"])
    hd, n_q, n_kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter = cfg["intermediate_size"]
    w.linear("fc.weight", h, n_ctx * h)
    w.norm("hidden_norm.weight", h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.attention_and_mlp(p, h, n_q, n_kv, hd, inter)
        w.norm(p + "input_layernorm.weight", h)
        w.norm(p + "post_attention_layernorm.weight", h)
    w.norm("norm.weight", h)
    return w.tensors


def write_target_config(target: Path, cfg: dict[str, Any]) -> None:
    """A target's config.json and its generation_config.json (greedy, the project tokenizer's ids)."""
    tk.write_json(target / "config.json", cfg)
    generation = {"bos_token_id": tk.BOS_ID, "do_sample": False, "eos_token_id": tk.EOS_ID, "pad_token_id": tk.PAD_ID}
    tk.write_json(target / "generation_config.json", generation)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: tensors[k] for k in sorted(tensors)}, str(path), metadata={"format": "pt"})


_CARD = """\
# kakeya tiny Gemma-4 target + DFlash drafter (random weights)

Generated by `kakeya make-tiny` (`kakeya.checkpoints.tiny.make_tiny`) with
{args}. **The weights are random**: the pair exists to test correctness
(speculative output == target greedy output, cache bookkeeping, wire format,
loading through mlx-lm, transformers and the DFlash reference), never quality.

- `target/`: `gemma4_text` / `Gemma4ForCausalLM`, float32, hidden {HIDDEN},
  {NUM_LAYERS} layers `S S F S S F`, sliding window {window}, head_dim {HEAD_DIM} (full layers
  {GLOBAL_HEAD_DIM}, k_eq_v, {NUM_GLOBAL_KV_HEADS} KV head), proportional partial RoPE on full layers,
  soft-cap {SOFTCAP}, untied LM head{moe}. Byte-level BPE tokenizer
  (vocab {vocab}, Gemma special ids: pad 0, eos 1, bos 2, unk 3, mask 4)
  trained on the Python standard library's sources.
- `draft/`: DFlash drafter, {DRAFT_LAYERS} layers, block {BLOCK_SIZE},
  target_layer_ids {TARGET_LAYER_IDS}, mask_token_id {MASK_ID}.

Same seed gives byte-identical weights and configs; `manifest.json` records
file hashes and the tokenizer corpus fingerprint (the tokenizer depends on the
Python version whose standard library it was trained on).
"""


def make_tiny(
    out_dir: str | Path,
    seed: int = 0,
    sliding_window: int = 32,
    moe: bool = False,
    vocab_size: int = tk.DEFAULT_VOCAB_SIZE,
    progress: tk.Progress | None = None,
) -> TinyPair:
    """Write ``out_dir/target`` and ``out_dir/draft`` (and README.md, manifest.json)."""
    if vocab_size < MIN_IDS_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_IDS_VOCAB_SIZE} (the special ids and a few more), got {vocab_size}"
        )
    out = Path(out_dir)
    target, draft = out / "target", out / "draft"
    for d in (target, draft):
        d.mkdir(parents=True, exist_ok=True)

    # Below the byte-level tokenizer's minimum the pair speaks token ids only: small enough to
    # enumerate a distribution exactly (the lossless-sampling tests use vocab 32..64).
    with_tokenizer = vocab_size >= tk.MIN_VOCAB_SIZE
    if with_tokenizer:
        tk.write_tokenizer(tk.train_tokenizer(vocab_size, progress=progress), target)

    tcfg = target_config(sliding_window=sliding_window, moe=moe, vocab_size=vocab_size)
    write_target_config(target, tcfg)
    if progress is not None:
        progress(f"writing target weights to {target}")
    write_safetensors(target / "model.safetensors", target_weights(tcfg, seed))

    dcfg = draft_config(vocab_size=vocab_size)
    tk.write_json(draft / "config.json", dcfg)
    if progress is not None:
        progress(f"writing draft weights to {draft}")
    write_safetensors(draft / "model.safetensors", draft_weights(dcfg, seed))

    args = {"seed": seed, "sliding_window": sliding_window, "moe": moe, "vocab_size": vocab_size}
    (out / "README.md").write_text(
        _CARD.format(
            args=", ".join(f"`{k}={v}`" for k, v in args.items()),
            window=sliding_window,
            vocab=vocab_size,
            moe=f", MoE block ({NUM_EXPERTS} experts, top {TOP_K_EXPERTS})" if moe else "",
            MASK_ID=tk.MASK_ID,
            **{k: v for k, v in globals().items() if k.isupper()},  # the architecture's constants, by name
        ),
        encoding="utf-8",
    )
    files = sorted(p.relative_to(out).as_posix() for d in (target, draft) for p in d.iterdir() if p.is_file())
    tk.write_json(
        out / "manifest.json",
        {
            "generator": "kakeya.checkpoints.tiny.make_tiny",
            "args": args,
            "tokenizer_corpus": {"python": ".".join(map(str, sys.version_info[:3])), "sha256": tk.corpus_fingerprint()}
            if with_tokenizer
            else None,
            "files": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in files},
        },
    )
    return TinyPair(target=target, draft=draft)


def default_pair() -> TinyPair:
    """The embedded default pair shipped in ``services/models/tiny``."""
    pair = TinyPair(target=DEFAULT_DIR / "target", draft=DEFAULT_DIR / "draft")
    for d in (pair.target, pair.draft):
        if not (d / "config.json").is_file():
            raise CheckpointError(
                f"{d}: embedded default checkpoint is missing config.json"
                " (regenerate with `kakeya make-tiny --out services/models/tiny`)"
            )
    return pair


DEMO_DIR = DEFAULT_DIR.parent / "demo"


def demo_pair() -> TinyPair | None:
    """The trained demo pair in ``services/models/demo`` (``kakeya train-target`` / ``train-drafter``), or None when it
    is not shipped (both directories need config.json and model.safetensors)."""
    pair = TinyPair(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft")
    for d in (pair.target, pair.draft):
        if not ((d / "config.json").is_file() and (d / "model.safetensors").is_file()):
            return None
    return pair


def embedded_pair() -> TinyPair:
    """What ``kakeya generate`` uses with no model flags: the trained demo pair when
    shipped, else the tiny random pair (tests use :func:`default_pair` explicitly)."""
    return demo_pair() or default_pair()
