"""The DFlash block trainer (torch) and the target continuations it learns from.

A data set is the TARGET's own continuations (greedy, and sampled at the temperatures asked for) with the
aux hidden states of every position and the target's final hidden state there (its next-token
distribution through the frozen LM head, for a soft-label loss); a batch is many blocks at once, context
K/V shared per sequence (the whole recipe: docs/demo-pair.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kakeya.checkpoints import tiny
from kakeya.checkpoints import tokenizer as tk
from kakeya.training import common, data
from kakeya.training.common import log


class TorchTarget:
    """The target through transformers: batched greedy continuations and aux capture."""

    def __init__(self, target_dir: Path, device):
        import torch
        from transformers import Gemma4ForCausalLM

        self.torch = torch
        cfg = json.loads((Path(target_dir) / "config.json").read_text())
        self.model = Gemma4ForCausalLM.from_pretrained(  # the layer types as written (an all-sliding target)
            str(target_dir), config=common.hf_text_config(cfg), dtype=torch.float32, attn_implementation="eager"
        )
        self.model.to(device).eval()
        self.device = device

    def continue_(self, prompts: np.ndarray, n_new: int, temperature: float, seed: int = 0) -> np.ndarray:
        """``[N, P]`` prompts -> ``[N, P + n_new]``: greedy at temperature 0, else sampled from
        softmax(logits / temperature) (no top-k/top-p), the draws seeded by ``seed``."""
        torch = self.torch
        ids = torch.from_numpy(prompts.astype(np.int64)).to(self.device)
        sample = temperature > 0
        if sample:
            torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=sample,
                **({"temperature": float(temperature), "top_k": 0, "top_p": 1.0} if sample else {}),
                eos_token_id=None,
                pad_token_id=tk.PAD_ID,
            )
        return out.cpu().numpy().astype(np.int32)

    def hidden_states(self, seqs: np.ndarray, layer_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(aux [N, T, len*hidden], final [N, T, hidden])`` float32 for every position: the outputs of
        decoder layers ``layer_ids`` and the final-norm hidden state (the LM head's input) -- one forward."""
        torch = self.torch
        got: dict[int, Any] = {}
        hooks = []
        for lid in layer_ids:

            def hook(_m, _i, out, lid=lid):
                got[lid] = out[0] if isinstance(out, tuple) else out

            hooks.append(self.model.model.layers[lid].register_forward_hook(hook))
        try:
            with torch.no_grad():
                final = self.model.model(torch.from_numpy(seqs.astype(np.int64)).to(self.device)).last_hidden_state
        finally:
            for h in hooks:
                h.remove()
        aux = torch.cat([got[l] for l in layer_ids], dim=-1) if layer_ids else final[..., :0]
        return aux.float().cpu().numpy(), final.float().cpu().numpy()


class Continuations(NamedTuple):
    """A drafter's training data: the target's continuations of prompts, per position.

    ``seqs`` [N, T] int32 (prompt + continuation); ``aux`` [N, T, A] float16 (the ``target_layer_ids`` layers' outputs);
    ``final`` [N, T, H] float16 (the target's final-norm hidden state); ``temperature`` [N] float32 (0: greedy)."""

    seqs: np.ndarray
    aux: np.ndarray
    final: np.ndarray
    temperature: np.ndarray


def make_dataset(
    target: TorchTarget,
    corpus_stream: np.ndarray,
    n_seq: int,
    prompt_len: int,
    gen_len: int,
    layer_ids,
    seed: int,
    gen_batch: int,
    quiet: bool = False,
    bos: bool = False,
    temperatures: Sequence[float] = (0.0,),
    out: Path | None = None,
) -> Continuations:
    """Prompts (random windows, ``<bos>`` first when ``bos``, as every real request starts) continued by the target:
    batch ``i`` at ``temperatures[i % len(temperatures)]`` (0: greedy; sampled batches seeded per batch). With ``out``
    every batch is written there into memory-mapped ``.npy`` files and an interrupted run continues after the last batch
    written; without it the arrays are built in memory (small sets, tests)."""
    rng = np.random.default_rng([seed, 7])
    prompts = data.sample_windows(corpus_stream, n_seq, prompt_len - bos, rng)
    if bos:
        prompts = np.concatenate([np.full((n_seq, 1), tk.BOS_ID, prompts.dtype), prompts], axis=1)
    T = prompt_len + gen_len
    arrays: Continuations | None = None
    done = 0
    if out is not None and (out / "progress.json").is_file():
        done = json.loads((out / "progress.json").read_text())["sequences"]
        arrays = Continuations(*(np.load(out / f"{f}.npy", mmap_mode="r+") for f in Continuations._fields))
    bar = common.Progress(n_seq, "target continuations", start=done, quiet=quiet)
    for k, i in enumerate(range(0, n_seq, gen_batch)):
        if i < done:
            continue
        temp = float(temperatures[k % len(temperatures)])
        s = target.continue_(prompts[i : i + gen_batch], gen_len, temp, seed=seed * 100_003 + k)
        aux, final = target.hidden_states(s, layer_ids)
        if arrays is None:
            shapes = {
                "seqs": ((n_seq, T), np.int32),
                "aux": ((n_seq, T, aux.shape[-1]), np.float16),
                "final": ((n_seq, T, final.shape[-1]), np.float16),
                "temperature": ((n_seq,), np.float32),
            }
            if out is None:
                arrays = Continuations(*(np.zeros(sh, dt) for sh, dt in shapes.values()))
            else:
                out.mkdir(parents=True, exist_ok=True)
                new = lambda f, sh, dt: np.lib.format.open_memmap(out / f"{f}.npy", mode="w+", shape=sh, dtype=dt)
                arrays = Continuations(*(new(f, sh, dt) for f, (sh, dt) in shapes.items()))
        j = i + len(s)
        arrays.seqs[i:j], arrays.aux[i:j], arrays.final[i:j], arrays.temperature[i:j] = s, aux, final, temp
        if out is not None:
            for a in arrays:
                a.flush()
            (out / "progress.json").write_text(json.dumps({"sequences": j}) + "\n")
        bar.update(j)
    bar.close()
    return arrays


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
        common.check_names(self.model.state_dict(), w, "the reference layout")
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
        self.model.to(device)
        head = load_target_head(target_dir, device=device, dtype=torch.float32)
        self.embed, self.head, self.device = head.embed.detach(), head.head.detach(), device

    def rows_on_device(self, x):
        """A batch's rows (``aux`` or ``final``) as a tensor on the trainer's device, in their stored dtype: a numpy
        array (gathered from the memory-mapped data), or a tensor already there (``--data-on-device``)."""
        t = x if isinstance(x, self.torch.Tensor) else self.torch.from_numpy(np.ascontiguousarray(x))
        return t.to(self.device)

    def target_logits(self, final: np.ndarray, anchors: np.ndarray, B: int):
        """The target's logits ``[N*K, B-1, vocab]`` for the tokens block positions ``1..B-1`` predict:
        position ``a+k`` is predicted from the target's final hidden state at ``a+k-1``."""
        torch = self.torch
        N, K = anchors.shape
        rows = anchors[..., None] + np.arange(B - 1)  # [N, K, B-1]: positions a .. a+B-2
        fin = self.rows_on_device(final)  # [N, T, H]
        at = torch.from_numpy(rows.reshape(N, -1)).to(self.device)[..., None].expand(-1, -1, fin.shape[-1])
        h = torch.gather(fin, 1, at).float()
        return self.capped(self.torch.nn.functional.linear(h, self.head)).reshape(N * K, B - 1, -1)

    def capped(self, logits):
        """Gemma's final soft-cap, as target and drafter apply it to their logits."""
        cap = self.dcfg.final_logit_softcapping
        return self.torch.tanh(logits / cap) * cap if cap else logits

    def block_logits(self, seqs: np.ndarray, aux: np.ndarray, anchors: np.ndarray, B: int):
        """Drafter logits ``[N*K, B-1, vocab]`` and labels ``[N*K, B-1]`` for blocks after ``anchors`` [N, K]."""
        from kakeya.drafter.context import Segment
        from kakeya.drafter.torch_backend.model import GivenContext

        torch, F, m, c = self.torch, self.torch.nn.functional, self.model, self.dcfg
        N, T = seqs.shape
        K = anchors.shape[1]
        dev = self.device
        ids = torch.from_numpy(seqs.astype(np.int64)).to(dev)
        a = torch.from_numpy(anchors.astype(np.int64)).to(dev)  # [N, K]
        h_ctx = m.hidden_norm(m.fc(self.rows_on_device(aux).float()))  # [N, T, H]
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
        block = torch.ones(N * K, B, B, dtype=torch.bool, device=dev)
        mask = torch.cat([vis_ctx[:, None, :].expand(-1, B, -1), block], -1)[:, None]  # [NK, 1, B, T+B]
        for layer, (ck, cv) in zip(m.layers, ctx):
            if layer.self_attn.spec.is_causal or layer.self_attn.spec.window is not None:
                raise ValueError("the block trainer supports full-attention, non-causal drafter layers only")
            x = layer(x, cos, sin, [Segment(GivenContext(ck, cv), None, mask, B)])  # blocks: the batch axis
        hfin = m.norm(x)[:, 1:]  # [NK, B-1, H]
        logits = F.linear(hfin, self.head)
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        return self.capped(logits), labels

    def loss(
        self,
        seqs: np.ndarray,
        aux: np.ndarray,
        anchors: np.ndarray,
        B: int,
        gamma: float,
        final: np.ndarray | None = None,
        hard: np.ndarray | None = None,
        soft_weight: float = 0.0,
    ):
        """Mean position-weighted loss over ``N*K`` blocks and the per-position accuracy ``[B-1]`` (the
        drafter's argmax is the continuation's token). Per position: ``hard[n]`` (default 1) x cross-entropy
        against the continuation's token + ``soft_weight`` x KL(p || q), p the target's next-token
        distribution (from ``final``), q the drafter's: a sampled continuation's tokens are draws from p, so
        p teaches it the whole distribution, what sampled requests accept against."""
        torch, F = self.torch, self.torch.nn.functional
        N, K = anchors.shape
        dev = self.device
        logits, labels = self.block_logits(seqs, aux, anchors, B)
        logq = F.log_softmax(logits, dim=-1)
        per = -torch.gather(logq, -1, labels[..., None])[..., 0]  # [N*K, B-1] hard CE
        if hard is not None:
            per = per * torch.from_numpy(np.repeat(hard.astype(np.float32), K)).to(dev)[:, None]
        if soft_weight:
            logp = F.log_softmax(self.target_logits(final, anchors, B), dim=-1)
            per = per + soft_weight * (logp.exp() * (logp - logq)).sum(-1)
        w = torch.exp(-torch.arange(B - 1, device=dev, dtype=torch.float32) / gamma)
        loss = (per * w).sum() / (w.sum() * N * K)
        return loss, (logits.argmax(-1) == labels).float().mean(0)

    def load_weights(self, draft_dir: Path) -> None:
        """The drafter weights of a reference-layout checkpoint directory (strict)."""
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(Path(draft_dir) / "model.safetensors"), strict=True)

    def tensors(self) -> dict[str, np.ndarray]:
        return {k: v.detach().float().cpu().numpy() for k, v in self.model.state_dict().items()}


def cached_continuations(path: Path, key: dict, make, quiet: bool) -> tuple[Continuations, float]:
    """``(continuations, seconds it took to make them)`` from the folder ``path`` when it holds a finished set
    made with ``key``, else ``make(path)`` (which continues a set an interrupted run left half made there).
    The arrays are memory-mapped: a set is gigabytes, and a step reads only its batch."""
    meta = path / "key.json"
    saved = json.loads(meta.read_text()) if meta.is_file() else None
    if saved is not None and saved["key"] == key and saved.get("finished"):
        data_ = Continuations(*(np.load(path / f"{f}.npy", mmap_mode="r") for f in Continuations._fields))
        if not quiet:
            log(f"reusing {len(data_.seqs)} target continuations from {path}")
        return data_, float(saved["data_s"])
    if saved is None or saved["key"] != key:  # another set (or none): start afresh
        for f in path.glob("*") if path.is_dir() else ():
            f.unlink()
        saved = {"key": key, "data_s": 0.0}
    path.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(saved) + "\n")
    t0 = time.time()
    make(path)
    meta.write_text(json.dumps({"key": key, "data_s": saved["data_s"] + time.time() - t0, "finished": True}) + "\n")
    return cached_continuations(path, key, make, quiet=True)
