"""Grow a trained drafter into a wider or deeper one that computes the same function.

``kakeya train-drafter --init-from DIR`` with a larger ``--intermediate`` or more ``--layers`` than
DIR's drafter starts from DIR's weights grown to the new shape, not from random ones. The demo
drafter stopped improving with more data (``docs/demo-pair.md``): what it lacks is capacity, and a
larger drafter trained from scratch would throw away what four training runs taught the small one.

The growth preserves the function (Net2Net's idea, in its simplest form), so training starts where
the small drafter is and can only add to it:

- a wider MLP: the new ``gate_proj`` / ``up_proj`` rows are the fresh model's (random), the new
  ``down_proj`` columns zero, so the new units add nothing until trained;
- more layers, appended after the old ones: the fresh model's weights, but ``o_proj`` and
  ``down_proj`` zero, so each new layer adds zero to its residual stream (the drafter's layers are
  pre-norm with plain residual adds) until trained;
- everything else (``fc``, every norm, the old layers' attention) is copied.

Gradients reach the zeroed weights at once (their inputs are not zero), and through them the rest.
``tests/training/test_grow.py`` checks that a grown drafter's logits are the small one's.
"""

from __future__ import annotations

import numpy as np

GROWABLE = frozenset({"intermediate_size", "num_hidden_layers", "layer_types"})
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # a new layer's outputs: it starts as the identity


def why_not(small: dict, big: dict) -> str | None:
    """Why the drafter config ``small`` cannot grow into ``big`` (None: it can)."""
    other = sorted(k for k in set(small) | set(big) if small.get(k) != big.get(k) and k not in GROWABLE)
    if other:
        return (
            f"its config.json differs from this run's drafter config in {other} (only --intermediate and --layers grow)"
        )
    if big["intermediate_size"] < small["intermediate_size"] or big["num_hidden_layers"] < small["num_hidden_layers"]:
        return "a drafter grows, never shrinks: --intermediate and --layers must be at least its own"
    if big["layer_types"][: small["num_hidden_layers"]] != small["layer_types"]:
        return "its layers' types differ from this run's first layers"
    return None


def grow(small: dict[str, np.ndarray], fresh: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The larger drafter's weights (``fresh``: its random initialisation, by name) grown from ``small``'s."""
    unknown = sorted(set(small) - set(fresh))
    if unknown:
        raise ValueError(f"the drafter to grow has weights the larger one lacks: {unknown[:3]}")
    out = {}
    for name, init in fresh.items():
        old = small.get(name)
        if old is None:  # a weight of an appended layer
            out[name] = np.zeros_like(init) if name.endswith(ZEROED) else init
        elif old.shape == init.shape:
            out[name] = old
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):  # [intermediate, hidden]
            out[name] = np.concatenate([old, init[old.shape[0] :]], axis=0)
        elif name.endswith("mlp.down_proj.weight"):  # [hidden, intermediate]
            out[name] = np.concatenate([old, np.zeros_like(init[:, old.shape[1] :])], axis=1)
        else:
            raise ValueError(f"{name}: cannot grow {old.shape} into {init.shape}")
    return out
