"""The processed distribution p computed by Hugging Face transformers' own logits warpers.

An independent statement of what ``reference.process`` (``tests/sampling/reference.py``) means: logits / temperature, then
top-k, top-p and min-p, in the order ``transformers``' ``generate`` applies them
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``), then
the softmax. The sampling tests measure speculative samples against this p, not against the code
under test. (transformers is a dev dependency.)

One documented difference: where tokens tie at the top-k or top-p boundary, transformers keeps every
tied token at the top-k boundary and lets its sort pick among them at the top-p one; Kakeya breaks ties
by token index and keeps exactly k (``test_transformers.py`` pins both).
"""

from __future__ import annotations

import numpy as np
import torch

from kakeya.core.request import SamplingParams


def hf_process(logits, params: SamplingParams) -> np.ndarray:
    """p over the last axis of ``logits`` (float64), processed by transformers' warpers."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = np.asarray(logits, np.float64)
    scores = torch.from_numpy(x.reshape(-1, x.shape[-1]).copy())
    warpers = [TemperatureLogitsWarper(float(params.temperature))]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    no_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)  # the warpers ignore the prompt
    warped = LogitsProcessorList(warpers)(no_ids, scores)
    return torch.softmax(warped, dim=-1).numpy().reshape(x.shape)
