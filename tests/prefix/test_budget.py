"""The prefix cache is on by default (issue 43, point 5): ``--prefix-cache-bytes auto`` is a tenth of the memory
its snapshots live in, at most 4 GiB (``runtime/spare.py``); ``0`` turns it off; a number is that budget."""

from __future__ import annotations

import argparse

import pytest

from kakeya.app import flags
from kakeya.app.main import build_parser
from kakeya.runtime import spare
from kakeya.runtime.spare import AUTO_CAP_BYTES, auto_prefix_cache_bytes

GiB = 2**30


def test_auto_is_a_tenth_of_the_free_memory_capped(monkeypatch):
    assert auto_prefix_cache_bytes(10 * GiB) == GiB
    assert auto_prefix_cache_bytes(100 * GiB) == AUTO_CAP_BYTES == 4 * GiB
    assert auto_prefix_cache_bytes(0) == 0  # nothing to spare: off
    host = spare.available_host_bytes()
    assert host is not None and host > 0  # this Linux box says
    monkeypatch.setattr(spare, "available_host_bytes", lambda: host)  # that reading: a second one may differ
    assert auto_prefix_cache_bytes() == min(host // 10, AUTO_CAP_BYTES) > 0


def test_a_containers_limit_bounds_the_host_memory(tmp_path):
    assert spare._cgroup_spare(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert spare._cgroup_spare(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{2 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{GiB // 2}\n")
    assert spare._cgroup_spare(tmp_path) == GiB + GiB // 2
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "no limit"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5")
    assert spare._cgroup_spare(v1) is None


@pytest.mark.parametrize("role", ["verifier", "drafter", "orchestrator", "all"])
def test_every_server_keeps_a_prefix_cache_unless_told_0(role, monkeypatch):
    # one reading of the host's spare memory for every call below: two readings differ whenever another process
    # allocates between them (a full run on 2 cores: 2318024704 against 2318032896 bytes)
    monkeypatch.setattr(spare, "available_host_bytes", lambda: 8 << 30)
    parse = build_parser().parse_args
    args = parse(["serve", role])
    assert args.prefix_cache_bytes == flags.AUTO
    assert flags.prefix_cache_bytes(args) == auto_prefix_cache_bytes() > 0
    assert flags.prefix_cache_bytes(parse(["serve", role, "--prefix-cache-bytes", "0"])) == 0
    assert flags.prefix_cache_bytes(parse(["serve", role, "--prefix-cache-bytes", "512M"])) == 512 << 20
    if role in ("verifier", "drafter"):
        assert flags.session_limits(args, "cpu").prefix_cache_bytes == auto_prefix_cache_bytes()
        assert flags.session_limits(parse(["serve", role, "--prefix-cache-bytes", "0"])).prefix_cache_bytes == 0


def test_on_a_cuda_device_auto_is_a_share_of_the_device(monkeypatch):
    """A torch server on CUDA keeps its snapshots on the device (``torch.clone`` of its caches): the budget
    is a share of the device's free memory, not the host's."""
    from kakeya.backends.torch import memory

    assert memory.device_free_bytes("cpu") is None  # a CPU's snapshots are the host's
    asked = []
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: asked.append(device) or 20 * GiB)
    monkeypatch.setattr(spare, "available_host_bytes", lambda: 8 * GiB)  # one reading for both calls below
    args = build_parser().parse_args(["serve", "verifier"])
    assert flags.prefix_cache_bytes(args, "cuda:1") == 2 * GiB and asked == ["cuda:1"]
    assert flags.prefix_cache_bytes(args, "cpu") == auto_prefix_cache_bytes() and asked == ["cuda:1"]


def test_byte_sizes():
    assert [flags.byte_size(t) for t in ("auto", " AUTO ", "0", "2G", "1.5GiB", "512M")] == [
        "auto", "auto", 0, 2 * GiB, 3 * GiB // 2, 512 << 20,
    ]  # fmt: skip
    for bad in ("-1", "lots", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="a byte count"):
            flags.byte_size(bad)


def test_byte_flags_take_the_same_sizes_and_refuse_by_name(capsys):
    """--max-kv-bytes reads 2G as --prefix-cache-bytes does; a size that is no byte count is one usage line naming
    its flag and what it takes (it was 'invalid int value', 'invalid byte_size value', or an OverflowError)."""
    args = build_parser().parse_args(["serve", "all", "--max-kv-bytes", "2G", "--prefix-cache-bytes", "1.5GiB"])
    assert (args.max_kv_bytes, args.prefix_cache_bytes) == (2 * GiB, 3 * GiB // 2)
    for flag, bad in [("--prefix-cache-bytes", "inf"), ("--prefix-cache-bytes", "2X"), ("--max-kv-bytes", "-1"),
                      ("--max-kv-bytes", "auto"), ("--max-kv-bytes", "nan")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", "all", f"{flag}={bad}"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and f"argument {flag}:" in err and "2G" in err and "byte_size" not in err, err
