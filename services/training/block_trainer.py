"""The DFlash block trainer (torch) and the target continuations it learns from.

A data set is the TARGET's own greedy continuations with the aux hidden states
of every position; a batch is many blocks at once, context K/V shared per
sequence (see ``drafter.py`` for the whole recipe).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kakeya.checkpoints import tiny
from kakeya.checkpoints import tokenizer as tk
from kakeya.training import common, data


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class TorchTarget:
    """The target through transformers: batched greedy continuations and aux capture."""

    def __init__(self, target_dir: Path, device):
        import torch
        from transformers import Gemma4ForCausalLM

        self.torch = torch
        self.model = Gemma4ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, attn_implementation="eager")
        self.model.to(device).eval()
        self.device = device

    def greedy(self, prompts: np.ndarray, n_new: int) -> np.ndarray:
        """``[N, P]`` prompts -> ``[N, P + n_new]`` (prompt + greedy continuation, no early stop)."""
        torch = self.torch
        ids = torch.from_numpy(prompts.astype(np.int64)).to(self.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tk.PAD_ID,
            )
        return out.cpu().numpy().astype(np.int32)

    def aux(self, seqs: np.ndarray, layer_ids: Sequence[int]) -> np.ndarray:
        """Outputs of decoder layers ``layer_ids`` for every position -> ``[N, T, len*hidden]`` float32."""
        torch = self.torch
        got: dict[int, Any] = {}
        hooks = []
        for lid in layer_ids:
            def hook(_m, _i, out, lid=lid):
                got[lid] = out[0] if isinstance(out, tuple) else out
            hooks.append(self.model.model.layers[lid].register_forward_hook(hook))
        try:
            with torch.no_grad():
                self.model.model(torch.from_numpy(seqs.astype(np.int64)).to(self.device))
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([got[l] for l in layer_ids], dim=-1).float().cpu().numpy()


def make_dataset(target: TorchTarget, corpus_stream: np.ndarray, n_seq: int, prompt_len: int, gen_len: int,
                 layer_ids, seed: int, gen_batch: int, quiet: bool = False,
                 bos: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (random windows, ``<bos>`` first when ``bos``: every real request starts with it, and
    the target's hidden states at every later position carry it) continued greedily by the target."""
    rng = np.random.default_rng([seed, 7])
    prompts = data.sample_windows(corpus_stream, n_seq, prompt_len - bos, rng)
    if bos:
        prompts = np.concatenate([np.full((n_seq, 1), tk.BOS_ID, prompts.dtype), prompts], axis=1)
    seqs, auxs = [], []
    bar = common.Progress(n_seq, "target continuations", quiet=quiet)
    for i in range(0, n_seq, gen_batch):
        s = target.greedy(prompts[i : i + gen_batch], gen_len)
        seqs.append(s)
        auxs.append(target.aux(s, layer_ids).astype(np.float16))
        bar.update(min(i + gen_batch, n_seq))
    bar.close()
    return np.concatenate(seqs), np.concatenate(auxs)


# --------------------------------------------------------------------------- the training forward


class BlockTrainer:
    """DFlash block loss for many blocks at once (torch)."""

    def __init__(self, cfg: dict, target_dir: Path, seed: int, device):
        import torch

        from kakeya.drafter.torch_backend import model as dt
        from kakeya.drafter.torch_backend.load import load_target_head

        self.torch = torch
        torch.manual_seed(seed)
        self.dcfg = dt.DFlashConfig.from_dict(cfg)
        self.model = dt.DFlashDraftModel(self.dcfg)
        w = tiny.draft_weights(cfg, seed)
        sd_names = set(self.model.state_dict())
        if sd_names != set(w):
            raise RuntimeError(f"draft parameter names differ from the reference layout: {sorted(sd_names ^ set(w))[:8]}")
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
        self.model.to(device)
        head = load_target_head(target_dir, device=device, dtype=torch.float32)
        self.embed = head.embed.detach()
        self.head = head.head.detach()
        self.device = device

    def block_logits(self, seqs: np.ndarray, aux: np.ndarray, anchors: np.ndarray, B: int):
        """Drafter logits ``[N*K, B-1, vocab]`` and labels ``[N*K, B-1]`` for blocks after ``anchors`` [N, K]."""
        from kakeya.drafter.context import Segment
        from kakeya.drafter.torch_backend.context import GivenContext

        torch, F, m, c = self.torch, self.torch.nn.functional, self.model, self.dcfg
        N, T = seqs.shape
        K = anchors.shape[1]
        dev = self.device
        ids = torch.from_numpy(seqs.astype(np.int64)).to(dev)
        a = torch.from_numpy(anchors.astype(np.int64)).to(dev)  # [N, K]
        h_ctx = m.hidden_norm(m.fc(torch.from_numpy(aux).to(dev).float()))  # [N, T, H]
        cos_c, sin_c = m.rope([(0, T)])
        ctx = [layer.self_attn.kv(h_ctx, cos_c, sin_c) for layer in m.layers]  # each [N, kv, T, hd]
        ctx = [(k.repeat_interleave(K, 0), v.repeat_interleave(K, 0)) for k, v in ctx]
        # blocks: [token a, mask ...] at positions a..a+B-1
        offs = torch.arange(B, device=dev)
        pos = a[..., None] + offs  # [N, K, B]
        blk = torch.full((N, K, B), c.mask_token_id, dtype=torch.long, device=dev)
        blk[..., 0] = torch.gather(ids, 1, a)
        labels = torch.gather(ids, 1, (pos[..., 1:]).reshape(N, -1)).reshape(N * K, B - 1)
        x = F.embedding(blk.reshape(N * K, B), self.embed)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        p = pos.reshape(N * K, B).float()
        freqs = p[..., None] * m.inv_freq.to(dev)[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = (emb.cos() * m.rope_scale)[:, None], (emb.sin() * m.rope_scale)[:, None]  # [NK,1,B,hd]
        vis_ctx = torch.arange(T, device=dev)[None, :] < a.reshape(-1)[:, None]  # [NK, T]: positions < a
        mask = torch.cat([vis_ctx[:, None, :].expand(-1, B, -1), torch.ones(N * K, B, B, dtype=torch.bool, device=dev)], -1)
        mask = mask[:, None]  # [NK, 1, B, T+B]
        for layer, (ck, cv) in zip(m.layers, ctx):
            if layer.self_attn.spec.is_causal or layer.self_attn.spec.window is not None:
                raise ValueError("the block trainer supports full-attention, non-causal drafter layers only")
            x = layer(x, cos, sin, [Segment(GivenContext(ck, cv), None, mask, B)])  # blocks: the batch axis
        hfin = m.norm(x)[:, 1:]  # [NK, B-1, H]
        logits = F.linear(hfin, self.head)
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        cap = c.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits, labels

    def loss(self, seqs: np.ndarray, aux: np.ndarray, anchors: np.ndarray, B: int, gamma: float):
        """Mean weighted CE over ``N*K`` blocks; returns (loss, per-position accuracy [B-1])."""
        torch, F = self.torch, self.torch.nn.functional
        N, K = anchors.shape
        dev = self.device
        logits, labels = self.block_logits(seqs, aux, anchors, B)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").reshape(N * K, B - 1)
        w = torch.exp(-torch.arange(B - 1, device=dev, dtype=torch.float32) / gamma)
        loss = (ce * w).sum() / (w.sum() * N * K)
        acc = (logits.argmax(-1) == labels).float().mean(0)
        return loss, acc

    def load_weights(self, draft_dir: Path) -> None:
        """The drafter weights of a reference-layout checkpoint directory (strict)."""
        from safetensors.numpy import load_file

        w = load_file(Path(draft_dir) / "model.safetensors")
        self.model.load_state_dict({k: self.torch.from_numpy(v) for k, v in w.items()}, strict=True)

    def tensors(self) -> dict[str, np.ndarray]:
        return {k: v.detach().float().cpu().numpy() for k, v in self.model.state_dict().items()}


def cached_continuations(path: Path, key: dict, make, quiet: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """``(seqs, aux, seconds it took to make them)`` from ``path`` when its key matches, else ``make()`` and save."""
    if path.is_file():
        z = np.load(path)
        if json.loads(str(z["key"])) == key:
            if not quiet:
                log(f"reusing {len(z['seqs'])} target continuations from {path}")
            return z["seqs"], z["aux"], float(z["data_s"])
    t0 = time.time()
    seqs, aux = make()
    took = time.time() - t0
    np.savez(path, seqs=seqs, aux=aux, key=json.dumps(key), data_s=took)
    return seqs, aux, took
