"""Give a checkpoint made with the project's BPE Gemma's turn markers as single special tokens.

    python -m kakeya.checkpoints.turn_tokens services/models/demo/target services/models/demo/draft

Appends ``<start_of_turn>`` / ``<end_of_turn>`` after the BPE vocabulary (ids ``V``, ``V + 1``) as special
tokens and grows the target to match: embedding rows the mean of the pieces that spelled each marker,
LM-head rows zero (greedy output on text without them unchanged bit for bit), ``vocab_size`` in every
``config.json``, ``<end_of_turn>`` beside ``<eos>`` in ``generation_config.json``. Why: ``docs/demo-pair.md``,
"Chat turn markers". Running it again does nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from kakeya.checkpoints.config import load_target_config
from kakeya.checkpoints.tokenizer import added_token, write_json

TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def turn_token_ids(target_dir: str | Path) -> dict[str, int] | None:
    """Each marker's id where the target's tokenizer encodes it as one token, else None."""
    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    ids = {t: tok.encode(t, add_special_tokens=False).ids for t in TURN_TOKENS}
    return {t: i[0] for t, i in ids.items()} if all(len(i) == 1 for i in ids.values()) else None


def has_turn_tokens(target_dir: str | Path) -> bool:
    return turn_token_ids(target_dir) is not None


def add_turn_tokens(target_dir: str | Path, draft_dirs: tuple[str | Path, ...] = ()) -> dict[str, int]:
    """Add the turn markers to the target at ``target_dir`` (and the drafters' configs); their ids.

    Each step is skipped where it was done before, so running it again changes nothing."""
    target = Path(target_dir)
    if not has_turn_tokens(target):
        _grow(target, tuple(Path(d) for d in draft_dirs))
    ids = turn_token_ids(target)
    _stop_at_end_of_turn(target, ids["<end_of_turn>"])
    return ids


def _stop_at_end_of_turn(target: Path, end_id: int) -> None:
    """List ``<end_of_turn>`` beside ``<eos>`` in generation_config.json, as an instruction-tuned Gemma does: a
    chat's answer ends there (the demo target was never trained to write it, so it changes none of its output)."""
    eos = load_target_config(target)["eos_token_id"]  # the end ids the engine reads now
    if end_id not in eos:
        gen_file = target / "generation_config.json"
        gen = _read(gen_file) if gen_file.is_file() else {}
        gen["eos_token_id"] = eos + [end_id]
        write_json(gen_file, gen)


def _grow(target: Path, draft_dirs: tuple[Path, ...]) -> None:
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    cfg = _read(target / "config.json")
    if cfg.get("tie_word_embeddings", False):
        raise ValueError(f"{target}: tied embeddings; the zero LM-head rows need a separate lm_head")
    vocab = int(cfg["vocab_size"])
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"{target}: tokenizer has {tok.get_vocab_size()} tokens, config.json vocab_size {vocab}")
    dcfgs = {d: _read(d / "config.json") for d in draft_dirs}  # checked before anything is written
    for d, dcfg in dcfgs.items():
        if dcfg.get("vocab_size") != vocab:
            raise ValueError(f"{d}: drafter vocab_size {dcfg.get('vocab_size')} != the target's {vocab}")
    weights_file = target / "model.safetensors"
    weights = load_file(str(weights_file))
    embed, head = weights[EMBED], weights[LM_HEAD]
    if embed.shape[0] != vocab or head.shape[0] != vocab:
        raise ValueError(f"{target}: embedding/LM head rows {embed.shape[0]}/{head.shape[0]} != vocab_size {vocab}")

    pieces = {t: tok.encode(t, add_special_tokens=False).ids for t in TURN_TOKENS}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TURN_TOKENS])
    ids = {t: tok.token_to_id(t) for t in TURN_TOKENS}
    if sorted(ids.values()) != [vocab, vocab + 1]:  # pragma: no cover - tokenizers appends new tokens in order
        raise RuntimeError(f"turn tokens got ids {ids}, expected {vocab} and {vocab + 1}")
    weights[EMBED] = np.concatenate([embed, np.stack([embed[pieces[t]].mean(axis=0) for t in TURN_TOKENS])])
    weights[LM_HEAD] = np.concatenate([head, np.zeros((len(TURN_TOKENS), head.shape[1]), head.dtype)])
    save_file(weights, str(weights_file), metadata={"format": "pt"})

    (target / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    tcfg = _read(target / "tokenizer_config.json")
    for t in TURN_TOKENS:
        tcfg.setdefault("added_tokens_decoder", {})[str(ids[t])] = added_token(t)
    tcfg["additional_special_tokens"] = list(TURN_TOKENS)
    write_json(target / "tokenizer_config.json", tcfg)
    smap_file = target / "special_tokens_map.json"
    smap = _read(smap_file) if smap_file.is_file() else {}
    smap["additional_special_tokens"] = list(TURN_TOKENS)
    write_json(smap_file, smap)

    grown = vocab + len(TURN_TOKENS)
    for key in ("vocab_size", "vocab_size_per_layer_input"):
        if cfg.get(key) == vocab:
            cfg[key] = grown
    write_json(target / "config.json", cfg)
    for d, dcfg in dcfgs.items():
        dcfg["vocab_size"] = grown
        write_json(d / "config.json", dcfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="the target checkpoint (its tokenizer, config.json, model.safetensors)")
    ap.add_argument("drafts", type=Path, nargs="*", help="DFlash drafters of that target (their config.json)")
    args = ap.parse_args(argv)
    ids = add_turn_tokens(args.target, tuple(args.drafts))
    print(", ".join(f"{t} = {i}" for t, i in ids.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
