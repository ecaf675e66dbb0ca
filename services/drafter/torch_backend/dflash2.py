"""The DFlash2 drafter (``DFlash2DraftModel``) in PyTorch: DFlash plus a grouped causal convolution over each block's
rows and a candidate selector whose walk picks the draft, as vLLM's ``qwen3_dflash2.py`` and ``dflash2/speculator.py``
define them (read, not copied). ``docs/dflash2.md`` describes both, the walk's realized rows this hands back as logits
(argmax = the walk's token, ``-inf`` off its candidates), and where a row's predecessor comes from. The context is not
convolved, so the pooled context caches are DFlash's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kakeya.drafter.backend import conv_layer
from kakeya.drafter.config import DFlashConfig
from kakeya.drafter.torch_backend.model import DecoderLayer, DFlashDraftModel


class GroupedConv(nn.Module):
    """``base_kernel`` [2 sides, taps, hidden] plus per-row deltas from ``kernel_projection``."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group = taps, group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)

    def deltas(self, a: torch.Tensor) -> torch.Tensor:
        """Per-row coefficient deltas [rows, 2, taps, hidden] of normed rows ``a`` [rows, hidden]."""
        d = self.kernel_projection(a).view(a.shape[0], 2, self.taps, -1)
        return d.repeat_interleave(self.group, dim=-1)

    def apply(self, x: torch.Tensor, deltas: torch.Tensor, side: int, lanes: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` [rows, hidden] convolved causally within their blocks (``lanes``: each row's
        index in its block; a tap reaching before the block's first row contributes nothing)."""
        coeff = self.base_kernel[side] + deltas[:, side]  # [rows, taps, hidden]
        out = coeff[:, 0] * x
        for tap in range(1, self.taps):
            shifted = F.pad(x[:-tap], (0, 0, tap, 0))
            out = out + coeff[:, tap] * shifted * (lanes >= tap).to(x.dtype)[:, None]
        return out


class ConvDecoderLayer(DecoderLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        f = config.dflash2
        self.attention_conv = GroupedConv(config.hidden_size, f.conv_kernel_size, f.conv_group_size)
        self.mlp_conv = GroupedConv(config.hidden_size, f.conv_kernel_size, f.conv_group_size)

    def step(self, x: torch.Tensor, cos, sin, lanes: torch.Tensor, attend) -> torch.Tensor:
        """Block rows ``x`` [1, rows, hidden] through the layer (``backend.conv_layer``); ``attend(q, k, v)`` is
        the batched step's attention over each block's own context and block."""

        def attention(rows: torch.Tensor) -> torch.Tensor:
            out = attend(*self.self_attn.qkv(rows[None], cos, sin))
            return self.self_attn.o_proj(out.transpose(1, 2).reshape(out.shape[2], -1))

        return conv_layer(self, x, lanes, attention)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def scores(self, h: torch.Tensor, cand: torch.Tensor, unary: torch.Tensor, pred_ids: torch.Tensor):
        """Edge scores [rows, k predecessors, k candidates] (float32)."""
        g = self.hidden_projection(h).float()
        pred = self.predecessor_codebook[pred_ids].float() * g[:, None]
        succ = self.successor_codebook[cand].float()
        return unary[:, None, :] + torch.einsum("jpr,jcr->jpc", pred, succ)


class DFlash2DraftModel(DFlashDraftModel):
    def __init__(self, config: DFlashConfig):
        if config.dflash2 is None:
            raise ValueError("DFlash2DraftModel needs dflash_config's DFlash2 fields")
        super().__init__(config)
        self.layers = nn.ModuleList(ConvDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        f = config.dflash2
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, f.selector_rank, f.selector_top_k
        )

    convolves = True

    def compile_layers(self) -> None:
        """``--compile``: the context K/V projection only (the conv layers' step runs eagerly)."""
        from kakeya.backends.torch.ops import compiled

        self.layers_kv = compiled(self.layers_kv)

    def run_layers(self, x, cos, sin, attention, lanes: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            spec = layer.self_attn.spec
            x = layer.step(x, cos, sin, lanes, lambda q, k, v, i=i, spec=spec: attention(i, spec, q, k, v))
        return x

    def select(self, h: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, lanes: torch.Tensor, walk: int):
        """Greedy tokens [drafts] and realized rows [drafts, vocab] of the drafted rows' hidden ``h``
        [drafts, hidden] (block rows ``rows``, whose block tokens are ``ids``); ``walk``: the longest run
        of drafted rows after a known token (a static bound: the walk's iterations)."""
        logits = self.compute_logits(h)
        unary, cand = torch.topk(logits, self.candidate_selector.top_k, dim=-1)
        before = rows - 1
        known = (lanes[before] == 0) | (ids[before] != self.config.mask_token_id)
        k = cand.shape[1]
        prev_cand = torch.cat([cand[:1], cand[:-1]])  # drafted row j-1's candidates: row j's when unknown
        pred_ids = torch.where(known[:, None], ids[before][:, None].expand(-1, k), prev_cand)
        scores = self.candidate_selector.scores(h, cand, unary, pred_ids)
        at = torch.arange(scores.shape[0], device=scores.device)
        choice = torch.zeros_like(at)
        prev = choice
        # Each pass settles one more row of every run (a row's choice needs its predecessor's).
        for _ in range(max(walk, 1)):
            prev = torch.where(known, 0, torch.cat([choice[:1], choice[:-1]]))
            choice = torch.argmax(scores[at, prev], dim=-1)
        realized = torch.full_like(logits, float("-inf")).scatter(1, cand, scores[at, prev])
        return cand[at, choice], realized
