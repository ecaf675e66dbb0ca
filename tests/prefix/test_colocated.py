"""The prefix cache through the one request path (``Engine.start`` -> ``Run``), colocated.

A multi-turn conversation on the tiny pair (each turn's prompt: the last one, its
answer and a new message) resumes every later turn from the previous turn's
snapshot, and its output and acceptance equal a cold engine's on the same
prompt: greedy and sampled, torch and MLX, past the rings' wraps. Sixteen
conversations at once through one compute thread share one budget that is never
exceeded.
"""

import itertools
import threading

import pytest

from kakeya.core.prefix import PrefixCache
from kakeya.core.request import Request, SamplingParams
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.decode.engine import RunOptions
from kakeya.runtime.compute import ComputeThread

USER = [[40, 41, 42, 43, 44, 45], [50, 51, 52], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]


def _engines(tiny_pair, backend, budget=1 << 28):
    kw = {"device": "cpu"} if backend == "torch" else {}
    args = (str(tiny_pair.target), str(tiny_pair.draft), backend)
    return build_local_engine(*args, prefixes=PrefixCache(budget), **kw), build_local_engine(*args, **kw)


def _chat(engine, first_prompt, turns, block_size=4, sampling=SamplingParams(), step=None):
    """``turns`` generations, each prompt the previous prompt + its answer + a user message; their Generations."""
    prompt, out = list(first_prompt), []
    options = RunOptions(step=step) if step is not None else None
    for t in range(turns):
        gen = engine.generate(
            Request(list(prompt), max_tokens=40, block_size=block_size, ignore_eos=True, sampling=sampling), options
        )
        out.append(gen)
        prompt = prompt + gen.token_ids + USER[t % len(USER)]
    return out


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=11)], ids=["greedy", "sampled"]
)
def test_later_turns_resume_and_equal_a_cold_run(tiny_pair, backend, sampling):
    cached, cold = _engines(tiny_pair, backend)
    prompt = [2] + list(range(100, 140))
    turns = _chat(cached, prompt, 4, sampling=sampling)
    assert turns[0].cached_tokens == 0
    for gen in turns:
        again = cold.generate(
            Request(list(gen.prompt_ids), max_tokens=40, block_size=4, ignore_eos=True, sampling=sampling)
        )
        assert gen.token_ids == again.token_ids
        assert gen.acceptance_lengths == again.acceptance_lengths
    for prev, gen in itertools.pairwise(turns):
        # the previous turn's prompt and answer, but its last token (no forward saw it)
        assert gen.cached_tokens == len(prev.prompt_ids) + len(prev.token_ids) - 1
        assert gen.cached_tokens >= 0.8 * len(gen.prompt_ids)
    s = cached.verifier.prefixes.stats()
    assert (s["hits"], s["misses"]) == (3, 1) and s["tokens_reused"] == sum(g.cached_tokens for g in turns)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=5)], ids=["greedy", "sampled"]
)
def test_a_history_that_comes_back_short_of_its_last_tokens_still_resumes(tiny_pair, backend, sampling):
    """A client re-renders the history: the answer's last tokens may come back otherwise (Gemma 2's and 3's
    templates trim each message). The turn resumes from the previous turn's snapshot trimmed back to what the prompt
    shares, on both sides, with the cold run's output and acceptance; a snapshot the rings cannot trim back
    to exactly is passed over, never resumed wrong."""
    cached, cold = _engines(tiny_pair, backend)
    prompt = [2] + list(range(100, 140))
    first = cached.generate(Request(list(prompt), max_tokens=40, block_size=4, ignore_eos=True, sampling=sampling))
    held = len(prompt) + len(first.token_ids) - 1  # the snapshot: every position a forward saw
    for cut in (2, 3, 5):  # the answer's last `cut` tokens come back as other tokens
        second = list(prompt) + first.token_ids[:-cut] + [7] * cut + USER[0]
        gen = cached.generate(Request(second, max_tokens=24, block_size=4, ignore_eos=True, sampling=sampling))
        again = cold.generate(Request(second, max_tokens=24, block_size=4, ignore_eos=True, sampling=sampling))
        assert gen.token_ids == again.token_ids and gen.acceptance_lengths == again.acceptance_lengths
        assert gen.cached_tokens == held - (cut - 1), cut  # the shared positions, the snapshot's newest trimmed
    assert cached.verifier.prefixes.stats()["misses"] == 1  # the first turn only


def test_a_verifier_only_snapshot_serves_the_verifier_only(tiny_pair):
    """Without a drafter session (block size 1) only the verifier saves: a speculative request cannot resume
    from it (its drafter would have a gap) and runs cold; a non-speculative one resumes it."""
    cached, cold = _engines(tiny_pair, "mlx")
    prompt = [2] + list(range(200, 230))
    (first,) = _chat(cached, prompt, 1, block_size=1)
    nxt = prompt + first.token_ids + USER[0]
    spec = cached.generate(Request(list(nxt), max_tokens=30, block_size=4, ignore_eos=True))
    assert spec.cached_tokens == 0
    ar = cached.generate(Request(list(nxt), max_tokens=30, block_size=1, ignore_eos=True))
    assert ar.cached_tokens == len(prompt) + len(first.token_ids) - 1
    assert (
        spec.token_ids
        == ar.token_ids
        == cold.generate(Request(list(nxt), max_tokens=30, block_size=4, ignore_eos=True)).token_ids
    )


def test_a_stop_cut_answer_is_saved_as_the_client_saw_it(tiny_pair):
    cached, cold = _engines(tiny_pair, "mlx")
    prompt = [2] + list(range(300, 330))
    probe = cold.generate(Request(list(prompt), max_tokens=30, block_size=8, ignore_eos=True))
    stop = probe.token_ids[12]
    gen = cached.generate(Request(list(prompt), max_tokens=30, block_size=8, ignore_eos=True, stop_ids=[stop]))
    assert gen.token_ids == probe.token_ids[: probe.token_ids.index(stop) + 1]
    nxt = prompt + gen.token_ids + USER[1]
    resumed = cached.generate(Request(list(nxt), max_tokens=30, block_size=8, ignore_eos=True))
    assert resumed.cached_tokens == len(prompt) + len(gen.token_ids) - 1
    assert (
        resumed.token_ids == cold.generate(Request(list(nxt), max_tokens=30, block_size=8, ignore_eos=True)).token_ids
    )


def test_a_resumed_stream_counts_only_its_prompt_as_cached(tiny_pair):
    """``cached_tokens`` is a part of the prompt (OpenAI's ``prompt_tokens_details``): a resumed stream
    (``resume_ids``) prefills the prompt and the tokens its client has, both found in the snapshot of the run it
    continues, and only the prompt's are cached prompt tokens; the others are completion tokens."""
    cached, _ = _engines(tiny_pair, "mlx")
    prompt = [2] + list(range(200, 210))  # with the answer, within the sliding window: no ring wrapped
    whole = cached.generate(Request(list(prompt), max_tokens=16, block_size=4, ignore_eos=True))
    resumed = cached.generate(
        Request(list(prompt), max_tokens=16, block_size=4, ignore_eos=True, resume_ids=tuple(whole.token_ids[:8]))
    )
    assert resumed.token_ids == whole.token_ids and resumed.prompt_ids == prompt
    assert resumed.cached_tokens == len(prompt), "the resumed tokens counted as cached prompt tokens"


def test_sixteen_concurrent_chats_stay_within_budget_and_equal_cold(tiny_pair):
    budget = 600_000  # a few snapshots of the tiny pair: chats evict each other's
    cached, cold = _engines(tiny_pair, "torch", budget)
    compute = ComputeThread("test", max_batch=1)
    cache = cached.verifier.prefixes
    results, errors = {}, []

    def chat(k):
        try:
            results[k] = _chat(cached, [2] + [100 + 7 * k + i for i in range(24)], 3, step=compute.run)
        except Exception as exc:  # noqa: BLE001  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=chat, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = cache.stats()
    # the high-water mark, kept by the cache under its lock at every insertion
    assert s["bytes"] <= s["peak_bytes"] <= budget and s["evictions"] > 0 and s["hits"] > 0
    for k, turns in results.items():
        for gen in turns:
            again = cold.generate(Request(list(gen.prompt_ids), max_tokens=40, block_size=4, ignore_eos=True))
            assert gen.token_ids == again.token_ids and gen.acceptance_lengths == again.acceptance_lengths, k
