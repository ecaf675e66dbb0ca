"""The prefix cache's store (``core/prefix.py``): keys, prefixes, the byte budget, LRU, concurrency."""

import threading

import pytest

from kakeya.core.prefix import HASH_BLOCK, PrefixCache, block_hashes


def test_block_hashes_chain_every_boundary_and_depend_on_the_namespace():
    ids = list(range(3 * HASH_BLOCK + 5))
    h = block_hashes(ids, "ns")
    assert len(h) == 4  # the empty prefix, then one per full block
    assert block_hashes(ids[: 2 * HASH_BLOCK], "ns") == h[:3]  # a prefix's hashes are the prompt's
    assert block_hashes(ids, "other")[1] != h[1]
    changed = list(ids)
    changed[HASH_BLOCK + 1] += 1
    assert block_hashes(changed, "ns")[1] == h[1] and block_hashes(changed, "ns")[2] != h[2]
    assert block_hashes(ids, "ns", limit=HASH_BLOCK)[-1] == h[1]


def test_find_returns_every_stored_prefix_of_the_prompt_longest_first():
    cache = PrefixCache(10_000)
    prompt = list(range(100, 160))
    for n in (5, 16, 33, 40):
        assert cache.put("v", prompt[:n], f"state{n}", 10)
    cache.put("v", [1, 2, 3], "other", 10)  # not a prefix
    cache.put("d", prompt[:20], "other namespace", 10)
    assert [e.positions for e in cache.find("v", prompt)] == [40, 33, 16, 5]
    assert [e.value for e in cache.find("v", prompt, allowed={33, 5, 7})] == ["state33", "state5"]
    # at least one prompt token is left to compute: a snapshot of the whole prompt does not serve it
    assert [e.positions for e in cache.find("v", prompt[:40])] == [33, 16, 5]
    assert cache.find("v", prompt, allowed=()) == []


def test_a_boundary_hash_alone_never_makes_a_hit():
    cache = PrefixCache(10_000)
    prompt = list(range(40))
    cache.put("v", prompt[:20], "s", 10)
    other = prompt[:18] + [999] + prompt[19:]  # same first block, different tail before the snapshot's end
    assert cache.find("v", other) == []


def test_a_prompt_that_leaves_a_snapshot_in_its_last_block_finds_it_partially():
    """A chat's history comes back re-rendered: its last tokens may differ (Gemma 2's and 3's templates
    trim each message). With ``partial`` the snapshot is still found, matched as far as the prompt shares it."""
    cache = PrefixCache(10_000)
    ids = list(range(100, 100 + 2 * HASH_BLOCK))  # ends on a boundary: filed a block before it
    cache.put("v", ids, "turn1", 10)
    prompt = ids[:-3] + [7, 8, 9, 10]  # the last 3 tokens re-tokenized, then a new message
    assert cache.find("v", prompt) == []  # not a prefix: no exact match
    (match,) = cache.find("v", prompt, partial=True)
    assert (match.positions, match.back, match.value) == (2 * HASH_BLOCK - 3, 3, "turn1")
    assert cache.find("v", prompt, allowed={2 * HASH_BLOCK}, partial=True) == []  # allowed: the match's length
    # a divergence before the boundary the snapshot is filed under is not searched for
    far = ids[: HASH_BLOCK - 2] + [1] * (HASH_BLOCK + 4)
    assert cache.find("v", far, partial=True) == []
    # an exact snapshot of the same length comes before a trimmed one
    cache.put("v", ids[:-3], "exact", 10)
    assert [(m.value, m.back) for m in cache.find("v", prompt, partial=True)] == [("exact", 0), ("turn1", 3)]


def test_a_prompt_run_again_resumes_from_its_longer_snapshot_and_a_partial_match_shares_a_block():
    cache = PrefixCache(10_000)
    prompt = list(range(200, 200 + HASH_BLOCK + 6))
    cache.put("v", prompt + [1, 2, 3], "answered", 10)  # the prompt's run: its snapshot holds the answer too
    assert cache.find("v", prompt) == []
    (match,) = cache.find("v", prompt, partial=True)  # the same prompt again: all of it but its last token
    assert (match.positions, match.back) == (len(prompt) - 1, 4)
    assert cache.find("v", prompt[: HASH_BLOCK - 1] + [5] * 10, partial=True) == []  # under a block shared: none


def test_the_budget_is_never_exceeded_and_the_least_recently_used_goes_first():
    cache = PrefixCache(100)
    a, b, c = [1] * 20, [2] * 20, [3] * 20
    cache.put("v", a, "a", 40)
    cache.put("v", b, "b", 40)
    cache.find("v", a + [0])  # a is used: b is now the oldest
    cache.put("v", c, "c", 40)
    assert cache.bytes == 80 and len(cache) == 2
    assert cache.find("v", b + [0]) == [] and cache.find("v", a + [0]) and cache.find("v", c + [0])
    assert not cache.put("v", [4] * 20, "too big", 101)
    assert cache.stats()["evictions"] == 1 and cache.bytes <= 100
    assert cache.stats()["peak_bytes"] == 80  # evicting b made room before c went in: never 120


def test_the_same_ids_are_kept_once():
    cache = PrefixCache(100)
    assert cache.put("v", [1, 2, 3], "first", 30) and cache.put("v", [1, 2, 3], "second", 30)
    assert cache.bytes == 30 and cache.find("v", [1, 2, 3, 4])[0].value == "first"


def test_counts_hits_misses_and_tokens():
    cache = PrefixCache(0)  # a zero budget keeps nothing
    assert not cache.put("v", [1], "x", 1)
    cache.count(0)
    cache.count(48)
    s = cache.stats()
    assert (s["hits"], s["misses"], s["tokens_reused"], s["entries"], s["bytes"]) == (1, 1, 48, 0, 0)
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_concurrent_puts_and_finds_stay_within_budget():
    cache = PrefixCache(1000)
    errors = []

    def chat(k: int) -> None:
        try:
            ids = [k]
            for turn in range(50):
                ids = ids + [k, turn] * 9
                cache.find("v", ids + [0])
                cache.put("v", ids, (k, turn), 37 + k)
                assert cache.bytes <= 1000
        except Exception as exc:  # noqa: BLE001  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=chat, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.bytes <= cache.peak_bytes <= 1000 and cache.bytes == sum(e.nbytes for e in cache._entries.values())
