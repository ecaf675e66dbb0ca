"""Weight loading for the torch Gemma-4 (``verifier/torch_backend/gemma4.py``) from a Hugging Face checkpoint.

Tensors are read one at a time from the safetensors files under their HF names (text-only or multimodal prefix, see
``checkpoints/layout.py``), cast and moved, and the q/k/v and gate/up projections are fused on the way in.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kakeya.checkpoints.config import load_target_config
from kakeya.checkpoints.layout import loading, torch_text_tensors
from kakeya.verifier.torch_backend.gemma4 import Gemma4Args, Gemma4Text


class _Reader:
    """Reads single tensors from the checkpoint's safetensors files, cast and moved."""

    def __init__(self, names: dict[str, Path], device: torch.device, dtype: torch.dtype):
        from safetensors import safe_open

        self.names, self.device, self.dtype = names, device, dtype
        self._open = {f: safe_open(str(f), framework="pt") for f in set(names.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise ValueError(f"no tensor {name!r} (a Gemma-4 text model has one)")  # named by ``loading``
        return self._open[self.names[name]].get_tensor(name).to(device=self.device, dtype=self.dtype)


def load_gemma4(path: str | Path, device: torch.device, dtype: torch.dtype) -> Gemma4Text:
    """The text model of the Hugging Face checkpoint at ``path`` (its ``config.json`` and
    safetensors), on ``device`` in ``dtype``, in eval mode."""
    path = Path(path)
    args = Gemma4Args.from_dict(load_target_config(path))  # every published spelling, read once
    names, text = torch_text_tensors(path, "weights", args.tie_word_embeddings)
    with torch.device("meta"):
        model = Gemma4Text(args)
    shapes = {name: b.shape for name, b in model.named_buffers()}  # what config.json makes each, on meta
    with loading(path, "target"):  # a tensor missing, of another shape, or torch.cat's of misfit projections
        _load_weights(model, _Reader(names, device, dtype), text.prefix, text.head)
        if bad := next(((n, b.shape) for n, b in model.named_buffers() if b.shape != shapes.get(n, b.shape)), None):
            raise ValueError(f"{bad[0]} is {list(bad[1])}, config.json makes it {list(shapes[bad[0]])}")
    model.fuse_norms()
    return model.eval()


def _load_weights(model: Gemma4Text, rd: _Reader, prefix: str, head: str | None) -> None:
    a, p = model.args, prefix
    model.embed = rd.get(p + "embed_tokens.weight")
    model.norm = rd.get(p + "norm.weight")
    if head is not None and not a.tie_word_embeddings:  # else lm_head stays None: tied to the embedding
        model.lm_head = rd.get(head + ".weight")
    if model.ple:
        model.embed_per_layer = rd.get(p + "embed_tokens_per_layer.weight")
        model.ple_model_proj = rd.get(p + "per_layer_model_projection.weight")
        model.ple_proj_norm = rd.get(p + "per_layer_projection_norm.weight")
    for i, layer in enumerate(model.layers):
        lp, at = f"{p}layers.{i}.", layer.attn
        ws = [rd.get(lp + "self_attn.q_proj.weight")]
        if at.has_kv:
            ws.append(rd.get(lp + "self_attn.k_proj.weight"))
            if not at.k_eq_v:
                ws.append(rd.get(lp + "self_attn.v_proj.weight"))
            at.k_norm = rd.get(lp + "self_attn.k_norm.weight")
        at.wqkv = torch.cat(ws, dim=0).contiguous()
        at.wo = rd.get(lp + "self_attn.o_proj.weight")
        at.q_norm = rd.get(lp + "self_attn.q_norm.weight")
        layer.w_gate_up = torch.cat([rd.get(f"{lp}mlp.{m}_proj.weight") for m in ("gate", "up")]).contiguous()
        layer.w_down = rd.get(lp + "mlp.down_proj.weight")
        layer.input_ln = rd.get(lp + "input_layernorm.weight")
        layer.post_attn_ln = rd.get(lp + "post_attention_layernorm.weight")
        layer.pre_ffn_ln = rd.get(lp + "pre_feedforward_layernorm.weight")
        layer.post_ffn_ln = rd.get(lp + "post_feedforward_layernorm.weight")
        if lp + "layer_scalar" in rd:
            layer.layer_scalar = rd.get(lp + "layer_scalar")
        else:
            layer.layer_scalar = torch.ones(1, device=rd.device, dtype=rd.dtype)
        if layer.moe is not None:
            m = layer.moe
            m.router_proj = rd.get(lp + "router.proj.weight")
            m.router_scale = rd.get(lp + "router.scale")
            m.per_expert_scale = rd.get(lp + "router.per_expert_scale")
            m.gate_up = rd.get(lp + "experts.gate_up_proj")
            m.down = rd.get(lp + "experts.down_proj")
            layer.post_ffn_ln_1 = rd.get(lp + "post_feedforward_layernorm_1.weight")
            layer.post_ffn_ln_2 = rd.get(lp + "post_feedforward_layernorm_2.weight")
            layer.pre_ffn_ln_2 = rd.get(lp + "pre_feedforward_layernorm_2.weight")
        if layer.ple:
            layer.ple_gate = rd.get(lp + "per_layer_input_gate.weight")
            layer.ple_proj = rd.get(lp + "per_layer_projection.weight")
            layer.ple_norm = rd.get(lp + "post_per_layer_input_norm.weight")
