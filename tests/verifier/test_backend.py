"""The verifier's backend protocol (``verifier/backend.py``) on both targets.

What only one backend has is declared as data, and asking the other for it
fails loudly; the caches hold arrays only: no forward leaves anything on them
and a trim does not touch them -- the session's layout is the one position
counter.
"""

import pytest

from kakeya.core.request import CachePolicy
from kakeya.verifier.backend import Restores, StaticVerify, Target
from kakeya.verifier.session import LocalVerifierSession

PROMPT = [2] + [(11 * i) % 500 + 7 for i in range(40)]


@pytest.fixture(scope="module")
def torch_target(tiny_pair):
    from kakeya.verifier.torch_backend.target import TargetTorch

    return TargetTorch.load(tiny_pair.target, "cpu", "float32")


@pytest.fixture(params=["mlx", "torch"])
def target(request, mlx_target, torch_target):
    return {"mlx": mlx_target, "torch": torch_target}[request.param]


def test_capabilities_are_data(mlx_target, torch_target, aux_layers):
    assert isinstance(mlx_target, Target) and isinstance(torch_target, Target)
    assert (torch_target.static_verify, torch_target.restores) == (True, False)
    assert (mlx_target.static_verify, mlx_target.restores) == (False, True)
    # each capability's protocol is implemented exactly where its flag says so
    assert isinstance(torch_target, StaticVerify) and not isinstance(mlx_target, StaticVerify)
    assert isinstance(mlx_target, Restores) and not isinstance(torch_target, Restores)
    restore = CachePolicy("sink-window", sink=4, window=16, restore="/no/such/ftheta")
    with pytest.raises(ValueError, match="not implemented on the torch backend"):
        LocalVerifierSession(torch_target, aux_layers, restore)


@pytest.mark.parametrize(
    "policy",
    [CachePolicy(), CachePolicy("sink-window", sink=2, window=8, full_kv_bits=8)],
    ids=["native", "sink-window+kv8"],
)
def test_caches_hold_arrays_only(target, aux_layers, policy):
    session = LocalVerifierSession(target, aux_layers, policy)
    first, _ = session.prefill(PROMPT)
    names = [sorted(vars(c)) for c in session.cache.layers]
    for block in ([first, 9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20]):
        session.verify(block)
        held = [{k: id(v) for k, v in vars(c).items()} for c in session.cache.layers]
        session.commit(1)  # trims the rest of the block: the layout moves back, the caches stay as they are
        assert [{k: id(v) for k, v in vars(c).items()} for c in session.cache.layers] == held
    assert [sorted(vars(c)) for c in session.cache.layers] == names  # no forward left anything behind
    assert not {"offset", "plan", "at", "prefix", "layout"} & {k for c in session.cache.layers for k in vars(c)}
    assert session.offset == len(PROMPT) + 3
