"""The demo pair on torch (CPU, float32), loaded once for the constrained-decoding tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine(demo_pair):
    from kakeya.orchestrator.assembly import build_local_engine

    return build_local_engine(demo_pair.target, demo_pair.draft, "torch", "cpu")
