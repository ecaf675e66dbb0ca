"""The accept/trim loop against scripted verifier/drafter sessions (no model)."""

import pytest

from kakeya.core.contract import Draft, Predrafts, Verdict, accept
from kakeya.core.quality import find_runaway, quality_report
from kakeya.orchestrator.decode.loop import run


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
    """Drafts the target's continuation, one candidate in ``wrong_every`` wrong; its pre-drafts guess
    the next token wrong every ``wrong_guess_every``-th time. Its context is the aux rows it was handed."""

    def __init__(self, verifier, wrong_every=3, wrong_guess_every=None):
        self.v, self.calls, self.wrong_every, self.wrong_guess_every = verifier, 0, wrong_every, wrong_guess_every
        self.context: list[int] = []
        self.predrafts = 0

    def _take(self, new_aux):
        self.context += new_aux or []

    def draft(self, new_aux, last, B):
        self._take(new_aux)
        self.calls += 1
        good = self.v.cont[self.v.pos + 1 : self.v.pos + B]
        k = self.calls % self.wrong_every if self.wrong_every else -1
        return Draft([t if i != k else 999 for i, t in enumerate(good)])

    def predraft(self, new_aux, block_ids, B, alternatives=0):
        self._take(new_aux)
        self.predrafts += 1
        at = self.v.pos + len(block_ids)  # where the next block opens if all of block_ids is accepted
        guess, *good = self.v.cont[at : at + B]
        if self.wrong_guess_every and self.predrafts % self.wrong_guess_every == 0:
            guess = 998
        k = self.predrafts % self.wrong_every if self.wrong_every else -1
        blocks = {(len(block_ids) - 1, guess): tuple(t if i != k else 999 for i, t in enumerate(good))}
        if alternatives:  # its next likeliest token at a wrong candidate is the right one (a rejection there)
            for n, c in enumerate(block_ids[1:]):
                right = self.v.cont[self.v.pos + n + 1]
                if c != right:
                    blocks[(n, right)] = tuple(self.v.cont[self.v.pos + n + 2 : self.v.pos + n + 1 + B])
        return lambda: Predrafts(blocks)


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


@pytest.mark.parametrize("B", [2, 4, 8, 16])
@pytest.mark.parametrize("wrong_every, wrong_guess_every", [(None, None), (None, 2), (3, None), (2, 3)])
def test_predrafting_commits_the_same_tokens_and_hands_every_aux_row_over_once(B, wrong_every, wrong_guess_every):
    v = ScriptedVerifier(3, CONT)
    d = ScriptedDrafter(v, wrong_every, wrong_guess_every)
    g = run(v, d, [1, 2, 3], max_tokens=61, block_size=B, predraft=True)
    assert g.token_ids == CONT[:61] and g.finish_reason == "length"
    used = [b for b in g.blocks[1:] if b.predrafted]
    assert g.predrafts == d.predrafts and len(used) <= g.predrafts
    if wrong_every is None and wrong_guess_every is None:  # every guess right: the drafter drafts only the first block
        assert d.calls == 1 and len(used) == len(g.blocks) - 2
    for before, block in zip(g.blocks[1:], g.blocks[2:]):
        if block.predrafted:  # only after a block accepted in full, with the next token guessed
            assert before.accepted == before.drafted and block.tokens[0] == before.tokens[-1] + 1
    if wrong_every is not None or wrong_guess_every is not None:
        assert len(used) < len(g.blocks) - 2
    if wrong_every is None and wrong_guess_every is not None:  # every other guess right: half the pre-drafts used
        assert 0 < len(used)
    # the context the drafter was handed: every committed position once, in order, none skipped
    assert d.context == list(range(len(d.context))) and len(d.context) >= 3 + 61 - B - 1


@pytest.mark.parametrize("B", [2, 4, 8, 16])
def test_predrafts_prepared_for_rejections_are_used_when_the_verdict_names_them(B):
    v = ScriptedVerifier(3, CONT)
    d = ScriptedDrafter(v, wrong_every=3)  # one candidate in three wrong: most blocks end in a rejection
    g = run(v, d, [1, 2, 3], max_tokens=61, block_size=B, predraft=True, alternatives=2)
    assert g.token_ids == CONT[:61]
    after_rejection = [b for a, b in zip(g.blocks[1:], g.blocks[2:]) if b.predrafted and a.accepted < a.drafted]
    assert after_rejection  # the block after a rejection opened with the pre-draft prepared for it
    assert d.context == list(range(len(d.context)))  # every committed position handed over once, in order
    v2 = ScriptedVerifier(3, CONT)
    plain = run(v2, ScriptedDrafter(v2, wrong_every=3), [1, 2, 3], max_tokens=61, block_size=B, predraft=True)
    assert sum(b.predrafted for b in g.blocks) > sum(b.predrafted for b in plain.blocks)


def test_a_predraft_used_near_max_tokens_is_cut_to_the_room_left():
    v = ScriptedVerifier(1, CONT)
    g = run(v, ScriptedDrafter(v, wrong_every=None), [0], max_tokens=20, block_size=8, predraft=True)
    assert g.token_ids == CONT[:20] and g.acceptance_lengths == [8, 8, 3]
    assert [b.predrafted for b in g.blocks[1:]] == [False, True, True]


def test_a_failing_predraft_falls_back_to_the_verifier_alone():
    for where in ("post", "result"):
        v = ScriptedVerifier(1, CONT)

        class Dies(ScriptedDrafter):
            def predraft(self, new_aux, block_ids, B, alternatives=0, where=where):
                if self.predrafts == 2:
                    if where == "post":
                        raise ConnectionError("drafter gone")
                    return lambda: (_ for _ in ()).throw(ConnectionError("drafter gone"))
                return super().predraft(new_aux, block_ids, B)

        errors = []
        g = run(
            v,
            Dies(v, wrong_every=None),
            [0],
            max_tokens=60,
            block_size=8,
            on_drafter_error=errors.append,
            predraft=True,
        )
        assert g.token_ids == CONT[:60] and g.drafter_fallback and len(errors) == 1, where
        assert all(b.drafted == 0 for b in g.blocks[4:])  # the verifier alone from then on


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
