"""A test drafter that knows the target's greedy continuation and plants errors in it.

With it every kind of block happens: full acceptance, partial acceptance at
every depth, zero acceptance, and the bonus token after each.
"""

import numpy as np

from kakeya.core.contract import Draft


class PlantedDrafterSession:
    def __init__(self, reference, prompt_len, vocab_size, seed=0):
        self.ref, self.prompt_len, self.vocab = reference, prompt_len, vocab_size
        self.rng = np.random.default_rng(seed)
        self.ctx = 0  # positions the drafter has aux for
        self.kinds = {"full": 0, "partial": 0, "zero": 0}

    def draft(self, new_aux, last_token, block_size):
        self.ctx += new_aux.shape[0]
        g = self.ctx - self.prompt_len  # index of `last_token` in the generated sequence
        if g >= len(self.ref) or self.ref[g] != last_token:
            return Draft([0] * (block_size - 1))  # off the script: the caller's comparison will say where
        good = list(self.ref[g + 1 : g + block_size]) + [0] * block_size
        out = good[: block_size - 1]
        roll = self.rng.random()
        if roll < 0.25:
            self.kinds["full"] += 1
        else:
            at = 0 if roll < 0.5 else int(self.rng.integers(0, block_size - 1))
            self.kinds["zero" if at == 0 else "partial"] += 1
            out[at] = (out[at] + 1 + int(self.rng.integers(0, self.vocab - 1))) % self.vocab
        return Draft(out)

    def close(self):
        pass
