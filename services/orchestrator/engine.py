"""An orchestrator engine: a verifier, a drafter and a tokenizer behind one generate call.

Shared by the CLI and the public gRPC server, so both report the same stats.
Which verifier/drafter it holds (in-process MLX, in-process torch, remote
gRPC) is decided by whoever builds it; the engine never looks.
"""

from __future__ import annotations

import threading
from typing import Iterator

from kakeya.core.contract import Drafter, Request, Verifier
from kakeya.orchestrator import loop
from kakeya.orchestrator.adaptive import AdaptivePolicy, BlockSizer, measure_costs
from kakeya.orchestrator.quality import quality_report
from kakeya.orchestrator.text import StreamDecoder, TextCodec


class Engine:
    def __init__(self, verifier: Verifier, drafter: Drafter | None, codec: TextCodec, target: str = "", draft: str = ""):
        self.verifier, self.drafter, self.codec = verifier, drafter, codec
        self.target, self.draft = target, draft
        self.adaptive: AdaptivePolicy | None = None  # measured on the first request that asks for it
        self._calibrating = threading.Lock()

    @property
    def default_block_size(self) -> int:
        """The drafter's trained block size (what ``ModelInfo`` reports; requests default to auto)."""
        return self.drafter.block_size if self.drafter is not None else 1

    def max_block_size(self, policy=None) -> int:
        """The largest block a session under ``policy`` can verify and roll back exactly."""
        if self.drafter is None:
            return 1
        if policy is None:
            return loop.MAX_BLOCK_SIZE
        resolved = policy.resolve(self.verifier.info.sliding_window)
        return min(loop.MAX_BLOCK_SIZE, resolved.slack, resolved.window if resolved.restore else loop.MAX_BLOCK_SIZE)

    def calibrate(self) -> AdaptivePolicy:
        """Measure the cost of a block at each size on this engine's endpoints (once)."""
        with self._calibrating:
            if self.adaptive is None:
                sizes = (1, 2, 4, 8, 16) if self.drafter is not None else (1,)
                costs = measure_costs(self.verifier, self.drafter, sizes)
                self.adaptive = AdaptivePolicy(costs, initial=self.default_block_size)
        return self.adaptive

    def block_policy(self, req: Request) -> "int | BlockSizer":
        """A fixed size, or for ``block_size`` 0 (auto) a sizer primed with what this engine has seen."""
        if req.block_size or self.drafter is None:
            return req.block_size or 1
        sizer = self.calibrate().sizer()
        sizer.max_size = self.max_block_size(req.cache_policy)
        return sizer

    def validate(self, req: Request) -> None:
        """Raise ValueError naming the offending field."""
        if not req.prompt_ids:
            raise ValueError("prompt: empty prompt")
        vocab = self.verifier.info.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {req.max_tokens}")
        req.sampling.check()
        if req.block_size == 0:
            return  # auto: sized within the policy's limits (``max_block_size``)
        block_size = req.block_size
        loop.check_block_size(block_size)
        policy = req.cache_policy
        if policy is not None:
            resolved = policy.resolve(self.verifier.info.sliding_window)
            if block_size > resolved.slack:
                raise ValueError(f"block_size {block_size} exceeds the cache policy's rollback slack {resolved.slack}")
            if resolved.restore and block_size > resolved.window:
                raise ValueError(f"block_size {block_size} exceeds the restoring window {resolved.window}")

    def stream(self, req: Request, on_drafter_error=None) -> Iterator[loop.Block]:
        """Yield committed blocks; returns the finished :class:`loop.Generation`."""
        self.validate(req)
        stop = set(req.stop_ids)
        if not req.ignore_eos:
            stop |= set(self.verifier.info.eos_token_ids)
        block_size = self.block_policy(req)
        policy = req.cache_policy
        sampling = req.sampling.seeded()  # one seed for both sessions' streams, reported back
        vsession = self.verifier.open_session(policy, sampling)
        speculate = self.drafter is not None and not (isinstance(block_size, int) and block_size == 1)
        dsession = self.drafter.open_session(sampling) if speculate else None
        try:
            decoding = loop.Decoding(vsession, dsession, req.prompt_ids, req.max_tokens, block_size, stop, on_drafter_error)
            yield from decoding
            gen = decoding.generation
            gen.verifier_stats = vsession.stats()
            gen.sampling = sampling
            if isinstance(block_size, BlockSizer):
                self.adaptive.learn(block_size)
            return gen
        finally:
            vsession.close()
            if dsession is not None:
                dsession.close()

    def generate(self, req: Request) -> loop.Generation:
        return loop.drive(self.stream(req))

    def report(self, req: Request, gen: loop.Generation) -> dict:
        """The stats every front end prints (CLI --json, the Generate API's final message)."""
        kv = gen.verifier_stats.get("kv_bytes", {})
        return {
            "target": self.target,
            "draft": self.draft,
            "backend": self.verifier.info.backend,
            "block_size": req.block_size,  # 0: auto, sized block by block
            "block_sizes": [b.drafted + 1 for b in gen.blocks[1:]],
            "prompt_token_ids": gen.prompt_ids,
            "token_ids": gen.token_ids,
            "text": self.codec.decode(gen.token_ids),
            "finish_reason": gen.finish_reason,
            "acceptance_lengths": gen.acceptance_lengths,
            "mean_acceptance": round(gen.mean_acceptance, 4),
            "decode_tok_s": round(gen.decode_tok_s, 3),
            "prefill_s": round(gen.prefill_s, 6),
            "drafter_fallback": gen.drafter_fallback,
            "verifier_kv_bytes": {"sliding": kv.get("sliding", 0), "full": kv.get("full", 0)}
            | ({"restored": kv["restored"]} if "restored" in kv else {}),
            "cache_policy": gen.verifier_stats.get("cache_policy", ""),
            "cache_bounded": gen.verifier_stats.get("bounded", False),
            "quality": quality_report(gen.token_ids),
            "sampling": sampling_report(gen.sampling),
            "seed": gen.sampling.seed,
        }


def sampling_report(s) -> dict:
    """What ran, as JSON reports show it (``temperature`` 0: greedy)."""
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p}


def stream_text(codec: TextCodec, blocks: Iterator[loop.Block]) -> Iterator[tuple[list[int], str]]:
    """Pair each block's tokens with the text they complete; returns what ``blocks`` returns."""
    dec = StreamDecoder(codec)
    while True:
        try:
            block = next(blocks)
        except StopIteration as done:
            return done.value
        yield block.tokens, dec.add(block.tokens)
