"""``kakeya train-ftheta``: fit f_theta (``services/verifier/mlx_backend/ftheta.py``) on text available offline (MLX).

    kakeya train-ftheta --target DIR --draft DIR --out DIR [--steps N --rank R ...] [--resume]

The data (the stdlib through the target's NATIVE attention), the hybrid loss (attention-output
distillation, post-norm direction, pre-norm magnitude), the probe decoders of full-attention layers,
``--resume`` and ``OUT/report.json`` are described in ``docs/ftheta.md``. Warm-up + cosine LR, AdamW,
gradient clipping; batches are a function of the seed and the step, so a resumed run sees the same ones.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from kakeya.checkpoints.config import check_pair, load_draft_config, load_target_config
from kakeya.checkpoints.tiny import default_pair
from kakeya.drafter.mlx_backend.model import load_dflash_mlx
from kakeya.orchestrator.text import TextCodec
from kakeya.training.ftheta_objective import Objective, evaluate
from kakeya.training.retrieval import RetrievalText
from kakeya.verifier.mlx_backend.ftheta import Restorer
from kakeya.verifier.mlx_backend.target import TargetMLX

STATE_DIR = "train_state"
REPORT_FILE = "report.json"


@dataclass
class TrainArgs:
    steps: int = 2000
    rank: int = 128
    encoder_hidden: int | None = None  # None: 2 * rank
    lr: float = 1e-3
    warmup: int = 100
    batch: int = 8
    seq_len: int | None = None  # None: min(2 * model window, 2048)
    data_tokens: int = 400_000
    eval_seqs: int = 8
    seed: int = 0
    probe_full: bool = True
    save_every: int = 200
    log_every: int = 10
    # recall text (training/retrieval.py, as train-target mixes it): the first round(frac x batch) rows of a
    # step; answer_weight scales the attention-output error at the queries that predict an answer token
    # (the ones that must find the needle), max_example caps an example's tokens (needles within the window)
    retrieval_frac: float = 0.0
    retrieval_max_example: int | None = None
    answer_weight: float = 1.0


def stdlib_tokens(target_dir, n_tokens: int) -> tuple[np.ndarray, int | None]:
    """About ``n_tokens`` token ids of the standard library's top-level ``.py`` sources (in a fixed order),
    and the tokenizer's BOS id."""
    codec = TextCodec(target_dir)
    chunks, total = [], 0
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise FileNotFoundError("no Python standard library sources")
    for i in range(0, len(files), 16):
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[i : i + 16]]
        for enc in codec.tokenizer.encode_batch(texts, add_special_tokens=False):
            chunks.append(np.asarray(enc.ids, dtype=np.int32))
            total += len(enc.ids)
        if total >= n_tokens:
            break
    ids = np.concatenate(chunks)[:n_tokens]
    return ids, codec.bos_id


class Batches:
    """Deterministic batches: sequence starts are a function of (seed, step) only."""

    def __init__(self, ids: np.ndarray, bos: int | None, seq_len: int, batch: int, eval_seqs: int, seed: int):
        body = seq_len - (bos is not None)
        n_eval = eval_seqs * body
        if len(ids) < n_eval + 4 * body:
            raise ValueError(f"only {len(ids)} tokens of training text for seq_len {seq_len}: raise --data-tokens")
        self.train, self.eval_ids = ids[:-n_eval], ids[-n_eval:]
        self.bos, self.body, self.batch, self.seed, self.eval_n = bos, body, batch, seed, eval_seqs

    def _rows(self, rows: list[np.ndarray]) -> mx.array:
        if self.bos is not None:
            rows = [np.concatenate([[self.bos], r]) for r in rows]
        return mx.array(np.stack(rows).astype(np.int32))

    def step(self, step: int, window: int, recall=None) -> tuple[mx.array, int, mx.array | None]:
        """(ids [batch, seq_len], the exact window ``w``, per-query weights of the attention error or None).
        ``recall``: ``(RetrievalText, rows, answer_weight)``: the first ``rows`` rows are recall text."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.train) - self.body, size=self.batch)
        w = int(rng.integers(1, max(2, window)))
        ids = self._rows([self.train[s : s + self.body] for s in starts])
        if recall is None:
            return ids, w, None
        text, rows, answer_weight = recall
        windows, answers = text.windows(rows, self.seed, step)
        ids = mx.concatenate([mx.array(windows), ids[rows:]])
        weights = np.ones(ids.shape, np.float32)
        weights[:rows, :-1][answers[:, 1:]] = answer_weight  # query t predicts token t + 1: an answer's
        return ids, w, mx.array(weights)

    def eval(self) -> mx.array:
        return self._rows([self.eval_ids[i * self.body : (i + 1) * self.body] for i in range(self.eval_n)])


def _recall_text(target_dir, args: TrainArgs, seq_len: int):
    """``(recall, eval ids)`` for ``--retrieval-frac``: ``Batches.step``'s ``recall`` argument and fixed held-out
    recall windows for the report (a step no run reaches), or ``(None, None)`` without recall text."""
    rows = round(args.retrieval_frac * args.batch)
    if not rows:
        return None, None
    text = RetrievalText(TextCodec(target_dir).tokenizer, seq_len, max_example=args.retrieval_max_example)
    held, _ = text.windows(args.eval_seqs, args.seed + 1, 2**31 - 1)
    return (text, rows, args.answer_weight), mx.array(held)


def schedule(args: TrainArgs):
    warmup = max(0, min(args.warmup, args.steps - 1))
    decay = optim.cosine_decay(args.lr, max(1, args.steps - warmup), end=args.lr * 0.05)
    if not warmup:
        return decay
    return optim.join_schedules([optim.linear_schedule(args.lr * 0.01, args.lr, warmup), decay], [warmup])


def _save_state(state_dir: Path, ftheta, optimizer, meta: dict) -> None:
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "ftheta.safetensors"), dict(tree_flatten(ftheta.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "state.json").write_text(json.dumps(meta) + "\n")
    if state_dir.exists():
        old = state_dir.with_name(state_dir.name + ".old")
        state_dir.rename(old)
        tmp.rename(state_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(state_dir)


def _load_state(state_dir: Path, ftheta, optimizer) -> dict:
    ftheta.load_weights(str(state_dir / "ftheta.safetensors"), strict=True)
    optimizer.state = tree_unflatten(list(mx.load(str(state_dir / "optimizer.safetensors")).items()))
    return json.loads((state_dir / "state.json").read_text())


def train(
    target_dir, draft_dir, out_dir, args: TrainArgs, *, resume: bool = False, log=None, stop_at: int | None = None
) -> dict:
    """Train (or resume) f_theta; write the f_theta directory and report.json into ``out_dir``; return the report.
    ``stop_at``: save the state after that many steps and return ``{"stopped_at": step}`` (a time-boxed slice)."""
    log = log or (lambda msg: print(f"train-ftheta: {msg}", file=sys.stderr, flush=True))
    for flag, value in (("--steps", args.steps), ("--batch", args.batch)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0.0 <= args.retrieval_frac <= 1.0:
        raise ValueError(f"--retrieval-frac must lie in [0, 1], got {args.retrieval_frac}")
    if args.answer_weight <= 0:
        raise ValueError(f"--answer-weight must be > 0, got {args.answer_weight}")
    out = Path(out_dir)
    state_dir = out / STATE_DIR
    if state_dir.exists() and not resume:
        raise ValueError(
            f"{out} already holds a training run ({STATE_DIR}/): pass --resume to continue it, or pick another --out"
        )
    check_pair(load_target_config(target_dir), load_draft_config(draft_dir))
    t_start = time.perf_counter()
    target = TargetMLX.load(target_dir)
    draft = load_dflash_mlx(draft_dir, target_dir)
    window = target.args.sliding_window
    seq_len = args.seq_len or min(2 * window, 2048)
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    args.seq_len = seq_len
    hyper = {k: getattr(args, k) for k in ("rank", "encoder_hidden", "probe_full", "seed")}
    restorer = Restorer.init(target, draft, draft_dir=draft_dir, target_dir=target_dir, **hyper)
    args.encoder_hidden = restorer.config.encoder_hidden
    ids, bos = stdlib_tokens(target_dir, args.data_tokens)
    data = Batches(ids, bos, seq_len, args.batch, args.eval_seqs, args.seed)
    recall, recall_eval = _recall_text(target_dir, args, seq_len)
    objective = Objective(target, restorer)
    ftheta = restorer.ftheta
    lr_at = schedule(args)
    optimizer = optim.AdamW(learning_rate=lr_at, weight_decay=0.0)
    optimizer.init(ftheta.trainable_parameters())
    eval_ids = data.eval()

    meta = {"step": 0, "curve": [], "elapsed_s": 0.0, "args": asdict(args), "eval_initial": None, "resumed_at": []}
    if resume and (state_dir / "state.json").is_file():
        meta = _load_state(state_dir, ftheta, optimizer)
        saved = meta["args"]
        keys = "rank encoder_hidden probe_full seq_len batch seed data_tokens retrieval_frac retrieval_max_example"
        for k in keys.split() + ["answer_weight"]:
            was = saved.get(k, getattr(TrainArgs, k))  # a run from before a flag existed had its default
            if was != getattr(args, k):
                raise ValueError(f"--resume: {k} was {was} in {state_dir}, now {getattr(args, k)}")
        meta["resumed_at"].append(meta["step"])
        log(f"resuming {out} at step {meta['step']}/{args.steps}")
    elif resume:
        log(f"nothing to resume in {out}: starting fresh")
    if meta["eval_initial"] is None:
        meta["eval_initial"] = evaluate(objective, eval_ids)["by_type"]
    meta["args"] = asdict(args)

    loss_and_grad = nn.value_and_grad(ftheta, objective.loss)
    log(
        f"{args.steps} steps, batch {args.batch} x {seq_len} tokens, rank {args.rank}, "
        f"{len(restorer.config.restored_layers)} sliding layers (+{len(restorer.config.layers) - len(restorer.config.restored_layers)} probes), "
        f"{len(data.train)} training tokens from the Python standard library"
    )
    t0, done0 = time.perf_counter(), meta["step"]
    for step in range(meta["step"], args.steps):
        ids_b, w, qw = data.step(step, window, recall)
        fk, fv, truths = objective.teacher(ids_b)
        lr = float(lr_at(step))
        (_, main, attn, direction, mag), grads = loss_and_grad(ftheta, fk, fv, truths, w, qw)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(ftheta, grads)
        mx.eval(ftheta.parameters(), optimizer.state, main)
        terms = {"loss": main, "attn": attn, "dir": direction, "mag": mag}
        point = {"step": step + 1} | {k: round(float(v), 6) for k, v in terms.items()} | {"lr": float(f"{lr:.4g}")}
        if not math.isfinite(point["loss"]):
            raise RuntimeError(f"f_theta loss is {point['loss']} at step {step + 1}: lower --lr")
        meta["curve"].append(point)
        meta["step"] = step + 1
        last = step + 1 == args.steps
        if (step + 1) % args.log_every == 0 or last:
            rate = (step + 1 - done0) / max(time.perf_counter() - t0, 1e-9)
            log(
                f"step {step + 1}/{args.steps} loss {point['loss']:.4f} (attn {point['attn']:.4f} dir {point['dir']:.4f} "
                f"mag {point['mag']:.4f}) lr {lr:.2e} {rate:.1f} step/s"
            )
        stop = stop_at is not None and step + 1 >= stop_at
        if (step + 1) % args.save_every == 0 or last or stop:
            meta["elapsed_s"] += time.perf_counter() - t_start
            t_start = time.perf_counter()
            _save_state(state_dir, ftheta, optimizer, meta)
        if stop and not last:
            log(f"stopped at step {step + 1}: continue with --resume")
            return {"stopped_at": step + 1}

    final = evaluate(objective, eval_ids)
    final_recall = evaluate(objective, recall_eval)["by_type"] if recall else None
    report = {
        "format": "kakeya-ftheta-report/1",
        "target": str(target_dir),
        "draft": str(draft_dir),
        "out": str(out),
        "steps": args.steps,
        "args": asdict(args),
        "data": {
            "source": f"python standard library sources ({Path(sysconfig.get_paths()['stdlib'])})"
            + (f", {recall[1]} of {args.batch} rows recall text (training/retrieval.py)" if recall else ""),
            "train_tokens": len(data.train),
            "eval_tokens": int(data.eval_n * data.body),
        },
        "latent_bytes_per_position": restorer.config.latent_dim * 4,
        "loss_curve": meta["curve"],
        "final_loss": meta["curve"][-1]["loss"],
        "eval_initial": meta["eval_initial"],
        "eval": final,
        "kv_error": {
            k: {"rel_mse_k": v["rel_mse_k"], "rel_mse_v": v["rel_mse_v"], "restored": v["restored"]}
            for k, v in final["by_type"].items()
        },
        "eval_recall": final_recall,
        "resumed_at": meta["resumed_at"],
        "elapsed_s": round(meta["elapsed_s"] + time.perf_counter() - t_start, 3),
        "notes": [
            "rel_mse_*: sum((restored - true)^2) / sum(true^2) of post-norm, pre-RoPE K/V on held-out text",
            "baseline_rel_mse_*: the same for the best constant (the mean K/V): f_theta must beat it to carry information",
            (
                "attn: relative error of the layer's attention output with exact keys within "
                f"{final['exact_window_for_attn']} positions and restored ones beyond, up to the model's window"
            ),
            "eval_recall: the same on held-out recall text (training/retrieval.py's format, other codes)",
            "BRIEF §6: full-layer restoration needed rel MSE below ~0.36 before needle recall recovered; S5 keeps them exact",
        ],
    }
    restorer.save(out, extra={"report": REPORT_FILE, "steps": args.steps, "final_loss": report["final_loss"]})
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    s = final["by_type"]["sliding"]
    log(
        f"done: sliding layers rel MSE K {s['rel_mse_k']:.3f} V {s['rel_mse_v']:.3f} "
        f"(constant baseline K {s['baseline_rel_mse_k']:.3f} V {s['baseline_rel_mse_v']:.3f}); wrote {out}"
    )
    return report


def cmd_train(args) -> int:
    if (args.target is None) != (args.draft is None):
        raise ValueError("give both --target and --draft, or neither (for the embedded default models)")
    target, draft = args.target, args.draft
    if target is None:
        pair = default_pair()
        target, draft = str(pair.target), str(pair.draft)
    flags = (
        "steps rank encoder_hidden lr warmup batch seq_len data_tokens eval_seqs seed save_every log_every"
        " retrieval_frac retrieval_max_example answer_weight"
    )
    given = {k: getattr(args, k) for k in flags.split()}
    targs = TrainArgs(**{k: v for k, v in given.items() if v is not None}, probe_full=not args.no_probe_full)
    report = train(target, draft, args.out, targs, resume=args.resume)
    if args.json:
        print(json.dumps({k: report[k] for k in ("out", "steps", "final_loss", "kv_error", "elapsed_s")}))
    return 0
