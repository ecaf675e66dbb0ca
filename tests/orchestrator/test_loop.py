"""The accept/trim loop against scripted verifier/drafter sessions (no model)."""

import pytest

from kakeya.core.contract import Draft, Verdict, accept
from kakeya.core.generation import find_runaway, quality_report
from kakeya.orchestrator.decode.loop import Decode, DecodeOptions, alone, run
from kakeya.orchestrator.proposers import NGRAM, Proposal


class ScriptedVerifier:
    """A 'target' whose greedy continuation is a fixed sequence; tracks the committed length."""

    first_logprobs = None  # the contract's attribute: a scripted target has no distribution to report

    def __init__(self, prompt_len, continuation):
        self.cont = continuation
        self.pos = 0  # tokens of the continuation committed into the cache (the last one is not fed yet)
        self.prompt_len = prompt_len
        self.kept = []

    def prefill(self, prompt):
        assert len(prompt) == self.prompt_len
        return self.cont[0], list(range(len(prompt)))  # aux: one row per position, named by its position

    def prefill_steps(self, prompt, reuse=()):
        yield from ()
        return (*self.prefill(prompt), 0)

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
        kept = [self.prompt_len + self.pos + i for i in range(accepted + 1)]
        self.pos += accepted + 1
        self.kept.append(accepted + 1)
        return Verdict(accepted, next_token, kept)

    def stats(self):
        return {}

    def close(self):
        pass


class ScriptedDrafter:
    """Drafts the target's continuation, one candidate in ``wrong_every`` wrong. Its context is the aux rows it
    was handed."""

    def __init__(self, verifier, wrong_every=3):
        self.v, self.calls, self.wrong_every = verifier, 0, wrong_every
        self.context: list[int] = []

    def _take(self, new_aux):
        self.context += new_aux or []

    def draft(self, new_aux, last, B):
        self._take(new_aux)
        self.calls += 1
        good = self.v.cont[self.v.pos + 1 : self.v.pos + B]
        k = self.calls % self.wrong_every if self.wrong_every else -1
        return Draft([t if i != k else 999 for i, t in enumerate(good)])


CONT = list(range(100, 400))


def scripted_acceptance(B: int, max_tokens: int, wrong_every: int = 3) -> list[int]:
    """The tokens each block commits against ``ScriptedDrafter(wrong_every)``: its draft number c has its
    candidate c % wrong_every wrong, so c % wrong_every candidates are accepted (all B - 1 when that index is
    past them), plus the verifier's own token; the last block stops at ``max_tokens`` (the prefill made one)."""
    out, total, c = [], 1, 0
    while total < max_tokens:
        c += 1
        committed = min(c % wrong_every, B - 1) + 1
        out.append(min(committed, max_tokens - total))
        total += out[-1]
    return out


@pytest.mark.parametrize("B", [1, 2, 4, 8, 16])
def test_output_is_the_targets_sequence_and_max_tokens_cuts_mid_block(B):
    v = ScriptedVerifier(3, CONT)
    g = run(v, ScriptedDrafter(v), [1, 2, 3], max_tokens=37, block_size=B)
    assert g.token_ids == CONT[:37]
    assert g.finish_reason == "length"
    assert g.acceptance_lengths == scripted_acceptance(B, 37)  # block by block, the last one cut
    assert sum(g.acceptance_lengths) + 1 == 37


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


class Scripted:
    """A proposer that proposes the continuation's next ``n`` tokens (wrong from ``wrong_at`` on) every
    ``every``-th block, else nothing: the next proposer is asked."""

    def __init__(self, verifier, n, every, wrong_at=None):
        self.v, self.n, self.every, self.wrong_at, self.asked = verifier, n, every, wrong_at, 0

    def propose(self, state):
        self.asked += 1
        if self.asked % self.every:
            return None
        at = self.v.pos + 1
        good = self.v.cont[at : at + min(self.n, state.room - 1)]
        return Proposal(tuple(t if self.wrong_at is None or i < self.wrong_at else 999 for i, t in enumerate(good)),
                        NGRAM, "scripted")  # fmt: skip


@pytest.mark.parametrize("B", [2, 4, 8])
def test_proposers_are_asked_in_order_and_the_drafter_still_takes_every_aux_row_once(B):
    """A proposer's block goes to the verifier as the drafter's would (the same tokens committed); the drafter
    is asked only when no proposer had one, yet its context gets every committed position once, in order."""
    v = ScriptedVerifier(3, CONT)
    d = ScriptedDrafter(v, wrong_every=3)
    first, second = Scripted(v, 5, every=3, wrong_at=2), Scripted(v, 3, every=2)
    decode = Decode(v, d, [1, 2, 3], DecodeOptions(61, B))
    decode.proposers[:0] = [first, second]  # asked before the drafter
    blocks = list(alone(decode))
    g = decode.generation
    assert g.token_ids == CONT[:61] and first.asked == len(blocks) - 1
    copied = [b for b in blocks[1:] if b.copied]
    assert second.asked == first.asked - first.asked // 3  # asked only when the first had nothing
    assert copied and all(b.drafted <= 5 for b in copied)  # a proposer's block, not the drafter's size
    assert any(b.drafted == 5 and b.accepted == 2 for b in copied)  # the first's, wrong from its third candidate
    assert d.calls == len(blocks) - 1  # a proposer's block hands the drafter the new positions all the same
    assert d.context == list(range(len(d.context))) and len(d.context) >= 3 + 61 - 7  # all but the last block's


def test_a_block_names_its_proposal_and_why():
    v = ScriptedVerifier(1, CONT)
    decode = Decode(v, ScriptedDrafter(v, wrong_every=None), [0], DecodeOptions(10, 4))
    decode.proposers.insert(0, Scripted(v, 3, every=2))
    sources = []
    it = alone(decode)
    next(it)
    for _ in it:
        sources.append((decode.proposal.source, decode.proposal.why))
    assert sources[0] == ("drafter", "no other source: the drafter drafts 3") and sources[1] == ("ngram", "scripted")
    assert decode.generation.token_ids == CONT[:10]


def test_bad_arguments():
    v = ScriptedVerifier(1, CONT)
    for kwargs, msg in [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 17}, "block_size"),
        ({"max_tokens": 0}, "max_tokens"),
    ]:
        args = {"max_tokens": 5, "block_size": 4} | kwargs
        with pytest.raises(ValueError, match=msg):
            run(v, None, [0], **args)


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
