"""The DFlash drafter's config, read from a checkpoint's ``config.json`` (backend-neutral).

Shared by ``drafter/mlx_backend/model.py`` and ``drafter/torch_backend/model.py`` so both backends accept and
refuse exactly the same checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kakeya.checkpoints.config import PATH_KEY, draft_config, load_draft_config
from kakeya.core.contract import FULL, SLIDING, check_layer_types


@dataclass(frozen=True)
class LayerAttention:
    """One drafter layer's attention, as both backends' ``Attention`` build it."""

    n_heads: int
    n_kv: int  # key/value heads
    head_dim: int
    window: int | None  # the context positions a query sees: p_query - p_key < window (None: all)
    is_causal: bool  # a block row sees only the block rows up to its own (default: on sliding layers)
    scale: float  # the attention scale, head_dim ** -0.5


DFLASH = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Fields:
    """``dflash_config``'s DFlash2 fields, as vLLM's ``qwen3_dflash2.py`` reads them."""

    conv_kernel_size: int  # taps of the convolution: row i mixes rows i, i-1, .. of its own block
    conv_group_size: int  # channels sharing one predicted coefficient per tap
    selector_rank: int  # rank of the selector's codebooks
    selector_top_k: int  # candidates per drafted row

    @classmethod
    def from_dflash_config(cls, dfl: dict, hidden_size: int) -> DFlash2Fields:
        values = {}
        for key in DFLASH2_FIELDS:
            value = dfl.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{DFLASH2} config.json: dflash_config.{key} must be a positive integer, got {value!r}"
                )
            values[key] = value
        if hidden_size % values["conv_group_size"]:
            raise ValueError(
                f"{DFLASH2} config.json: dflash_config.conv_group_size {values['conv_group_size']}"
                f" does not divide hidden_size {hidden_size}"
            )
        return cls(**values)


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None
    rope_scaling: dict | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    is_causal: bool | None = None
    hidden_act: str = "silu"
    # DFlash2 (``DFlash2DraftModel``, ``drafter/torch_backend/dflash2.py``): a grouped causal convolution
    # over the block rows around each layer's attention and MLP, and a low-rank candidate selector that
    # walks the top-k of each row. None on a DFlash drafter.
    dflash2: DFlash2Fields | None = None
    raw: dict = field(default_factory=dict, repr=False)
    aux_width: int = field(init=False)  # one aux row: len(target_layer_ids) * hidden_size

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        self.aux_width = len(self.target_layer_ids) * self.hidden_size
        if not self.target_layer_ids:
            raise ValueError("dflash_config.target_layer_ids must not be empty")
        if not self.layer_types:
            self.layer_types = (FULL,) * self.num_hidden_layers
        self.layer_types = tuple(self.layer_types)
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window is required for sliding_attention layers")
        if self.block_size < 1:
            raise ValueError(f"dflash_config.block_size must be >= 1, got {self.block_size}")
        top_k = self.dflash2.selector_top_k if self.dflash2 is not None else 0  # both backends' candidate selector
        if top_k > self.vocab_size:
            raise ValueError(f"dflash_config.selector_top_k {top_k} > vocab_size {self.vocab_size}")

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention: every layer has the same heads, a sliding one a window."""
        sliding = self.layer_types[layer] == SLIDING
        return LayerAttention(
            n_heads=self.num_attention_heads,
            n_kv=self.num_key_value_heads,
            head_dim=self.head_dim,
            window=int(self.sliding_window) if sliding else None,
            is_causal=sliding if self.is_causal is None else bool(self.is_causal),
            scale=self.head_dim**-0.5,
        )

    @classmethod
    def from_dict(cls, cfg: dict, draft_dir: str | Path | None = None) -> DFlashConfig:
        """The drafter of a ``config.json`` dict, read through ``checkpoints.config.draft_config`` (every
        published spelling, one reading; ``draft_dir`` names the file in its errors)."""
        archs = cfg.get("architectures") or []
        other = [a for a in archs if "DFlash2" in a and a != DFLASH2]
        if other:
            raise ValueError(f"unsupported draft architecture {other}: expected {DFLASH!r} or {DFLASH2!r}")
        cfg = draft_config(cfg, draft_dir)
        dfl = cfg["dflash_config"]
        rope = cfg["rope_parameters"]
        softcap = dfl.get("final_logit_softcapping")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg["head_dim"]),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            block_size=int(dfl["block_size"]),
            target_layer_ids=tuple(dfl["target_layer_ids"]),
            mask_token_id=int(dfl["mask_token_id"]),
            num_target_layers=cfg.get("num_target_layers"),
            rope_scaling=rope,
            layer_types=tuple(cfg.get("layer_types") or ()),
            sliding_window=cfg.get("sliding_window"),
            final_logit_softcapping=None if softcap is None else float(softcap),
            input_embedding_scale=float(dfl.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dfl.get("output_multiplier", 1.0)),
            is_causal=cfg.get("is_causal"),
            hidden_act=cfg.get("hidden_act", "silu"),
            dflash2=DFlash2Fields.from_dflash_config(dfl, int(cfg["hidden_size"])) if DFLASH2 in archs else None,
            raw={k: v for k, v in cfg.items() if k != PATH_KEY},
        )

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> DFlashConfig:
        return cls.from_dict(load_draft_config(draft_dir), draft_dir)
