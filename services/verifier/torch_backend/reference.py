"""transformers' own greedy ``generate``: the torch yardstick for "lossless" and for the speed-up.

Deliberately independent of our forward, cache and loop: transformers' ``Gemma4ForCausalLM`` (what
``AutoModelForCausalLM`` picks for the checkpoint's config) loads the target directory itself and decodes
with its own caches. ``kakeya generate --backend torch --compare-ar`` reports it beside the engine's own
block-1 path, as the MLX backend reports mlx-lm's ``generate_step``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

NAME = "transformers Gemma4ForCausalLM.generate (greedy, float32, its own caches)"


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives (``put`` gets the prompt first)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt, call 2 the token prefill chose
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def load_reference(target_dir: str, device: str = "cpu"):
    """The target as transformers loads it, float32, in eval mode; None where it cannot read every weight."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the command's stderr is its summary line
    try:  # None where it knows no weights file: shards without their index, say (our loaders do not need it)
        model, info = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, output_loading_info=True)
    except OSError:
        return None
    return None if info["missing_keys"] else model.to(device).eval()  # None: it would decode random weights there


@torch.inference_mode()
def greedy_reference(model, prompt_ids: Sequence[int], max_tokens: int, stop_ids: Iterable[int] = ()):
    """Return ``(token_ids, prefill_s, decode_s)`` as ``mlx_backend.reference.greedy_reference`` does: stops
    after a stop token (included), like the loop; no stop ids decodes ``max_tokens`` whatever comes."""
    stop = sorted(set(stop_ids))
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    # generate() falls back on the checkpoint's eos ids when given None: the request's own stops (none
    # for ignore_eos) go into the config it reads.
    model.generation_config.eos_token_id = stop or None
    model.generation_config.pad_token_id = stop[0] if stop else 0
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    greedy = {"do_sample": False, "top_p": None, "top_k": None, "temperature": None}  # whatever the config says
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, streamer=clock, **greedy)
    t_end = time.perf_counter()
    new = out[0, ids.shape[1] :].tolist()
    first = clock.first or t_end
    return new, first - t0, t_end - first
