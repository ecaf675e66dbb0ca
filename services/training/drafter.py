"""``kakeya train-drafter``: train a DFlash drafter for a target, the DFlash way.

1. **Data** -- prompts are random windows of the stdlib train split; the TARGET
   continues each greedily (batched generation), so every label is what the
   verifier would choose. The target's hidden states at ``target_layer_ids``
   (outputs of those decoder layers, as the verifier's aux capture returns them)
   are recorded for every position of prompt + continuation.
2. **Blocks** -- per sequence, ``--anchors`` random anchor positions ``a`` inside
   the continuation. Each block is ``[token a, mask x (B-1)]`` at positions
   ``a .. a+B-1``; its context is the aux of positions ``0 .. a-1`` (exactly what
   the drafter's context cache holds when the loop drafts after token ``a``).
   All blocks of a batch run in ONE forward (blocks in the batch dimension,
   context K/V shared per sequence, per-block visibility masks).
3. **Loss** -- cross-entropy of block positions ``1..B-1`` against the target's
   greedy tokens ``a+1 .. a+B-1``, weighted ``exp(-(k-1)/gamma)`` (earlier positions
   matter more: a block is accepted left to right). Embedding and LM head are the
   target's, frozen (block embedding = raw lookup x ``input_embedding_scale``).
4. **Report** -- acceptance length per block size on held-out prompts, measured
   with the real engine (``services.orchestrator.loop`` + MLX verifier/drafter).

Training runs on torch (``services.drafter.dflash_torch`` has the reference
parameter names); the checkpoint loads strictly in ``services.drafter.dflash_mlx``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from services.checkpoints import tiny
from services.checkpoints import tokenizer as tk

from . import common, data


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- config


def build_draft_config(target_cfg: dict, args) -> dict[str, Any]:
    cfg = tiny.draft_config(vocab_size=target_cfg["vocab_size"])
    tids = [int(x) for x in args.target_layer_ids.split(",")]
    n = target_cfg["num_hidden_layers"]
    if any(not 0 <= t < n for t in tids):
        raise ValueError(f"--target-layer-ids {tids} outside the target's {n} layers")
    cfg.update(
        hidden_size=target_cfg["hidden_size"],
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_target_layers=n,
        layer_types=["full_attention"] * args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        final_logit_softcapping=target_cfg.get("final_logit_softcapping"),
        block_size=args.block_size,
    )
    cfg["dflash_config"] = {
        "block_size": args.block_size,
        "target_layer_ids": tids,
        "mask_token_id": tk.MASK_ID,
        "input_embedding_scale": 1.0,
        "output_multiplier": 1.0,
    }
    return cfg


# --------------------------------------------------------------------------- target side (torch)


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

        from services.drafter import dflash_torch as dt

        self.torch, self.dt = torch, dt
        torch.manual_seed(seed)
        self.dcfg = dt.DFlashConfig.from_dict(cfg)
        self.model = dt.DFlashDraftModel(self.dcfg)
        w = tiny.draft_weights(cfg, seed)
        sd_names = set(self.model.state_dict())
        if sd_names != set(w):
            raise RuntimeError(f"draft parameter names differ from the reference layout: {sorted(sd_names ^ set(w))[:8]}")
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
        self.model.to(device)
        head = dt.load_target_head(target_dir, device=device, dtype=torch.float32)
        self.embed = head.embed.detach()
        self.head = head.head.detach()
        self.device = device

    def block_logits(self, seqs: np.ndarray, aux: np.ndarray, anchors: np.ndarray, B: int):
        """Drafter logits ``[N*K, B-1, vocab]`` and labels ``[N*K, B-1]`` for blocks after ``anchors`` [N, K]."""
        torch, F, m, c = self.torch, self.torch.nn.functional, self.model, self.dcfg
        N, T = seqs.shape
        K = anchors.shape[1]
        dev = self.device
        ids = torch.from_numpy(seqs.astype(np.int64)).to(dev)
        a = torch.from_numpy(anchors.astype(np.int64)).to(dev)  # [N, K]
        h_ctx = m.hidden_norm(m.fc(torch.from_numpy(aux).to(dev).float()))  # [N, T, H]
        cos_c, sin_c = m._cos_sin(0, T)
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
            if layer.self_attn.is_causal or layer.self_attn.window is not None:
                raise ValueError("the block trainer supports full-attention, non-causal drafter layers only")
            x = layer(x, self.dt.GivenContext(ck, cv), None, cos, sin, mask)
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


def replay(leading: np.ndarray) -> list[int]:
    """Tokens each block commits when the loop walks a sequence whose anchor ``i`` (``i``-th position
    after the prompt) has ``leading[i]`` right candidates: a block commits ``1 + leading[i]``."""
    out, i = [], 0
    while i < len(leading):
        out.append(1 + int(leading[i]))
        i += out[-1]
    return out


def leading_right(trainer: BlockTrainer, seqs: np.ndarray, aux: np.ndarray, prompt_len: int, B: int,
                  batch: int = 4) -> tuple[np.ndarray, np.ndarray, float]:
    """Teacher-forced blocks at EVERY anchor ``prompt_len .. T-B`` of each sequence.

    Returns ``leading`` [N, anchors] (right candidates before the first wrong one), ``right``
    [N * anchors, B-1] (each candidate right or not) and the mean cross-entropy. Labels are the
    target's greedy tokens and the context is the target's aux of them, exactly what the engine
    sees, so the candidates at anchor ``a`` are the ones the loop would draft there.
    """
    torch = trainer.torch
    anchors = np.arange(prompt_len, seqs.shape[1] - B + 1)
    ce_sum, n, leading, right = 0.0, 0, [], []
    was_training = trainer.model.training
    trainer.model.eval()
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            s = seqs[i : i + batch]
            anc = np.broadcast_to(anchors, (len(s), len(anchors)))
            logits, labels = trainer.block_logits(s, aux[i : i + batch].astype(np.float32), anc, B)
            ce_sum += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                              reduction="sum"))
            n += labels.numel()
            ok = (logits.argmax(-1) == labels).cpu().numpy().reshape(len(s), len(anchors), B - 1)
            right.append(ok.reshape(-1, B - 1))
            leading.append(np.cumprod(ok, axis=2).sum(2))
    trainer.model.train(was_training)
    return np.concatenate(leading), np.concatenate(right), ce_sum / n


def evaluate(trainer: BlockTrainer, seqs: np.ndarray, aux: np.ndarray, prompt_len: int, B: int) -> dict:
    """Held-out figures at block size ``B``.

    ``acceptance`` replays the loop on each sequence (:func:`replay`) and is tokens per block as
    the engine counts it. ``acceptance_uniform_anchors`` (1 + mean right run over all anchors)
    overstates it: a long accepted run is one block for the loop but many anchors, and the
    blocks after a miss start at the hard positions.
    """
    lead, right, ce = leading_right(trainer, seqs, aux, prompt_len, B)
    lengths = [n for row in lead for n in replay(row)]
    return {
        "block_size": B,
        "loss": round(ce, 5),
        "acc_per_position": [round(float(x), 4) for x in right.mean(0)],
        "acceptance": round(float(np.mean(lengths)), 4),
        "acceptance_uniform_anchors": round(1.0 + float(lead.mean()), 4),
        "blocks": len(lengths),
        "sequences": int(len(seqs)),
    }


# --------------------------------------------------------------------------- acceptance with the real engine


def heldout_prompts(corpus: data.Corpus, n: int, length: int) -> list[list[int]]:
    """``n`` held-out prompts of ``length`` tokens, evenly spaced over the held-out files, each starting with <bos>."""
    win = data.fixed_windows(corpus.heldout, n, length - 1)
    return [[tk.BOS_ID] + [int(t) for t in w] for w in win]


def measure_acceptance(target_dir: Path, draft_dir: Path, prompts: list[list[int]], block_sizes: Sequence[int],
                       max_tokens: int, backend: str = "mlx") -> dict:
    """Mean acceptance per block size with the real loop (``backend`` verifier + drafter, native cache)."""
    from services.orchestrator.assembly import build_local_engine
    from services.orchestrator.engine import Request

    engine = build_local_engine(str(target_dir), str(draft_dir), backend)
    out: dict = {}
    ref: list[list[int]] = []
    for p in prompts:
        ref.append(engine.generate(Request(p, max_tokens=max_tokens, block_size=1, ignore_eos=True)).token_ids)
    for B in block_sizes:
        lengths, lossless = [], True
        t0 = time.time()
        for p, r in zip(prompts, ref):
            g = engine.generate(Request(p, max_tokens=max_tokens, block_size=B, ignore_eos=True))
            lengths += g.acceptance_lengths
            lossless &= g.token_ids == r
        out[str(B)] = {
            "mean_acceptance": round(float(np.mean(lengths)), 4),
            "blocks": len(lengths),
            "histogram": np.bincount(lengths, minlength=B + 1)[1:].tolist(),
            "lossless_vs_block1": bool(lossless),
            "wall_s": round(time.time() - t0, 2),
        }
    return out


# --------------------------------------------------------------------------- main


def train(args) -> dict:
    import torch

    out = Path(args.out)
    target_dir = Path(args.target)
    common.seed_all(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tcfg = json.loads((target_dir / "config.json").read_text())
    cfg = build_draft_config(tcfg, args)
    tids = cfg["dflash_config"]["target_layer_ids"]
    tok = data.tokenizer_for(tcfg["vocab_size"], progress=None if args.quiet else log)
    corpus = data.load_corpus(tok, heldout_pct=args.heldout_pct)
    ckpt = out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)

    # 1. target continuations + aux (cached in ckpt/ so a resumed run reuses them); the held-out
    #    set continues prompts from held-out FILES, to watch the drafter on text it never saw.
    key = {"target": str(target_dir.resolve()), "prompt_len": args.prompt_len, "gen_len": args.gen_len,
           "tids": tids, "seed": args.seed} | ({"bos": True} if args.bos_prompts else {})
    target_box: list[TorchTarget] = []

    def get_target() -> TorchTarget:
        if not target_box:
            target_box.append(TorchTarget(target_dir, device))
        return target_box[0]

    seqs, aux, data_s = cached_continuations(
        ckpt / "data.npz", key | {"n_seq": args.sequences},
        lambda: make_dataset(get_target(), corpus.train, args.sequences, args.prompt_len, args.gen_len, tids,
                             args.seed, args.gen_batch, args.quiet, args.bos_prompts), args.quiet)
    val = None
    if args.val_sequences:
        vseqs, vaux, _ = cached_continuations(
            ckpt / "val.npz", key | {"n_seq": args.val_sequences, "split": "heldout"},
            lambda: make_dataset(get_target(), corpus.heldout, args.val_sequences, args.prompt_len, args.gen_len,
                                 tids, args.seed + 1, args.gen_batch, args.quiet, args.bos_prompts), args.quiet)
        val = (vseqs, vaux)
    target_box.clear()

    # 2. training
    trainer = BlockTrainer(cfg, target_dir, args.seed, device)
    params = [p for p in trainer.model.parameters()]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    meta = None
    if args.resume and (ckpt / "state.json").is_file():
        meta = json.loads((ckpt / "state.json").read_text())
        if meta.get("config") != cfg:
            raise ValueError(f"{ckpt}: checkpoint was trained with a different drafter config; drop --resume")
        st = torch.load(ckpt / "state.pt", map_location=device)
        trainer.model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
    elif args.init_from:
        init = Path(args.init_from)
        if json.loads((init / "config.json").read_text()) != cfg:
            raise ValueError(f"--init-from {init}: its config.json differs from this run's drafter config")
        trainer.load_weights(init)
    step = meta["step"] if meta else 0
    curve = meta["curve"] if meta else []
    val_curve = meta.get("val_curve", []) if meta else []
    train_s = meta["train_s"] if meta else 0.0
    block_sizes = [int(b) for b in args.train_block_sizes.split(",")] if args.train_block_sizes else [args.block_size]
    gamma = args.gamma
    P, T = args.prompt_len, seqs.shape[1]
    if T - max(block_sizes) < P:
        raise ValueError("--gen-len must be >= the largest training block size")
    if not args.quiet:
        log(f"drafter: {n_params/1e6:.2f}M params (+ frozen target embedding/LM head), {len(seqs)} sequences x {T} tokens"
            + (f", resuming at step {step}" if step else ""))
    bar = common.Progress(args.steps, "train-drafter", start=step, quiet=args.quiet)
    t_start = time.time()

    def save() -> None:
        torch.save({"model": trainer.model.state_dict(), "opt": opt.state_dict()}, ckpt / "state.pt")
        tmp = ckpt / "state.json.tmp"
        tmp.write_text(json.dumps({"step": step, "curve": curve, "val_curve": val_curve, "config": cfg,
                                   "train_s": train_s + time.time() - t_start}) + "\n")
        tmp.replace(ckpt / "state.json")

    def held_out() -> None:
        ev = evaluate(trainer, val[0], val[1], P, args.block_size)
        val_curve.append({"step": step} | ev)
        if not args.quiet:
            log(f"\nstep {step}: held-out loss {ev['loss']:.4f}, acc1 {ev['acc_per_position'][0]:.3f}, acceptance at "
                f"block {args.block_size}: {ev['acceptance']:.3f} (uniform anchors {ev['acceptance_uniform_anchors']:.3f})")

    trainer.model.train()
    while step < args.steps:
        if args.time_budget and train_s + (time.time() - t_start) > args.time_budget:
            break
        rng = np.random.default_rng([args.seed, 11, step])
        B = int(block_sizes[rng.integers(len(block_sizes))])
        idx = rng.choice(len(seqs), size=args.batch, replace=False)
        anchors = rng.integers(P, T - B + 1, size=(args.batch, args.anchors))
        lr = common.lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, acc = trainer.loss(seqs[idx], aux[idx].astype(np.float32), anchors, B, gamma if gamma > 0 else B / 2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        accs = acc.detach().cpu().numpy()
        lv = float(loss.detach())
        curve.append([step, B, round(lv, 5), round(float(accs[0]), 4)])
        bar.update(step, B=B, loss=lv, acc1=float(accs[0]))
        if val is not None and args.eval_every and step % args.eval_every == 0:
            held_out()
        if step % args.save_every == 0:
            save()
    bar.close()
    if val is not None and (not val_curve or val_curve[-1]["step"] != step):
        held_out()  # the weights written below (a --time-budget stop lands between evaluations)
    save()
    train_s += time.time() - t_start

    # 3. write the reference-layout checkpoint
    tiny._write_json(out / "config.json", cfg)
    tiny._write_safetensors(out / "model.safetensors", trainer.tensors())

    # 4. held-out teacher-forced accuracy and acceptance with the real engine
    trainer.model.eval()
    held_prompts = heldout_prompts(corpus, args.eval_prompts, args.prompt_len)
    report: dict[str, Any] = {
        "command": "kakeya train-drafter",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "target": str(target_dir),
        "params": int(n_params),
        "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim")} | {"dflash_config": cfg["dflash_config"]},
        "data": {"sequences": int(len(seqs)), "heldout_sequences": int(len(val[0])) if val else 0,
                 "prompt_len": P, "gen_len": int(T - P),
                 "from": "train split windows" + (", <bos> first" if args.bos_prompts else ""),
                 "labels": "target greedy continuation", "data_s": round(data_s, 1)},
        "steps": step,
        "train_s": round(train_s, 1),
        "loss_curve": curve,
        "heldout_curve": val_curve,
    }
    if args.eval_prompts and not args.no_eval:
        if not args.quiet:
            log(f"measuring acceptance on {len(held_prompts)} held-out prompts (MLX engine) ...")
        ev_bs = [int(b) for b in args.eval_block_sizes.split(",")]
        report["acceptance"] = {
            "prompts": len(held_prompts),
            "prompt_len": args.prompt_len,
            "max_tokens": args.eval_max_tokens,
            "source": "held-out stdlib files (split by file), evenly spaced windows, <bos> prepended",
            "engine": f"services.orchestrator.loop, {args.eval_backend} verifier (native cache) + drafter, greedy",
            "per_block_size": measure_acceptance(target_dir, out, held_prompts, ev_bs, args.eval_max_tokens,
                                                 args.eval_backend),
        }
    common.write_json(out / "report.json", report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target checkpoint directory (from train-target)")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--time-budget", type=float, default=0, help="stop after this many training seconds (0: none)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--anchors", type=int, default=8, help="blocks (anchor positions) per sequence per step")
    p.add_argument("--block-size", type=int, default=8, help="block size written to dflash_config")
    p.add_argument("--train-block-sizes", default="", help="comma list sampled per step (default: --block-size)")
    p.add_argument("--gamma", type=float, default=0, help="position-weight decay exp(-(k-1)/gamma) (0: B/2)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--target-layer-ids", default="1,3,5", help="target layers whose outputs are the aux context")
    p.add_argument("--sequences", type=int, default=512, help="target continuations to generate")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--bos-prompts", action="store_true", help="prompts start with <bos>, as real requests do")
    p.add_argument("--init-from", default=None, help="start from this drafter checkpoint (same config), e.g. to fine-tune")
    p.add_argument("--heldout-pct", type=int, default=5)
    p.add_argument("--val-sequences", type=int, default=64,
                   help="target continuations of held-out prompts for a teacher-forced held-out curve (0: none)")
    p.add_argument("--eval-every", type=int, default=500, help="steps between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the engine's acceptance")
    p.add_argument("--eval-max-tokens", type=int, default=128)
    p.add_argument("--eval-block-sizes", default="2,4,8,16")
    p.add_argument("--no-eval", action="store_true", help="skip the acceptance measurement")
    p.add_argument("--eval-backend", default="mlx", choices=["auto", "mlx", "torch"],
                   help="engine that measures acceptance (default mlx, as the shipped cards; auto: the fastest here)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt if present")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_run)


def _run(args) -> int:
    rep = train(args)
    summary = {"out": args.out, "steps": rep["steps"], "final_loss": rep["loss_curve"][-1][2] if rep["loss_curve"] else None}
    if "acceptance" in rep:
        summary["mean_acceptance"] = {b: v["mean_acceptance"] for b, v in rep["acceptance"]["per_block_size"].items()}
    print(json.dumps(summary))
    return 0


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (target-greedy block training)")
    add_arguments(p)
    return p
