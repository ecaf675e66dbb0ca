"""Is a target learning to recall? A quick check of a ``train-target`` run, mid-run or finished.

    python benchmarks/recall_probe.py OUT [--seq-len 256] [--contexts 96 128] [--json PATH]

``OUT`` is a ``kakeya train-target --retrieval-frac`` output directory: its latest ``ckpt/`` (so it can
run while training goes on) or, without one, its saved weights. Two numbers, on the torch model
(``training.common.hf_text_config``: the layer types as written), no cache, no drafter:

- **answer CE**: teacher-forced cross-entropy per token on the first 5 tokens of the answers of 16
  held-out-seed retrieval windows (``training/retrieval.py``; a digit guessed at random costs
  ln 10 = 2.30), and how many answers are argmax-exact;
- **greedy recall** on ``kakeya niah``'s own prompts (module-docstring haystack) at ``--contexts``,
  depths 0, 0.1, 0.3, 0.5, 0.7, 0.9, 1: the code among the 6 greedy tokens after the question.

A model that has learned to copy shows answer CE falling well under 1 before greedy recall rises.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

DEPTHS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)


def load(out: Path):
    import torch
    from tokenizers import Tokenizer
    from transformers import Gemma4ForCausalLM

    from kakeya.checkpoints import tiny
    from kakeya.training.common import hf_text_config

    ckpt = out / "ckpt"
    if (ckpt / "state.json").is_file():
        meta = json.loads((ckpt / "state.json").read_text())
        cfg, step, state = meta["config"], meta["step"], torch.load(ckpt / "state.pt")["model"]
    else:
        from safetensors.torch import load_file

        cfg, step = json.loads((out / "config.json").read_text()), None
        state = load_file(str(out / "model.safetensors"))
    conf = hf_text_config(cfg)
    conf._attn_implementation = "eager"
    model = Gemma4ForCausalLM(conf)
    model.load_state_dict(state)
    tok_path = out / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path if tok_path.is_file() else tiny.DEMO_DIR / "target" / "tokenizer.json"))
    return model.eval(), tok, step, cfg


def answer_ce(model, tok, seq_len: int) -> dict:
    import torch

    from kakeya.training.retrieval import RetrievalText

    w, _ = RetrievalText(tok, seq_len + 1).windows(16, seed=99, step=0)
    ans = tok.encode("Answer: The secret code is", add_special_tokens=False).ids
    with torch.no_grad():
        logits = model(torch.from_numpy(w[:, :-1].astype(np.int64))).logits
    ce = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), torch.from_numpy(w[:, 1:].astype(np.int64)), reduction="none"
    )
    total, n, exact, answers = 0.0, 0, 0, 0
    for b, row in enumerate(w.tolist()):
        for i in range(len(row) - len(ans) - 6):
            if row[i : i + len(ans)] == ans:
                j = i + len(ans)
                total += float(ce[b, j - 1 : j + 4].sum())
                n += 5
                answers += 1
                exact += all(int(logits[b, k - 1].argmax()) == row[k] for k in range(j, j + 5))
    return {"answer_ce_per_token": round(total / max(1, n), 4), "answers": answers, "exact": exact}


def greedy_recall(model, tok, contexts) -> dict:
    import torch

    from kakeya.orchestrator.niah import build_prompt, haystack_lines, needle_code

    class Codec:
        add_bos, bos_id = True, 2

        def encode(self, s):
            return tok.encode(s).ids

    lines, out = haystack_lines(max(contexts) * 8), {}
    for c in contexts:
        hits = 0
        for d in DEPTHS:
            code = needle_code(c, d, 1)
            ids = build_prompt(Codec(), lines, c, d, code)
            with torch.no_grad():
                for _ in range(6):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            hits += code in tok.decode(ids[-6:])
        out[str(c)] = round(hits / len(DEPTHS), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="train-target output directory")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--json", help="write the result here (benchmarks/record.py)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    model, tok, step, cfg = load(Path(args.out))
    result = {
        "target": args.out,
        "step": step,
        "layer_types": cfg["layer_types"],
        "sliding_window": cfg["sliding_window"],
        **answer_ce(model, tok, args.seq_len),
        "greedy_recall": greedy_recall(model, tok, args.contexts),
    }
    print(json.dumps(result))
    if args.json:
        write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
