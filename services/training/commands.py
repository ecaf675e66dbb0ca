"""The ``kakeya train-*`` sub-commands: their arguments, each trainer imported only when it runs.

Building the parser imports neither MLX nor torch: ``train-ftheta`` is MLX
through and through (``ftheta.py`` imports it at module level), so its
arguments live here; ``train-target``/``train-drafter`` keep theirs beside
their trainers, whose backend imports are already lazy.
"""

from __future__ import annotations


def register(sub) -> None:
    from kakeya.training import drafter, target

    target.register(sub)
    drafter.register(sub)
    register_ftheta(sub)


def _train_ftheta(args) -> int:
    from kakeya.orchestrator.assembly import require_backend

    require_backend("mlx")
    from kakeya.training.ftheta import cmd_train

    return cmd_train(args)


def register_ftheta(sub) -> None:
    p = sub.add_parser("train-ftheta", help="train f_theta (drafter K/V -> evicted sliding-layer K/V) on offline text (MLX)")
    p.add_argument("--target", help="Gemma-4 target checkpoint directory")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory (its context projections feed f_theta)")
    p.add_argument("--out", required=True, help="output f_theta directory (also holds train_state/ and report.json)")
    # Defaults (None) are ftheta.TrainArgs's own, applied when the command runs.
    p.add_argument("--steps", type=int, help="optimizer steps (default 2000)")
    p.add_argument("--rank", type=int, help="latent rank per path (a position stores 2 x rank floats; default 128)")
    p.add_argument("--encoder-hidden", type=int, help="encoder MLP width (default 2 x rank; 0: linear)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, help="linear warm-up steps before the cosine decay (default 100)")
    p.add_argument("--batch", type=int, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 2 x the model's window, at most 2048)")
    p.add_argument("--data-tokens", type=int, help="tokens of standard-library text to sample from (default 400000)")
    p.add_argument("--eval-seqs", type=int, help="held-out sequences for the report (default 8)")
    p.add_argument("--seed", type=int, help="default 0")
    p.add_argument("--no-probe-full", action="store_true", help="skip the full-layer probe decoders (report: sliding only)")
    p.add_argument("--save-every", type=int, help="checkpoint train_state/ every N steps (default 200)")
    p.add_argument("--log-every", type=int, help="default 10")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--json", action="store_true", help="print a JSON summary line (the full report is OUT/report.json)")
    p.set_defaults(func=_train_ftheta)
