"""Sessions run alone and the same sessions run through ``verify_batch``, in lockstep (any backend).

Each spec is ``(prompt, policy, sampling)``. Per round every session gets a block
of its own length (1..16, at most its slack) built from its previous choices plus arbitrary
candidates, and commits its own ``n_keep`` -- so offsets, ring wraps and trims
differ between the sessions of one batch. The alone twin's choices and aux are
the reference; the batched twin must match them round after round (its caches
and positions after each commit are checked by every later round's choices).
"""

from __future__ import annotations

import numpy as np

from kakeya.core.contract import Proposal
from kakeya.core.request import REJECTION
from kakeya.verifier.session import LocalVerifierSession, VerifyItem, verify_batch


def proposal_for(candidates, vocab: int) -> Proposal | None:
    """A 4-token proposal per candidate that contains it (what a rejection-rule session requires)."""
    if not candidates:
        return None
    ids = np.array([[(c + j) % vocab for j in range(4)] for c in candidates], dtype=np.int32)
    probs = np.tile(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32), (len(candidates), 1))
    return Proposal(ids, probs)


def lockstep(target, aux_layers, specs, rounds: int, seed: int = 0, close=np.testing.assert_allclose):
    rng = np.random.default_rng(seed)
    vocab = target.args.vocab_size
    alone = [LocalVerifierSession(target, aux_layers, p, s) for _, p, s in specs]
    batched = [LocalVerifierSession(target, aux_layers, p, s) for _, p, s in specs]
    last = []
    for (prompt, _, _), a, b in zip(specs, alone, batched):
        ta, aux_a = a.prefill(prompt)
        tb, aux_b = b.prefill(prompt)
        assert ta == tb
        close(as_np(aux_b), as_np(aux_a), rtol=1e-4, atol=1e-4)
        last.append(ta)
    batch_sizes = []
    for _ in range(rounds):
        items, refs, keeps = [], [], []
        for k, (a, b) in enumerate(zip(alone, batched)):
            L = int(rng.integers(1, a.policy.slack + 1))  # up to 16, or the session's smaller slack
            cands = [int(c) for c in rng.integers(3, vocab, L - 1)]
            block = [last[k]] + cands
            prop = proposal_for(cands, vocab) if a.sampling is not None and a.sampling.rule == REJECTION else None
            refs.append(a.verify(block, prop))
            items.append(VerifyItem(b, block, prop))
            valid = refs[-1].index(-1) if -1 in refs[-1] else L  # rejection rule: -1 after the first rejection
            keeps.append(int(rng.integers(1, valid + 1)))
        got = verify_batch(items)
        batch_sizes.append(len(items))
        for k, (a, b) in enumerate(zip(alone, batched)):
            assert got[k] == refs[k], f"session {k}: batched choices differ from alone"
            aux_a, aux_b = a.commit(keeps[k]), b.commit(keeps[k])
            close(as_np(aux_b), as_np(aux_a), rtol=1e-4, atol=1e-4)
            assert a.offset == b.offset
            last[k] = refs[k][keeps[k] - 1]
    return alone, batched


def as_np(x):
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.array(x, dtype=np.float32)  # MLX arrays convert through the buffer protocol
