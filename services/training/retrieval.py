"""Synthetic retrieval text for ``train-target --retrieval-frac``: a target that can recall.

A stdlib-only target never learns to look far back for a fact. These windows teach what ``kakeya niah`` asks, in its
format (``orchestrator/niah.py``'s ``NEEDLE`` and ``QUESTION``): haystack prose, the needle ``The secret code is NNNN.``
at a random line, more haystack, the question and the answer; the code is random per example, so only copying from the
needle lowers the loss on it. The haystack is the train files' *function and class* docstrings (``kakeya niah`` uses
*module* docstrings: text these examples never use). Examples of random lengths are packed back to back (each starting
with ``<bos>``), so questions come at many positions and needles at every distance up to the window's length.
"""

from __future__ import annotations

import ast
import functools

import numpy as np

from kakeya.orchestrator.niah import NEEDLE, QUESTION
from kakeya.training import data


@functools.cache  # parsing the whole stdlib takes ~25 s on a shared core; one process may build several texts
def hay_lines(heldout_pct: int, max_bytes: int | None = None) -> tuple[str, ...]:
    """Docstring lines of functions and classes in the train-split stdlib files (no digits: no stray codes);
    ``max_bytes`` caps the files read, as ``--max-bytes`` caps the corpus."""
    lines, total = [], 0
    for path in data.all_files():
        if data.is_heldout(path, heldout_pct):
            continue
        if max_bytes is not None and total >= max_bytes:
            break
        total += path.stat().st_size
        try:
            tree = ast.parse(path.read_bytes().decode("utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for line in (ast.get_docstring(node) or "").splitlines():
                    line = line.strip()
                    if len(line) > 20 and not any(ch.isdigit() for ch in line):
                        lines.append(line)
    if not lines:
        raise FileNotFoundError("no function or class docstrings in the standard library for the haystack")
    return tuple(lines)


class RetrievalText:
    """Packed retrieval windows of ``length`` tokens, a function of ``(seed, step)`` like the stdlib batches."""

    def __init__(
        self, tokenizer, length: int, heldout_pct: int = 5, min_example: int = 64, max_bytes=None, max_example=None
    ):
        # max_example caps an example's tokens: on a target whose every layer slides, a needle farther back
        # than its window cannot be learned from, so its examples are kept near the window
        self.tok, self.length, self.min_example = tokenizer, length, min_example
        self.max_example = min(max_example or length, length)
        lines = hay_lines(heldout_pct, max_bytes)
        enc = tokenizer.encode_batch(lines, add_special_tokens=False)
        keep = [i for i, e in enumerate(enc) if len(e.ids) < length // 4]  # short lines: needles at many depths
        self.lines = [lines[i] for i in keep]
        self.sizes = np.asarray([len(enc[i].ids) + 1 for i in keep])  # +1: the newline
        self.fixed = len(tokenizer.encode(NEEDLE.format(code=1000) + QUESTION + " 1000.\n").ids)
        if length <= self.fixed:
            raise ValueError(
                f"--retrieval-frac needs --seq-len of at least {self.fixed} (a needle, question and answer)"
            )

    def example(self, rng: np.random.Generator, budget: int) -> tuple[str, str]:
        """One example of about ``budget`` tokens: the prompt (haystack, needle at a random line, haystack,
        question) and its answer, apart so the answer's tokens can be told (and weighted: ``--answer-weight``)."""
        code = str(rng.integers(1000, 10000))
        picked, used = [], 0
        while True:
            i = int(rng.integers(len(self.lines)))
            if used + self.sizes[i] > budget - self.fixed:
                break
            picked.append(self.lines[i])
            used += self.sizes[i]
        at = int(rng.integers(0, len(picked) + 1))
        hay = picked[:at] + [NEEDLE.format(code=code)] + picked[at:]
        return "\n".join(hay) + QUESTION, f" {code}.\n"

    def windows(self, n: int, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` windows ``[n, length]`` int32, each packed with examples of random length, and a mask of the
        same shape: True at the answers' tokens. Prompt and answer are encoded apart, as ``kakeya niah``
        encodes its prompt and the model generates the answer."""
        rng = np.random.default_rng([seed, step, 0x7E7])
        rows, masks = [], []
        for _ in range(n):
            parts, answer, have = [], [], 0
            while have < self.length:  # an example's tokens only approximate its budget: count them
                budget = int(rng.integers(min(self.min_example, self.max_example), self.max_example + 1))
                prompt, reply = self.example(rng, budget)
                ids = self.tok.encode(prompt).ids, self.tok.encode(reply, add_special_tokens=False).ids
                parts += [np.asarray(i, np.int32) for i in ids]
                answer += [np.zeros(len(ids[0]), bool), np.ones(len(ids[1]), bool)]
                have += len(ids[0]) + len(ids[1])
            rows.append(np.concatenate(parts)[: self.length])
            masks.append(np.concatenate(answer)[: self.length])
        return np.stack(rows), np.stack(masks)
