"""A small byte-level BPE tokenizer for the project's tiny checkpoints.

Trained offline on a deterministic, sorted subset of the interpreter's stdlib ``*.py`` with Gemma's special-token ids
(``<pad>=0 <eos>=1 <bos>=2 <unk>=3 <mask>=4``, ``<mask>`` DFlash's). The directory opens with transformers and
``mlx_lm.load``; ``decode(encode(text))`` round-trips any text. It ships a minimal Gemma-style chat template
(``chat_template.py``); the turn markers are plain text to it until ``turn_tokens.py`` adds them as special tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sysconfig
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kakeya.checkpoints import chat_template

PAD, EOS, BOS, UNK, MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK, MASK)
PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID = range(5)

DEFAULT_VOCAB_SIZE = 1024
DEFAULT_CORPUS_BYTES = 2_000_000
# Room for the special tokens plus the 256 byte-level symbols.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

Progress = Callable[[str], None]

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # what transformers (and orchestrator/text.py) read beside the tokenizer
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[Path]:
    """The standard library's ``*.py`` files, sorted by relative path: third-party directories
    (site-/dist-packages) and tests left out, so the list depends only on the interpreter's version."""
    root = stdlib_root()
    return sorted(
        (p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The first ``max_bytes`` bytes' worth of :func:`stdlib_sources`: the tokenizer's corpus."""
    chosen: list[Path] = []
    total = 0
    for path in stdlib_sources():
        if total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    if not chosen:
        raise RuntimeError(f"no standard-library sources found under {stdlib_root()}")
    return chosen


def corpus_fingerprint(max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """sha256 of the training corpus (file names and contents)."""
    root = stdlib_root()
    digest = hashlib.sha256()
    for path in corpus_files(max_bytes):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _train_json(vocab_size: int, max_bytes: int) -> str:
    files = corpus_files(max_bytes)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (path.read_bytes().decode("utf-8", errors="replace") for path in files)
    tok.train_from_iterator(texts, trainer=trainer, length=len(files))
    for token, want in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))):
        got = tok.token_to_id(token)
        if got != want:  # pragma: no cover - guarded by the trainer's contract
            raise RuntimeError(f"special token {token} got id {got}, expected {want}")
    # Gemma prepends <bos>; no <eos> is appended on encode.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok.to_str(pretty=True)


def read_tokenizer(checkpoint_dir: str | Path) -> Tokenizer | None:
    """A checkpoint's ``tokenizer.json`` (None without one); one error line naming it when it cannot be parsed."""
    path = Path(checkpoint_dir) / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path)) if path.is_file() else None
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a bad file
        raise ValueError(f"{path}: unreadable ({exc})") from None


def train_tokenizer(
    vocab_size: int = DEFAULT_VOCAB_SIZE, max_bytes: int = DEFAULT_CORPUS_BYTES, progress: Progress | None = None
) -> Tokenizer:
    """Train (or fetch from the in-process cache) the byte-level BPE tokenizer."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    if progress is not None and _train_json.cache_info().currsize == 0:
        n = len(corpus_files(max_bytes))
        progress(f"training byte-level BPE tokenizer (vocab {vocab_size}) on {n} stdlib files ...")
    tok = Tokenizer.from_str(_train_json(vocab_size, max_bytes))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer training produced {tok.get_vocab_size()} tokens, expected {vocab_size} (corpus too small?)"
        )
    if progress is not None:
        progress("tokenizer ready")
    return tok


def added_token(content: str) -> dict:
    """A special token's entry in ``tokenizer_config.json``'s ``added_tokens_decoder``, as transformers writes it."""
    return dict(content=content, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)


def write_json(path: Path, obj) -> None:
    """A config file as Hugging Face tools write them: indented, keys sorted."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (out / CHAT_TEMPLATE_FILE).write_text(chat_template.CHAT_TEMPLATE + "\n", encoding="utf-8")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK, "mask_token": MASK}
    write_json(out / "special_tokens_map.json", special)
    write_json(
        out / "tokenizer_config.json",
        special
        | {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": {str(i): added_token(t) for i, t in enumerate(SPECIAL_TOKENS)},
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            "padding_side": "left",
        },
    )
