"""The training corpus: the running interpreter's standard-library sources.

Files are split into train / held-out BY FILE (crc32 of the path under the stdlib root), so held-out text
never leaks into training; each is tokenized with ``<bos>`` first, the train stream their concatenation.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kakeya.checkpoints import tokenizer as tk

stdlib_root, all_files = tk.stdlib_root, tk.stdlib_sources  # the tokenizer's corpus is drawn from the same files


def is_heldout(path: Path, heldout_pct: int) -> bool:
    rel = path.relative_to(stdlib_root()).as_posix()
    return zlib.crc32(rel.encode()) % 100 < heldout_pct


@dataclass
class Corpus:
    train: np.ndarray  # int32 token stream of the train files
    heldout: np.ndarray  # int32 token stream of the held-out files
    train_files: list[str]
    heldout_files: list[str]
    fingerprint: str

    def summary(self) -> dict:
        return {
            "source": f"Python {sysconfig.get_python_version()} standard library (*.py, tests excluded)",
            "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files),
            "train_tokens": int(self.train.size),
            "heldout_tokens": int(self.heldout.size),
            "split": "by file: crc32(relative path) % 100 < heldout_pct -> held out",
            "sha256": self.fingerprint,
        }


def load_corpus(tokenizer, heldout_pct: int = 5, max_bytes: int | None = None) -> Corpus:
    """Tokenize the stdlib; ``max_bytes`` caps the train files (held-out files are always all kept)."""
    root = stdlib_root()
    train_f, held_f = [], []
    total = 0
    for p in all_files():
        if is_heldout(p, heldout_pct):
            held_f.append(p)
        elif max_bytes is None or total < max_bytes:
            train_f.append(p)
            total += p.stat().st_size
    digest = hashlib.sha256()
    train, held = encode_files(tokenizer, train_f, root, digest), encode_files(tokenizer, held_f, root, digest)
    rel = lambda fs: [f.relative_to(root).as_posix() for f in fs]
    return Corpus(train, held, rel(train_f), rel(held_f), digest.hexdigest())


def encode_files(tokenizer, files: list[Path], root: Path, digest) -> np.ndarray:
    """The files' tokens, concatenated (each file starts with <bos>: the tokenizer's post-processor); each
    file's path under ``root`` and text go into ``digest`` (the corpus fingerprint)."""
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    for f, t in zip(files, texts):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + t.encode())
    encs = tokenizer.encode_batch(texts)
    return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encs]) if encs else np.zeros(0, np.int32)


def sample_windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random windows of ``length`` tokens from ``stream`` -> ``[n, length]`` int32."""
    starts = rng.integers(0, stream.size - length, size=n)
    return np.stack([stream[s : s + length] for s in starts])


def fixed_windows(stream: np.ndarray, n: int, length: int) -> np.ndarray:
    """``n`` evenly spaced windows (deterministic evaluation set)."""
    span = stream.size - length
    starts = np.linspace(0, span, n).astype(np.int64)
    return np.stack([stream[s : s + length] for s in starts])


def target_tokenizer(target_dir: Path, progress=None):
    """The tokenizer a target was trained with: its own ``tokenizer.json``. Training one again here would only match
    where the interpreter's standard library does (another Python version, another vocabulary, and a drafter trained on
    prompts its target never read); a target without one gets the project's, trained here."""
    return tk.read_tokenizer(target_dir) or tk.train_tokenizer(
        json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"], progress=progress
    )
