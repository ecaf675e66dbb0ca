"""Sampling on PyTorch: the coupled rule's noisy argmax; the processed distribution, inverse-CDF draws
and the acceptance test of the rejection rule.

Mirrors the numpy reference (``tests/sampling/reference.py``) op for op, for the verifier and the drafter. The
coupled rule's Gumbel noise is made on the device (``core/noise.py``, int64 with 32-bit wrapping); the
rejection rule's uniforms come from the host. Only ints (and a drafter's [n, K] proposal) come back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kakeya.core import noise
from kakeya.core.contract import Proposal, TokenLogprobs
from kakeya.core.request import SamplingParams
from kakeya.core.sampling import inverse_temperature


@torch.inference_mode()
def gumbel(keys: tuple[int, int], first_position: int, rows: int, vocab: int, device) -> torch.Tensor:
    """The noise [rows, vocab] (float32) at positions ``first_position ..``, bit for bit ``noise.gumbel``'s uniforms."""
    positions = torch.arange(first_position, first_position + rows, device=device)[:, None]
    h = noise.bits(keys, positions, torch.arange(vocab, device=device), noise.wrap32)
    u = noise.uniform_levels(h).float() * noise.U_SCALE
    return -torch.log(-torch.log(u))


@torch.inference_mode()
def coupled_rows(logits: torch.Tensor, params: SamplingParams, keys: tuple[int, int], first_position: int) -> list[int]:
    """The coupled rule's token of each row of ``logits`` [L, V] (row i: position ``first_position + i``),
    in one host sync: argmax over p's support of logits * (1 / temperature) + G."""
    x = logits.float() * inverse_temperature(params)
    score = x + gumbel(keys, first_position, x.shape[0], x.shape[1], x.device)
    if params.filtered:
        ps, order = process_sorted(logits, params)
        keep = torch.zeros_like(ps, dtype=torch.bool).scatter_(-1, order, ps > 0)
        score = score.masked_fill(~keep, float("-inf"))
    return score.argmax(-1).tolist()


@torch.inference_mode()
def process_sorted(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """p over the last axis in descending order (ties by index): (probabilities float32, token ids)."""
    x = logits.float() / params.temperature
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)
    V = xs.shape[-1]
    keep = torch.ones_like(xs, dtype=torch.bool)
    if 0 < params.top_k < V:
        keep[..., params.top_k :] = False
    ps = torch.softmax(xs.masked_fill(~keep, float("-inf")), dim=-1)
    if params.top_p < 1:
        c = torch.cumsum(ps, dim=-1)  # against its own total, not 1: softmax's float32 sum is off by ~1e-5
        keep &= (c - ps) < params.top_p * c[..., -1:]
    if params.min_p > 0:
        keep &= ps >= params.min_p * ps[..., :1]
    ps = ps.masked_fill(~keep, 0.0)
    return ps / ps.sum(dim=-1, keepdim=True), order


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p [L, V] in vocabulary order."""
    ps, order = process_sorted(logits, params)
    return torch.zeros_like(ps).scatter_(-1, order, ps)


@torch.inference_mode()
def sample_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF of each row of the weights ``w`` [L, V] at ``u`` [L] (descending order, ties by index)."""
    ws, order = torch.sort(w, dim=-1, descending=True, stable=True)
    c = torch.cumsum(ws, dim=-1)
    k = (c <= u[:, None] * c[:, -1:]).sum(-1)
    k = torch.minimum(k, (w > 0).sum(-1) - 1)
    return order.gather(-1, k[:, None])[:, 0]


def sample_next(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """One token from p at the last row of ``logits`` [L, V]."""
    u_t = torch.tensor([u], dtype=torch.float32, device=logits.device)
    return int(sample_rows(process(logits[-1:], params), u_t).item())


@torch.inference_mode()
def verify_rows(
    logits: torch.Tensor, candidates: Sequence[int], proposal: Proposal | None, params: SamplingParams, u_acc, u_samp
) -> tuple[list[bool], list[int]]:
    """Acceptance of each candidate and the residual / bonus draws, in one host sync: candidate i
    (``block_ids[i+1]``) is tested at row i of ``logits`` [L, V] against the proposal's row i."""
    dev = logits.device
    p = process(logits, params)
    L, V = p.shape
    n = len(candidates)
    q = torch.zeros((L, V), dtype=torch.float32, device=dev)
    accepted = torch.zeros((0,), dtype=torch.bool, device=dev)
    if n:
        probs = proposal.probs / proposal.probs.sum(-1, keepdims=True)
        ids = torch.from_numpy(np.asarray(proposal.ids, np.int64)).to(dev)
        q[:n].scatter_add_(-1, ids, torch.from_numpy(np.asarray(probs, np.float32)).to(dev))
        rows, x = torch.arange(n, device=dev), torch.tensor(list(candidates), device=dev)
        accepted = torch.tensor(np.asarray(u_acc, np.float32), device=dev) * q[rows, x] < p[rows, x]
    samples = sample_rows((p - q).clamp_min(0.0), torch.tensor(np.asarray(u_samp, np.float32), device=dev))
    return accepted.tolist(), samples.tolist()


def proposal(logits: torch.Tensor, params: SamplingParams, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's top-``k`` of its processed q per row: host (ids [n, k] int32, probs [n, k] float32)."""
    ps, order = process_sorted(logits, params)
    k = min(k, ps.shape[-1])
    return order[:, :k].to(torch.int32).cpu().numpy(), ps[:, :k].cpu().numpy().astype(np.float32)


def logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Row i's raw log-probability of ``tokens[i]`` and its ``k`` most probable tokens (``TokenLogprobs``): the
    log_softmax, gather and top-k run here on the device in float32; only ``len(tokens) * (1 + 2k)`` numbers
    come back, in one host sync (float64 holds every id exactly)."""
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None])
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    rows = torch.cat([chosen.double(), top.values.double(), top.indices.double()], dim=-1).tolist()
    n = top.values.shape[-1]
    return [
        TokenLogprobs(t, r[0], tuple((int(i), v) for v, i in zip(r[1 : 1 + n], r[1 + n :])))
        for t, r in zip(tokens, rows)
    ]


@torch.inference_mode()
def restrict(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """``logits`` [L, V] with every token a grammar does not allow there at -inf. ``bitmask``: llguidance's
    packed rows [L, ceil(V / 32)] (int32, token t at bit t % 32 of word t // 32), uploaded as they are and
    expanded on the device. Not ``llguidance.torch.apply_token_bitmask_inplace``: it is ``torch.compile``d
    (a C++ toolchain on a CPU) and writes in place, where logprobs read the raw rows."""
    words = torch.from_numpy(np.ascontiguousarray(bitmask)).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    keep = ((words[:, :, None] >> shifts) & 1).view(words.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(keep == 0, float("-inf"))


@torch.inference_mode()
def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The greedy choice of each row of ``logits`` [L, V], in one host sync."""
    return torch.argmax(logits, dim=-1).tolist()
