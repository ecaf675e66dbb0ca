"""Trainers for the demo pair: a small Gemma-4 target and its DFlash drafter (MLX).

* ``data``    -- the Python standard-library corpus, split by file, tokenized;
* ``target``  -- ``kakeya train-target``: next-token training of a gemma4_text model;
* ``drafter`` -- ``kakeya train-drafter``: DFlash block training on the target's
  greedy continuations, with the target's aux hidden states as context;
* ``common``  -- progress bar, checkpoints (resumable, optimizer state included), reports.
"""

import kakeya.backends.mlx  # noqa: F401 - first: routes MLX's BLAS on Linux before mlx.core loads
