"""How far a kernel's output is from the eager path's, in rounding steps of the output dtype."""

from __future__ import annotations

import torch


def steps(actual: torch.Tensor, expected: torch.Tensor, row_scale: bool = False) -> torch.Tensor:
    """Elementwise ``|actual - expected|`` in units of one rounding step (ulp) of ``expected``'s dtype at
    ``expected``'s magnitude (``row_scale``: at the largest magnitude of its row, the last axis);
    equal infinities are 0 apart."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        actual.shape,
        actual.dtype,
        expected.shape,
        expected.dtype,
    )
    fi = torch.finfo(expected.dtype)
    a, e = actual.double().cpu(), expected.double().cpu()
    mag = e.abs().amax(-1, keepdim=True) if row_scale else e.abs()
    ulp = fi.eps * torch.exp2(torch.floor(torch.log2(mag.clamp_min(fi.tiny))))
    diff = torch.where(a == e, torch.zeros_like(a), (a - e).abs())
    return diff / ulp


def assert_within_steps(
    actual: torch.Tensor, expected: torch.Tensor, n: float, *, exact_at_least: float = 0.0, row_scale: bool = False
) -> None:
    """At most ``n`` rounding steps anywhere (see :func:`steps`), and at least ``exact_at_least`` of the
    elements bit-exact."""
    s = steps(actual, expected, row_scale)
    exact = float((s == 0).double().mean())
    assert float(s.max()) <= n, f"{float(s.max())} rounding steps off (at most {n} allowed); {exact:.4f} exact"
    assert exact >= exact_at_least, f"only {exact:.4f} of the elements bit-exact (at least {exact_at_least})"
