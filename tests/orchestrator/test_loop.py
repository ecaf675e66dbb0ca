"""The accept/trim loop against scripted verifier/drafter sessions (no model)."""

import pytest

from kakeya.core.contract import Draft, Verdict, accept
from kakeya.orchestrator.loop import run
from kakeya.orchestrator.quality import find_runaway, quality_report


class ScriptedVerifier:
    """A 'target' whose greedy continuation is a fixed sequence; tracks the committed length."""

    def __init__(self, prompt_len, continuation):
        self.cont = continuation
        self.pos = 0  # tokens of the continuation committed into the cache (the last one is not fed yet)
        self.prompt_len = prompt_len
        self.kept = []

    def prefill(self, prompt):
        assert len(prompt) == self.prompt_len
        return self.cont[0], list(range(len(prompt)))

    def decide(self, last, draft):
        block = [last, *draft.tokens]
        assert block[0] == self.cont[self.pos], "block must open with the last committed token"
        # the target's choice after block[i] given block[:i] matched is cont[pos+i+1]
        choices = []
        for i in range(len(block)):
            choices.append(self.cont[self.pos + i + 1])
            if i + 1 < len(block) and block[i + 1] != self.cont[self.pos + i + 1]:
                choices.extend([-1] * (len(block) - i - 2))
                break
        accepted, next_token = accept(block[1:], choices[: len(block)])
        self.pos += accepted + 1
        self.kept.append(accepted + 1)
        return Verdict(accepted, next_token, ["aux"] * (accepted + 1))

    def stats(self):
        return {}

    def close(self):
        pass


class ScriptedDrafter:
    def __init__(self, verifier, wrong_every=3):
        self.v, self.calls, self.wrong_every = verifier, 0, wrong_every

    def draft(self, new_aux, last, B):
        self.calls += 1
        good = self.v.cont[self.v.pos + 1 : self.v.pos + B]
        k = self.calls % self.wrong_every if self.wrong_every else -1
        return Draft([t if i != k else 999 for i, t in enumerate(good)])


CONT = list(range(100, 400))


@pytest.mark.parametrize("B", [1, 2, 4, 8, 16])
def test_output_is_the_targets_sequence_and_max_tokens_cuts_mid_block(B):
    v = ScriptedVerifier(3, CONT)
    g = run(v, ScriptedDrafter(v), [1, 2, 3], max_tokens=37, block_size=B)
    assert g.token_ids == CONT[:37]
    assert g.finish_reason == "length"
    assert sum(g.acceptance_lengths) + 1 == 37
    assert all(1 <= a <= B for a in g.acceptance_lengths)


def test_stop_token_inside_a_block_ends_generation_there():
    v = ScriptedVerifier(1, CONT)
    g = run(v, ScriptedDrafter(v, wrong_every=None), [0], max_tokens=200, block_size=8, stop_ids={CONT[11]})
    assert g.token_ids == CONT[:12] and g.finish_reason == "stop"


def test_stop_on_first_token():
    v = ScriptedVerifier(1, CONT)
    g = run(v, ScriptedDrafter(v), [0], max_tokens=50, block_size=4, stop_ids={CONT[0]})
    assert g.token_ids == [CONT[0]] and g.acceptance_lengths == []


def test_full_and_zero_acceptance_and_bonus():
    v = ScriptedVerifier(1, CONT)
    perfect = run(v, ScriptedDrafter(v, wrong_every=None), [0], max_tokens=33, block_size=8)
    assert perfect.acceptance_lengths == [8, 8, 8, 8] and perfect.token_ids == CONT[:33]

    class Wrong:
        def draft(self, aux, last, B):
            return Draft([999] * (B - 1))

    v = ScriptedVerifier(1, CONT)
    zero = run(v, Wrong(), [0], max_tokens=20, block_size=8)
    assert zero.acceptance_lengths == [1] * 19 and zero.token_ids == CONT[:20]
    assert v.kept == [1] * 19  # every rejected candidate was trimmed


def test_drafter_failure_falls_back_to_verifier_alone():
    v = ScriptedVerifier(1, CONT)

    class Dies(ScriptedDrafter):
        def draft(self, aux, last, B):
            if self.calls >= 2:
                raise ConnectionError("drafter gone")
            return super().draft(aux, last, B)

    errors = []
    g = run(v, Dies(v), [0], max_tokens=60, block_size=8, on_drafter_error=errors.append)
    assert g.token_ids == CONT[:60] and g.drafter_fallback and len(errors) == 1
    with pytest.raises(ConnectionError):
        v2 = ScriptedVerifier(1, CONT)
        run(v2, Dies(v2), [0], max_tokens=60, block_size=8)


def test_bad_arguments():
    v = ScriptedVerifier(1, CONT)
    for kwargs, msg in [({"block_size": 0}, "block_size"), ({"block_size": 17}, "block_size"), ({"max_tokens": 0}, "max_tokens")]:
        args = {"max_tokens": 5, "block_size": 4} | kwargs
        with pytest.raises(ValueError, match=msg):
            run(v, None, [0], **args)
    with pytest.raises(ValueError, match="empty"):
        run(v, None, [], 5, 4)


def test_the_acceptance_rule_keeps_the_leading_run_then_the_choice_after_it():
    assert accept([1, 2, 3], [1, 2, 3, 4]) == (3, 4)  # all accepted: the bonus
    assert accept([1, 9, 3], [1, 2, 3, 4]) == (1, 2)  # the correction at the first mismatch
    assert accept([], [5]) == (0, 5)  # a block of one: the next token alone
    assert accept([7, 8], [6, -1, -1]) == (0, 6)  # a sampling verify's choices end after its first rejection


def test_quality_gate_flags_runaways_only():
    assert find_runaway([7] * 8) is not None
    assert find_runaway([7] * 7) is None
    assert find_runaway(list(range(50)) + [3, 4, 5] * 8 + [1]).unit == (3, 4, 5)
    assert find_runaway(list(range(50)) + [3, 4, 5] * 7) is None
    # a varied sequence with many repeated tokens (like code indentation) is not a runaway
    varied = [1, 2, 1, 3, 1, 2, 1, 4] * 3 + list(range(10, 60))
    assert quality_report(varied) == {"degenerate": False}
    report = quality_report([5, 6] + [9, 8] * 10)
    assert report["degenerate"] and report["runaway"]["unit"] == [9, 8]
