"""benchmarks/grpc_floor.py: a bare gRPC round trip to another process, after each idle gap asked for."""

from __future__ import annotations

import json


def test_round_trips_are_echoed_and_timed_per_gap(tmp_path, benchmark_script):
    mod = benchmark_script("grpc_floor")
    out = tmp_path / "floor.json"
    assert mod.main(["--gaps-ms", "0", "2", "--bytes", "1000", "--rounds", "5", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["bytes"] == 1000 and got["rounds"] == 5
    assert set(got["round_trip_ms"]) == {"sync", "aio"}
    for per_gap in got["round_trip_ms"].values():
        assert set(per_gap) == {"0", "2"} and all(0 < v < 2000 for v in per_gap.values())
    assert got["command"].startswith("python benchmarks/grpc_floor.py --gaps-ms 0 2")


def test_a_block_is_timed_as_two_round_trips_and_as_a_relay_chain(tmp_path, benchmark_script):
    """--block: the relayed verdict really reaches the drafter (a lost one would hang the chain, not time it)."""
    mod = benchmark_script("grpc_floor")
    out = tmp_path / "floor.json"
    argv = [
        "--gaps-ms",
        "0",
        "--rounds",
        "5",
        "--servers",
        "sync",
        "--block",
        "--verify-ms",
        "1",
        "--draft-ms",
        "0.5",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    assert mod.main(argv) == 0
    block = json.loads(out.read_text())["block"]
    assert (block["verify_ms"], block["draft_ms"], block["repeats"]) == (1.0, 0.5, 1)
    wire = block["wire_ms"]
    assert set(wire) == {"two_round_trips", "relay_chain"} and all(0 < v < 2000 for v in wire.values())
    assert block["saved_ms"] == round(wire["two_round_trips"] - wire["relay_chain"], 4)
