"""``kakeya train-drafter``: train a DFlash drafter for a target, the DFlash way.

Data, blocks, loss, shared embedding / LM head, held-out curve and report are described step by step in
docs/demo-pair.md ("`kakeya train-drafter`"). Training runs on torch (``kakeya.drafter.torch_backend.model`` has the
reference parameter names); the checkpoint loads strictly in ``kakeya.drafter.mlx_backend.model``.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from kakeya.checkpoints import tiny
from kakeya.checkpoints import tokenizer as tk
from kakeya.core.contract import FULL
from kakeya.training import common, data
from kakeya.training.block_trainer import BlockTrainer, TorchTarget, cached_continuations, make_dataset
from kakeya.training.common import log
from kakeya.training.drafter_eval import acceptance_record, evaluate, floats, heldout_prompts, ints

REPORTED_CONFIG = "hidden_size num_hidden_layers intermediate_size num_attention_heads num_key_value_heads head_dim"


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
        layer_types=[FULL] * args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        final_logit_softcapping=target_cfg.get("final_logit_softcapping"),
        block_size=args.block_size,
    )
    cfg["dflash_config"] |= {"block_size": args.block_size, "target_layer_ids": tids}  # tiny's mask id, scales
    return cfg


def _data_on_device(data_set, device, mode: str, soft: float, quiet: bool):
    """``(aux, final)`` of the whole training set as tensors on ``device`` (``final`` None without the KL
    term), or None to gather each batch from the memory-mapped files on the host. A set runs to gigabytes:
    ``auto`` copies it only to a CUDA device where it takes under half the free memory."""
    import torch

    arrays = [data_set.aux] + ([data_set.final] if soft else [])
    need = sum(a.nbytes for a in arrays)
    if mode == "off" or (mode == "auto" and (device.type != "cuda" or need > torch.cuda.mem_get_info(device)[0] / 2)):
        return None
    out = []
    for a in arrays:  # in slices: a memory-mapped file is read once, never whole into host memory
        t = torch.empty(a.shape, dtype=torch.float16, device=device)
        for i in range(0, len(a), 4096):
            t[i : i + 4096].copy_(torch.from_numpy(np.ascontiguousarray(a[i : i + 4096])))
        out.append(t)
    if not quiet:
        log(f"training data on {device}: {need / 2**30:.2f} GiB")
    return out[0], (out[1] if soft else None)


def train(args) -> dict:
    import torch

    out = Path(args.out)
    target_dir = Path(args.target)
    common.seed_all(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = common.torch_device(args.device)
    tcfg = json.loads((target_dir / "config.json").read_text())
    cfg = build_draft_config(tcfg, args)
    tids = cfg["dflash_config"]["target_layer_ids"]
    tok = data.target_tokenizer(target_dir, progress=None if args.quiet else log)
    corpus = data.load_corpus(tok, heldout_pct=args.heldout_pct)
    ckpt = out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)

    # 1. target continuations + aux (cached in ckpt/ so a resumed run reuses them); the held-out
    #    set continues prompts from held-out FILES, to watch the drafter on text it never saw.
    key = {"target": str(target_dir.resolve()), "prompt_len": args.prompt_len, "gen_len": args.gen_len}
    key |= {"tids": tids, "seed": args.seed} | ({"bos": True} if args.bos_prompts else {})
    get_target = functools.cache(lambda: TorchTarget(target_dir, device))  # loaded once, only to make data

    temps = [float(x) for x in args.temperatures.split(",")]
    if any(x < 0 for x in temps):
        raise ValueError(f"--temperatures must be >= 0 (0: greedy), got {args.temperatures}")
    train_key = key | {"n_seq": args.sequences} | ({"temperatures": temps} if temps != [0.0] else {})

    shared = dict(prompt_len=args.prompt_len, gen_len=args.gen_len, layer_ids=tids, gen_batch=args.gen_batch)
    shared |= dict(quiet=args.quiet, bos=args.bos_prompts)

    def continuations(stream, n: int, seed: int, temperatures=(0.0,)):
        return lambda out: make_dataset(
            get_target(), stream, n, seed=seed, temperatures=temperatures, out=out, **shared
        )

    train_set, data_s = cached_continuations(
        ckpt / "data", train_key, continuations(corpus.train, args.sequences, args.seed, temps), args.quiet
    )
    seqs = train_set.seqs
    val = None
    if args.val_sequences:  # greedy: the replayed acceptance is the greedy engine's
        val_key = key | {"n_seq": args.val_sequences, "split": "heldout"}
        make = continuations(corpus.heldout, args.val_sequences, args.seed + 1)
        val_set, _ = cached_continuations(ckpt / "val", val_key, make, args.quiet)
        val = (np.asarray(val_set.seqs), np.asarray(val_set.aux))
    get_target.cache_clear()

    # 2. training
    trainer = BlockTrainer(cfg, target_dir, args.seed, device)
    params = list(trainer.model.parameters())
    n_params = sum(p.numel() for p in params)
    opt = common.torch_adamw(params, args.lr, args.weight_decay)
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
            raise ValueError(f"--init-from {init}: another drafter config than this run's")
        trainer.load_weights(init)
    meta = meta or {"step": 0, "curve": [], "train_s": 0.0}
    step, curve, val_curve, train_s = meta["step"], meta["curve"], meta.get("val_curve", []), meta["train_s"]
    block_sizes = [int(b) for b in args.train_block_sizes.split(",")] if args.train_block_sizes else [args.block_size]
    P, T = args.prompt_len, seqs.shape[1]
    if T - max(block_sizes) < P:
        raise ValueError("--gen-len must be >= the largest training block size")
    if not args.quiet:
        log(
            f"drafter: {n_params / 1e6:.2f}M params (+ frozen target embedding/LM head), {len(seqs)} sequences x {T} tokens"
            + (f", resuming at step {step}" if step else "")
        )
    bar = common.Progress(args.steps, "train-drafter", start=step, quiet=args.quiet)
    t_start = time.time()

    def save() -> None:
        torch.save({"model": trainer.model.state_dict(), "opt": opt.state_dict()}, ckpt / "state.pt")
        meta = {"step": step, "curve": curve, "val_curve": val_curve, "config": cfg}
        common.write_meta(ckpt, meta | {"train_s": train_s + time.time() - t_start})

    def held_out() -> None:
        ev = evaluate(trainer, val[0], val[1], P, args.block_size)
        val_curve.append({"step": step} | ev)
        if not args.quiet:
            log(
                f"\nstep {step}: held-out loss {ev['loss']:.4f}, acc1 {ev['acc_per_position'][0]:.3f}, acceptance at "
                f"block {args.block_size}: {ev['acceptance']:.3f} (uniform anchors {ev['acceptance_uniform_anchors']:.3f})"
            )

    on_device = _data_on_device(train_set, device, args.data_on_device, args.soft_weight, args.quiet)
    trainer.model.train()
    while step < args.steps and (spent := common.budget_spent(train_s + time.time() - t_start, args.time_budget)) < 1:
        rng = np.random.default_rng([args.seed, 11, step])
        B = int(block_sizes[rng.integers(len(block_sizes))])
        idx = rng.choice(len(seqs), size=args.batch, replace=False)
        anchors = rng.integers(P, T - B + 1, size=(args.batch, args.anchors))
        lr = common.lr_at(step, args.steps, args.lr, args.warmup, spent=spent)
        common.set_lr(opt, lr)
        idx.sort()  # ascending rows read the memory-mapped arrays in order
        hard = (train_set.temperature[idx] == 0).astype(np.float32) if args.soft_weight else None
        if on_device:
            rows = torch.from_numpy(idx).to(device)
            aux, final = on_device[0][rows], (on_device[1][rows] if args.soft_weight else None)
        else:  # float16 as stored (half the bytes read): the trainer widens it on the device
            aux, final = train_set.aux[idx], (train_set.final[idx] if args.soft_weight else None)
        gamma = args.gamma if args.gamma > 0 else B / 2
        loss, acc = trainer.loss(
            seqs[idx], aux, anchors, B, gamma, final=final, hard=hard, soft_weight=args.soft_weight
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        lv, acc1 = float(loss.detach()), float(acc[0])
        curve.append([step, B, round(lv, 5), round(acc1, 4)])
        bar.update(step, B=B, loss=lv, acc1=acc1)
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
    tk.write_json(out / "config.json", cfg)
    tiny.write_safetensors(out / "model.safetensors", trainer.tensors())

    # 4. held-out teacher-forced accuracy and acceptance with the real engine
    trainer.model.eval()
    soft = f"; + {args.soft_weight:g} x KL to the target's distribution (sampled continuations: KL only)"
    soft = soft if args.soft_weight else ""
    report: dict[str, Any] = {
        "command": "kakeya train-drafter",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "target": str(target_dir),
        "params": int(n_params),
        "config": {k: cfg[k] for k in REPORTED_CONFIG.split()} | {"dflash_config": cfg["dflash_config"]},
        "data": {
            "sequences": len(seqs),
            "heldout_sequences": len(val[0]) if val else 0,
            "prompt_len": P,
            "gen_len": int(T - P),
            "from": "train split windows" + (", <bos> first" if args.bos_prompts else ""),
            "labels": f"target continuations at temperatures {', '.join(f'{x:g}' for x in temps)} (0: greedy){soft}",
            "data_s": round(data_s, 1),
        },
        "steps": step,
        "train_s": round(train_s, 1),
        "device": common.device_label(device),
        "loss_curve": curve,
        "heldout_curve": val_curve,
    }
    if args.eval_prompts and not args.no_eval:  # --eval-prompts 0: measured elsewhere (drafter_eval)
        held_prompts = heldout_prompts(corpus, args.eval_prompts, args.prompt_len)
        if not args.quiet:
            log(f"measuring acceptance on {len(held_prompts)} held-out prompts ({args.eval_backend} engine) ...")
        measure = (ints(args.eval_block_sizes), args.eval_max_tokens, args.eval_backend)
        measure += (floats(args.eval_temperatures), ints(args.eval_sampled_block_sizes))
        report["acceptance"] = acceptance_record(target_dir, out, held_prompts, args.prompt_len, *measure)
    common.write_json(out / "report.json", report)
    return report
