"""The Gateway API Inference Extension's model-server gauges on real processes, scraped while streams run.

An endpoint picker routes by three gauges of each orchestrator (docs/deploy.md): queued requests
(``kakeya_num_requests_waiting``), running requests (``kakeya_num_requests_running``) and K/V-cache
utilization as a fraction of the budget admission counts against (``kakeya_kv_cache_usage_perc``).
The verifier runs with ``--max-kv-bytes``, so its sessions' reservations fill a known budget.
"""

from __future__ import annotations

import threading

import pytest

from kakeya.wire.kakeya.v1 import generate_pb2

from .conftest import TINY_MLX, generate, request, scrape, start_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BUDGET = 64 * 2**20
STREAMS = 4
# Each stream's length: seconds of streaming on the 2-core machine, many times the orchestrator's once-a-second
# refresh of its verifier's figure (600 tokens only made the test wait longer for the streams' end).
TOKENS = 300


@pytest.fixture(scope="module")
def servers(server_factory):
    verifier = server_factory("verifier", ["verifier", *TINY_MLX, "--max-kv-bytes", str(BUDGET), "--metrics-port", "0"])
    drafter = server_factory("drafter", ["drafter", *TINY_MLX])
    start_all([verifier, drafter])
    orch = server_factory(
        "orchestrator", ["orchestrator", "--verifier", verifier.addr, "--drafter", drafter.addr, "--metrics-port", "0"]
    )
    start_all([orch])
    return verifier, orch


def _gauges(server) -> dict[str, float]:
    m = scrape(server.info["metrics_port"])
    names = ("kakeya_num_requests_waiting", "kakeya_num_requests_running", "kakeya_kv_cache_usage_perc")
    return {n: m[(n, ())] for n in names}


def test_the_gauges_move_while_streams_run(servers):
    verifier, orch = servers
    idle = _gauges(orch)
    assert idle == {"kakeya_num_requests_waiting": 0, "kakeya_num_requests_running": 0, "kakeya_kv_cache_usage_perc": 0}

    done = []
    threads = [
        threading.Thread(target=lambda k=k: done.append(generate(orch.addr, request([2, 40 + k, 41, 42], max_tokens=TOKENS))))
        for k in range(STREAMS)
    ]  # fmt: skip
    for t in threads:
        t.start()
    busy = wait_until(
        lambda: (g := _gauges(orch))["kakeya_num_requests_running"] == STREAMS and g["kakeya_kv_cache_usage_perc"] > 0 and g,
        interval=0.05, what="the gauges to show the streams",
    )  # fmt: skip
    assert 0 < busy["kakeya_kv_cache_usage_perc"] <= 1
    # the orchestrator's figure is its verifier's own: reserved bytes over --max-kv-bytes
    assert scrape(verifier.info["metrics_port"])[("kakeya_kv_cache_usage_perc", ())] > 0
    for t in threads:
        t.join(240)
    assert len(done) == STREAMS and all(c.finish_reason == generate_pb2.FINISH_REASON_LENGTH for _, _, c, _ in done)
    wait_until(lambda: _gauges(orch) == idle, interval=0.2, what="the gauges to fall back once the streams ended")
