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
