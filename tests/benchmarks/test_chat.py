"""benchmarks/chat.py on the tiny pair: the turns resume the conversation and equal the cold engine's."""

from __future__ import annotations

import json


def test_a_short_chat_is_measured_cached_and_cold(tmp_path, tiny_pair, benchmark_script):
    mod = benchmark_script("chat")
    out = tmp_path / "chat.json"
    argv = ["--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--backend", "mlx", "--turns", "2",
            "--max-tokens", "12", "--rounds", "2", "--no-system", "--concurrent", "3",
            "--concurrent-max-tokens", "8", "--concurrent-budget-bytes", str(1 << 28), "--out", str(out)]  # fmt: skip
    assert mod.main(argv) == 0
    result = json.loads(out.read_text())
    first, second = result["turns"]
    assert second["prompt_tokens"] > first["prompt_tokens"]
    # turn 1's first run is cold; its second round resumes the first round's snapshot, trimmed back to the
    # prompt less its last token (the snapshot runs past the prompt: its answer)
    assert first["cached_tokens"] == [0, first["prompt_tokens"] - 1]
    # the second prompt starts with the first prompt + its answer (re-rendered), and the cache resumed
    # from within that history, never past it
    assert first["history_tokens"] == 0 and first["cached_of_history"] is None
    assert first["prompt_tokens"] < second["history_tokens"] <= first["prompt_tokens"] + first["completion_tokens"]
    assert 0 < second["cached_tokens"][0] <= second["history_tokens"]
    assert second["cached_of_history"] == round(second["cached_tokens"][0] / second["history_tokens"], 4)
    assert result["goals"]["identical_output"] and result["goals"]["acceptance_equal"]
    assert result["prefix_cache"]["insertions"] > 0 and result["command"].startswith("python benchmarks/chat.py")
    # Three chats at once, in a budget that holds them all: each one's second turn finds its first. (In the
    # default budget of four snapshots, which chat's snapshot survives depends on the threads' order; that
    # the budget holds under eviction is tests/prefix/test_colocated.py's sixteen-chat test.)
    crowd = result["concurrent"]
    assert crowd["chats"] == 3 and not crowd["errors"] and crowd["identical_to_cold"]
    assert 0 < crowd["prefix_cache"]["peak_bytes"] <= crowd["prefix_cache"]["budget_bytes"] and crowd["within_budget"]
    assert crowd["cached_tokens"] > 0
