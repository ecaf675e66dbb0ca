"""Batch-mates never fail each other, under load for a minute: the OpenAI client cancelling, deadlines expiring.

For each deployment (a colocated server and the split, each its own process on loopback with its OpenAI
HTTP front), ``--streams`` client threads send requests back to back for ``--seconds``. Each request is
greedy or seeded sampling (half each), over one of a few prompts, and one of:

* cancelled (``--cancel``, 20 %): streamed through the official ``openai`` client, which closes its
  stream after 1-4 chunks -- the pattern that once failed other clients' requests with "verifier failed";
* given a deadline (``--deadline``, 10 %): a gRPC ``Generate`` with a 50-ms deadline, which expires
  mid-generation (or before the first token);
* left alone (the rest): streamed through the ``openai`` client to its end, its text compared with the
  same request's text when it ran alone before the load (the reference).

Reported per deployment: how many of each kind ran, how many of the left-alone ones failed (any error,
any status but 200) and how many differ from their reference -- the goal is zero and zero -- and the
first few failures. ``benchmarks/results/isolation.json``.

    python benchmarks/isolation.py                      # both deployments, 8 streams, 60 s each
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpc
from concurrency import ROLES, TOPICS
from load import serve_all, stop_serve_all

from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import generate_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

PROMPTS = [f"# {topic}\ndef " for topic in TOPICS[:6]]
MODES = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 7}}


def http_text(client, prompt: str, mode: str, max_tokens: int, cancel_after: int | None = None) -> str | None:
    """The streamed completion's text through the openai client (None: cancelled after ``cancel_after`` chunks)."""
    stream = client.completions.create(
        model=client.served, prompt=prompt, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
        **MODES[mode],
    )  # fmt: skip
    text, finish, i = [], [], -1
    for i, chunk in enumerate(stream):
        text.extend(c.text for c in chunk.choices)
        finish.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
        if cancel_after is not None and i + 1 >= cancel_after:
            stream.close()  # what the openai client does when its caller stops reading
            return None
    return Streamed("".join(text), finish[-1] if finish else None, i + 1)


class Streamed(str):
    """A streamed completion's text, with its finish reason and chunk count (what a difference is reported with)."""

    def __new__(cls, text: str, finish_reason: str | None, chunks: int):
        out = super().__new__(cls, text)
        out.finish_reason, out.chunks = finish_reason, chunks
        return out


def difference(text: Streamed, ref: str) -> str:
    """Where ``text`` leaves ``ref``: the common prefix's length and both tails, with how ``text`` ended."""
    k = next((i for i, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    return (
        f"{len(text)} vs {len(ref)} chars, same for {k}; then {text[k : k + 40]!r} vs {ref[k : k + 40]!r}"
        f" (finish_reason {text.finish_reason}, {text.chunks} chunks)"
    )


def grpc_deadline(stub, prompt: str, mode: str, max_tokens: int, deadline_s: float) -> str:
    """A gRPC generation given ``deadline_s``: how it ended ("deadline", or "completed" if it was fast enough)."""
    p = MODES[mode]
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=p["temperature"])
    if "seed" in p:
        sampling.seed, sampling.top_p = p["seed"], p["top_p"]
    try:
        for _ in stub.Generate(pb.GenerateRequest(text=prompt, sampling_params=sampling), timeout=deadline_s):
            pass
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "deadline"
        raise
    return "completed"


def run(client, stub, refs: dict, args) -> dict:
    counts = {"alone_ok": 0, "alone_failed": 0, "alone_different": 0, "cancelled": 0, "deadline": 0,
              "deadline_completed": 0, "cancel_or_deadline_errors": 0}  # fmt: skip
    failures: list[str] = []
    lock, stop = threading.Lock(), time.monotonic() + args.seconds

    def note(key: str, why: str = "") -> None:
        with lock:
            counts[key] += 1
            if why and len(failures) < 10:
                failures.append(why[:300])

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            prompt, mode, r = rng.choice(PROMPTS), rng.choice(list(MODES)), rng.random()
            try:
                if r < args.cancel:
                    http_text(client, prompt, mode, args.max_tokens, cancel_after=rng.randint(1, 4))
                    note("cancelled")
                elif r < args.cancel + args.deadline:
                    note("deadline" if grpc_deadline(stub, prompt, mode, args.max_tokens, 0.05) == "deadline"
                         else "deadline_completed")  # fmt: skip
                else:
                    text = http_text(client, prompt, mode, args.max_tokens)
                    if text == refs[(prompt, mode)]:
                        note("alone_ok")
                    else:
                        note("alone_different", f"{mode} {prompt!r}: {difference(text, refs[(prompt, mode)])}")
            except Exception as exc:  # noqa: BLE001 - counted: a left-alone request must never fail
                kind = "alone_failed" if r >= args.cancel + args.deadline else "cancel_or_deadline_errors"
                note(kind, f"{kind}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {**counts, "failures": failures}


def main(argv=None) -> int:
    from openai import OpenAI

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployments", nargs="+", default=["colocated-torch", "split"], choices=list(ROLES))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cancel", type=float, default=0.2, help="share of requests the client cancels mid-stream")
    p.add_argument("--deadline", type=float, default=0.1, help="share of requests given a 50-ms deadline")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/isolation.json"))
    args = p.parse_args(argv)
    out = {
        "command": " ".join(["python", "benchmarks/isolation.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "pair": "embedded demo pair",
        "streams": args.streams, "seconds": args.seconds, "max_tokens": args.max_tokens,
        "cancel_share": args.cancel, "deadline_share": args.deadline,
        "deployments": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kakeya-isolation-") as tmp:
        for name in args.deployments:
            role, role_args = ROLES[name]
            proc, info = serve_all(
                Path(tmp), ["--max-sessions", "64", "--http-port", "0", *role_args], args.start_timeout, name, role
            )
            try:
                client = OpenAI(base_url=f"http://127.0.0.1:{info['http_port']}/v1", api_key="none", max_retries=0)
                client.served = client.models.list().data[0].id
                stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(info["addr"]))
                refs = {(q, m): http_text(client, q, m, args.max_tokens) for q in PROMPTS for m in MODES}
                result = run(client, stub, refs, args)
            finally:
                stop_serve_all(proc)
            out["deployments"][name] = result
            shown = {k: v for k, v in result.items() if k != "failures"}
            print(f"{name}: {shown}", flush=True)
            for f in result["failures"]:
                print(f"  {f}", flush=True)
    write_result(args.out, out)
    print(f"wrote {args.out}")
    bad = sum(r["alone_failed"] + r["alone_different"] for r in out["deployments"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
