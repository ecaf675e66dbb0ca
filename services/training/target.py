"""``kakeya train-target``: train a small Gemma-4 (gemma4_text) model on the stdlib (MLX or torch).

The model is built from the config written to ``config.json`` (``kakeya.checkpoints.tiny``'s fields), so the result
opens with ``mlx_lm.load``, transformers and our loaders unchanged; initial weights are ``tiny.target_weights``.
Output: ``OUT/`` the checkpoint and tokenizer, ``OUT/report.json`` (loss curve, held-out perplexity, timing) and
``OUT/ckpt/`` (resumable state).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kakeya.checkpoints import tiny
from kakeya.checkpoints import tokenizer as tk
from kakeya.core.contract import FULL, SLIDING
from kakeya.orchestrator.assembly import refuse_torch_flags, require_backend
from kakeya.training import common, data, retrieval

if TYPE_CHECKING:  # MLX is imported where it runs: `train-target --backend torch` needs no MLX
    import mlx.core as mx


REPORTED_CONFIG = """hidden_size num_hidden_layers layer_types sliding_window head_dim global_head_dim num_attention_heads
num_key_value_heads intermediate_size vocab_size final_logit_softcapping"""


def build_config(args) -> dict[str, Any]:
    n = args.layers
    pattern = args.pattern.split(",")
    layer_types = [(FULL if pattern[i % len(pattern)].strip() == "f" else SLIDING) for i in range(n)]
    return tiny.target_config(sliding_window=args.sliding_window, vocab_size=args.vocab_size) | dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=n,
        layer_types=layer_types,
        sliding_window_pattern=len(pattern),
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_global_key_value_heads=1,
        head_dim=args.head_dim,
        global_head_dim=args.global_head_dim,
    )


def initial_weights(cfg: dict, seed: int) -> dict:
    """``tiny.target_weights`` with a unit-scale LM head (and the special tokens' rows damped as there)."""
    w = tiny.target_weights(cfg, seed)
    w["lm_head.weight"] = w["lm_head.weight"] / tiny.LOGIT_STD
    w["lm_head.weight"][: len(tk.SPECIAL_TOKENS)] /= tiny.SPECIAL_LOGIT_DAMP
    return w


def loss_fn(model, batch: mx.array, weights: mx.array | None = None) -> mx.array:
    """Mean next-token cross-entropy; ``weights`` ``[b, L-1]``: a weighted mean (``--answer-weight``)."""
    from mlx import nn

    logits = model(batch[:, :-1])
    if weights is None:
        return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")
    return (nn.losses.cross_entropy(logits, batch[:, 1:]) * weights).sum() / weights.sum()


class MLXBackend:
    """mlx-lm's gemma4_text Model, mlx.nn.value_and_grad, mlx.optimizers.AdamW."""

    name = "mlx"

    @staticmethod
    def device_label() -> str:
        """MLX's default device, for the report ("mlx gpu" on Apple silicon)."""
        import mlx.core as mx

        return f"mlx {mx.default_device().type.name}"

    def __init__(self, cfg: dict, args):
        import mlx.core as mx
        import mlx.optimizers as optim
        from mlx import nn
        from mlx.utils import tree_flatten
        from mlx_lm.models.gemma4_text import Model, ModelArgs

        self.mx, self.tree_flatten, self.clip = mx, tree_flatten, optim.clip_grad_norm
        self.cfg, self.args = cfg, args
        self.model = Model(ModelArgs.from_dict(cfg))
        w = initial_weights(cfg, args.seed)
        common.check_names((k for k, _ in tree_flatten(self.model.parameters())), w)
        self.model.load_weights([(k, mx.array(v)) for k, v in w.items()], strict=True)
        mx.eval(self.model.parameters())
        self.opt = optim.AdamW(learning_rate=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        self.vg = nn.value_and_grad(self.model, loss_fn)

    @property
    def n_params(self) -> int:
        return sum(v.size for _, v in self.tree_flatten(self.model.parameters()))

    def step(self, batch: np.ndarray, lr: float, weights: np.ndarray | None = None) -> float:
        mx = self.mx
        self.opt.learning_rate = lr
        loss, grads = self.vg(self.model, mx.array(batch), None if weights is None else mx.array(weights))
        if self.args.grad_clip:
            grads, _ = self.clip(grads, self.args.grad_clip)
        self.opt.update(self.model, grads)
        self.mx.eval(loss, self.model.parameters(), self.opt.state)
        return float(loss)

    def evaluate(self, windows: np.ndarray) -> float:
        total = 0.0
        for i in range(0, len(windows), self.args.batch):
            b = windows[i : i + self.args.batch]
            total += float(loss_fn(self.model, self.mx.array(b))) * len(b)
        return total / len(windows)

    def save(self, ckpt: Path, meta: dict) -> None:
        common.save_state(ckpt, self.model, self.opt, meta)

    def load(self, ckpt: Path):
        return common.load_state(ckpt, self.model, self.opt)

    def tensors(self) -> dict[str, np.ndarray]:
        return {k: np.array(v.astype(self.mx.float32)) for k, v in self.tree_flatten(self.model.parameters())}


class TorchBackend:
    """transformers' Gemma4ForCausalLM from the same config (float32, CPU/CUDA): the same architecture,
    initial weights, data and output layout (the demo pair was trained with it)."""

    name = "torch"

    def device_label(self) -> str:
        return common.device_label(self.device)

    def __init__(self, cfg: dict, args):
        import torch
        from transformers import Gemma4ForCausalLM

        self.torch, self.cfg, self.args = torch, cfg, args
        torch.manual_seed(args.seed)
        self.device = common.torch_device(args.device)
        conf = common.hf_text_config(cfg)
        conf._attn_implementation = "eager"
        self.model = Gemma4ForCausalLM(conf)
        w = initial_weights(cfg, args.seed)
        common.check_names(self.model.state_dict(), w)
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
        self.model.to(self.device).train()
        self.opt = common.torch_adamw(self.model.parameters(), args.lr, args.weight_decay)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _loss(self, batch: np.ndarray, weights: np.ndarray | None = None):
        torch = self.torch
        t = torch.from_numpy(batch.astype(np.int64)).to(self.device)
        logits = self.model(t[:, :-1]).logits
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1), reduction="none"
        )
        if weights is None:
            return ce.mean()
        w = torch.from_numpy(weights.astype(np.float32)).to(self.device).reshape(-1)
        return (ce * w).sum() / w.sum()

    def step(self, batch: np.ndarray, lr: float, weights: np.ndarray | None = None) -> float:
        common.set_lr(self.opt, lr)
        loss = self._loss(batch, weights)
        loss.backward()
        if self.args.grad_clip:
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def evaluate(self, windows: np.ndarray) -> float:
        total = 0.0
        with self.torch.no_grad():
            for i in range(0, len(windows), self.args.batch):
                b = windows[i : i + self.args.batch]
                total += float(self._loss(b)) * len(b)
        return total / len(windows)

    def save(self, ckpt: Path, meta: dict) -> None:
        ckpt.mkdir(parents=True, exist_ok=True)
        self.torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, ckpt / "state.pt")
        common.write_meta(ckpt, meta)

    def load(self, ckpt: Path):
        if not (ckpt / "state.json").is_file():
            return None
        st = self.torch.load(ckpt / "state.pt", map_location=self.device)
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        return json.loads((ckpt / "state.json").read_text())

    def tensors(self) -> dict[str, np.ndarray]:
        return {k: v.detach().float().cpu().numpy() for k, v in self.model.state_dict().items()}


def train(args) -> dict:
    out = Path(args.out)
    refuse_torch_flags((args.backend,), args.device)  # before the tokenizer's and the model's work
    common.seed_all(args.seed)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tok = tk.train_tokenizer(args.vocab_size, progress=None if args.quiet else common.log)  # a new vocabulary
    corpus = data.load_corpus(tok, heldout_pct=args.heldout_pct, max_bytes=args.max_bytes)
    cfg = build_config(args)
    require_backend(args.backend)
    be = (TorchBackend if args.backend == "torch" else MLXBackend)(cfg, args)
    ckpt = out / "ckpt"
    meta = be.load(ckpt) if args.resume else None
    if meta is not None and (meta.get("config") != cfg or meta.get("backend") != be.name):
        raise ValueError(
            f"{ckpt}: checkpoint was trained with a different config/backend; drop --resume or change --out"
        )
    meta = meta or {"step": 0, "curve": [], "evals": [], "train_s": 0.0}
    step, curve, evals, train_s = meta["step"], meta["curve"], meta["evals"], meta["train_s"]
    L = args.seq_len + 1
    held = data.fixed_windows(corpus.heldout, args.eval_windows, L)
    train_eval = data.fixed_windows(corpus.train, args.eval_windows, L)
    if not 0.0 <= args.retrieval_frac <= 1.0:
        raise ValueError(f"--retrieval-frac must lie in [0, 1], got {args.retrieval_frac}")
    n_ret = round(args.retrieval_frac * args.batch)
    if args.answer_weight <= 0:
        raise ValueError(f"--answer-weight must be > 0, got {args.answer_weight}")
    recall = dict(max_bytes=args.max_bytes, max_example=args.retrieval_max_example)
    ret = retrieval.RetrievalText(tok, L, args.heldout_pct, **recall) if n_ret else None
    bar = common.Progress(args.steps, "train-target", start=step, quiet=args.quiet)
    if not args.quiet:
        common.log(
            f"target ({be.name}): {be.n_params / 1e6:.2f}M params, {corpus.train.size} train / "
            f"{corpus.heldout.size} held-out tokens" + (f", resuming at step {step}" if step else "")
        )
    t_start = time.time()

    def state() -> dict:
        spent_s = train_s + (time.time() - t_start)
        return {"step": step, "curve": curve, "evals": evals, "train_s": spent_s, "config": cfg, "backend": be.name}

    while step < args.steps and (spent := common.budget_spent(train_s + time.time() - t_start, args.time_budget)) < 1:
        rng = np.random.default_rng([args.seed, step])
        batch = data.sample_windows(corpus.train, args.batch, L, rng)
        weights = None
        if ret is not None:  # the first rows: synthetic recall text (training/retrieval.py)
            batch[:n_ret], answers = ret.windows(n_ret, args.seed, step)
            if args.answer_weight != 1.0:  # the answers' tokens weigh more: copying is most of the gradient
                weights = np.ones((len(batch), L - 1), np.float32)
                weights[:n_ret][answers[:, 1:]] = args.answer_weight
        lr = common.lr_at(step, args.steps, args.lr, args.warmup, spent=spent)
        loss = be.step(batch, lr, weights)
        step += 1
        curve.append([step, round(loss, 5)])
        bar.update(step, loss=loss, lr=lr)
        if step % args.eval_every == 0:
            evals.append({"step": step, "heldout_loss": round(be.evaluate(held), 5)})
        if step % args.save_every == 0:
            be.save(ckpt, state())
    bar.close()
    held_loss = be.evaluate(held)
    if not evals or evals[-1]["step"] != step:
        evals.append({"step": step, "heldout_loss": round(held_loss, 5)})
    be.save(ckpt, state())
    train_s += time.time() - t_start
    train_loss = be.evaluate(train_eval)
    tk.write_tokenizer(tok, out)  # makes the directory
    tiny.write_target_config(out, cfg)
    tiny.write_safetensors(out / "model.safetensors", be.tensors())
    report = {
        "command": "kakeya train-target",
        "backend": be.name,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "params": int(be.n_params),
        "config": {k: cfg[k] for k in REPORTED_CONFIG.split()},
        "corpus": corpus.summary(),
        "retrieval": None
        if ret is None
        else {
            "rows_per_batch": n_ret,
            "hay_lines": len(ret.lines),
            "answer_weight": args.answer_weight,
            "max_example": ret.max_example,
        },
        "steps": step,
        "tokens_seen": int(step * args.batch * args.seq_len),
        "train_s": round(train_s, 1),
        "device": be.device_label(),
        "loss_curve": curve,
        "evals": evals,
        "final": {
            "train_loss": round(train_loss, 5),
            "heldout_loss": round(held_loss, 5),
            "heldout_perplexity": round(math.exp(held_loss), 4),
            "eval_windows": args.eval_windows,
            "eval_seq_len": args.seq_len,
        },
    }
    common.write_json(out / "report.json", report)
    return report
