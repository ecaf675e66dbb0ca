"""The prefix cache across processes: split (verifier and drafter servers, each with its own cache) and a
colocated server, against a colocated server without one.

A conversation's later turns resume the earlier ones on both sides (``Complete.cached_tokens``), with
the output and acceptance of the cold server; a snapshot one side lacks means a cold prefill on both
(never a drafter with a gap); the new protocol steps refuse what they cannot do, naming the field;
the caches show in the metrics.
"""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from kakeya.wire.kakeya.v1 import drafter_pb2, verifier_pb2

from .conftest import TINY_MLX, drafter_info, drafter_stub, generate, request, start_all, verifier_info, verifier_stub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CACHE = ["--prefix-cache-bytes", "64M", "--metrics-port", "0", "--grace", "5"]
PROMPT = [2] + list(range(300, 340))
USER = [[40, 41, 42, 43, 44], [50, 51, 52, 53, 54, 55, 56], [60, 61, 62]]


@pytest.fixture(scope="module")
def servers(server_factory):
    verifier = server_factory("verifier", ["verifier", *TINY_MLX, *CACHE])
    drafter = server_factory("drafter", ["drafter", *TINY_MLX, *CACHE])
    cached = server_factory("colocated-cached", ["orchestrator", *TINY_MLX, *CACHE])
    cold = server_factory("colocated-cold", ["orchestrator", *TINY_MLX, "--prefix-cache-bytes", "0", "--grace", "5"])
    start_all([verifier, drafter, cached, cold])
    split = server_factory("split", ["orchestrator", "--verifier", verifier.addr, "--drafter", drafter.addr,
                                     "--metrics-port", "0", "--grace", "5"])  # fmt: skip
    start_all([split])
    return {"verifier": verifier, "drafter": drafter, "split": split, "cached": cached, "cold": cold}


def _metrics(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.info['metrics_port']}/metrics", timeout=10) as r:
        return r.read().decode()


def _value(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize("deployment", ["split", "cached"])
def test_a_conversation_resumes_its_earlier_turns_with_the_cold_output(servers, deployment):
    prompt = list(PROMPT) + [{"split": 7, "cached": 8}[deployment]]  # each its own conversation
    previous = 0  # the last turn's prompt and answer but its last token: what the next turn resumes
    for turn in range(4):
        ids, _, complete, _ = generate(servers[deployment].addr, request(prompt, max_tokens=40, block_size=4))
        cold_ids, _, cold, _ = generate(servers["cold"].addr, request(prompt, max_tokens=40, block_size=4))
        assert ids == cold_ids
        assert list(complete.stats.acceptance_lengths) == list(cold.stats.acceptance_lengths)
        assert cold.cached_tokens == 0
        assert complete.cached_tokens == previous
        previous = len(prompt) + len(ids) - 1
        prompt = prompt + ids + USER[turn % len(USER)]


def test_a_snapshot_only_the_verifier_holds_is_a_cold_prefill_on_both_sides(servers):
    addr = servers["split"].addr
    prompt = list(PROMPT) + [9]
    ids, _, _, _ = generate(addr, request(prompt, max_tokens=20, block_size=1))  # no drafter session: verifier only
    nxt = prompt + ids + USER[0]
    spec_ids, _, spec, _ = generate(addr, request(nxt, max_tokens=30, block_size=4))
    assert (
        spec.cached_tokens == 0
        and spec_ids == generate(servers["cold"].addr, request(nxt, max_tokens=30, block_size=4))[0]
    )
    _, _, ar, _ = generate(addr, request(nxt, max_tokens=5, block_size=1))
    assert ar.cached_tokens == len(prompt) + len(ids) - 1  # the verifier alone may resume it


def test_the_caches_show_in_info_and_metrics(servers):
    assert verifier_info(servers["verifier"].addr).prefix_cache_bytes == 64 * 2**20
    assert drafter_info(servers["drafter"].addr).prefix_cache_bytes == 64 * 2**20
    generate(servers["split"].addr, request(list(PROMPT) + [11], max_tokens=10, block_size=4))
    v, d, o = _metrics(servers["verifier"]), _metrics(servers["drafter"]), _metrics(servers["split"])
    assert _value(v, "kakeya_prefix_cache_budget_bytes") == 64 * 2**20
    assert 0 < _value(v, "kakeya_prefix_cache_bytes") <= 64 * 2**20 and _value(v, "kakeya_prefix_cache_entries") >= 1
    assert _value(v, "kakeya_prefix_cache_bytes") <= _value(v, "kakeya_prefix_cache_peak_bytes") <= 64 * 2**20
    assert _value(v, "kakeya_prefix_cache_misses_total") >= 1
    assert _value(d, "kakeya_prefix_cache_insertions_total") >= 1
    assert "kakeya_prompt_tokens_cached_total" in o
    assert _value(_metrics(servers["cached"]), "kakeya_prefix_cache_entries") >= 1  # colocated: one shared cache


V, D = verifier_pb2.VerifierRequest, drafter_pb2.DrafterRequest
BAD = [
    ("verifier", "save before prefill", [V(open=V.Open()), V(save=V.Save(token_ids=[2]))], grpc.StatusCode.FAILED_PRECONDITION, "save"),
    ("verifier", "save of another prompt", [V(open=V.Open()), V(prefill=V.Prefill(token_ids=[2, 5, 6])), V(save=V.Save(token_ids=[2, 7, 6]))],
     grpc.StatusCode.INVALID_ARGUMENT, "save.token_ids"),
    ("verifier", "save outside the vocabulary", [V(open=V.Open()), V(prefill=V.Prefill(token_ids=[2])), V(save=V.Save(token_ids=[2, 5000]))],
     grpc.StatusCode.INVALID_ARGUMENT, "save.token_ids"),
    ("drafter", "resume of nothing held", [D(open=D.Open()), D(draft=D.Draft(resume_at=5, last_token=2))], grpc.StatusCode.INVALID_ARGUMENT,
     "draft.resume_at"),
    ("drafter", "lookup outside the vocabulary", [D(open=D.Open()), D(lookup=D.Lookup(prompt_ids=[2, -1]))], grpc.StatusCode.INVALID_ARGUMENT,
     "lookup.prompt_ids"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[c[1] for c in BAD])
def test_bad_prefix_steps_are_refused_naming_the_field(servers, case):
    side, _, msgs, code, field = case
    stub = verifier_stub(servers["verifier"].addr) if side == "verifier" else drafter_stub(servers["drafter"].addr)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Session(iter(msgs), timeout=30))
    assert err.value.code() == code and field in err.value.details(), err.value.details()


def test_a_raw_verifier_session_resumes_and_saves(servers):
    stub = verifier_stub(servers["verifier"].addr)
    prompt = list(PROMPT) + [13]
    out = list(stub.Session(iter([V(open=V.Open()), V(prefill=V.Prefill(token_ids=prompt)), V(save=V.Save(token_ids=prompt)),
                                  V(close=V.Close())]), timeout=30))  # fmt: skip
    assert [r.WhichOneof("response") for r in out] == ["opened", "prefilled", "saved", "closed"] and out[2].saved.kept
    longer = prompt + [out[1].prefilled.next_token, 5]
    out = list(stub.Session(iter([V(open=V.Open()), V(prefill=V.Prefill(token_ids=longer, reuse_positions=[len(prompt)]))]),
                            timeout=30))  # fmt: skip
    assert out[1].prefilled.cached_tokens == len(prompt) and out[1].prefilled.aux.shape[0] == 2
