"""What the gRPC split costs: bytes on the wire per block, latency added per block, decode tok/s.

Starts ``kakeya serve verifier`` and ``kakeya serve drafter`` (and, for the
public-API figure, ``kakeya serve orchestrator``) as separate processes on
loopback, then runs the same greedy generations

- colocated: verifier and drafter in this process (``build_local_engine``);
- split: the same loop in this process, verifier and drafter reached through
  ``GrpcVerifier`` / ``GrpcDrafter`` (two round trips per block: draft, and
  verify, which commits);
- api: through the orchestrator process's Generate RPC (decode tok/s as the
  server reports it).

Per block it records the serialized size of every request and response
(``Message.ByteSize()``: protobuf payload, without gRPC's 5-byte frame prefix
and HTTP/2 framing), the client-observed time of each call and the server's
own ``elapsed_s`` for it: client time minus server time is the network hop
(serialization, loopback, gRPC), independent of how fast the model is.
Medians over ``--repeats`` runs after one warm-up run each.

    python benchmarks/wire.py                       # embedded tiny pair
    python benchmarks/wire.py --target T --draft D --block-sizes 4 8 16

Writes benchmarks/results/wire.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kakeya.core.contract import WireStats
from kakeya.orchestrator.decode import loop
from kakeya.orchestrator.remote.drafter import GrpcDrafter
from kakeya.orchestrator.remote.verifier import GrpcVerifier
from kakeya.wire import codec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def med(xs):
    return statistics.median(xs) if xs else 0.0


# --------------------------------------------------------------------------- processes


def _exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, a runner's limit) ends this process through SystemExit, so the callers'
    ``finally: stop(procs)`` stops the servers: they run in sessions of their own and would outlive it
    (one that did on a GPU node slowed every run after it)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def start(role: str, argv: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    _exit_on_sigterm()
    ready = tmp / f"{role}.json"
    with open(tmp / f"{role}.log", "wb") as log:  # the child holds its own copy of the descriptor
        p = subprocess.Popen(
            [sys.executable, "-m", "kakeya.app.main", "serve", role, *argv, "--port", "0", "--ready-file", str(ready)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 300
    while not ready.is_file():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise SystemExit(f"{role} did not start:\n{(tmp / f'{role}.log').read_text()[-3000:]}")
        time.sleep(0.05)
    return p, json.loads(ready.read_text())["addr"]


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


# --------------------------------------------------------------------------- recording sessions


class Recorded:
    """Wraps a remote session: per call, client time, server time and bytes each way."""

    def __init__(self, inner, kind: str, log: list):
        self.inner, self.kind, self.log = inner, kind, log

    def _call(self, step, fn, *args):
        s0 = self.inner.stats().wire or WireStats()
        t0 = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t0
        s1 = self.inner.stats().wire
        self.log.append(
            {
                "step": step,
                "client_s": dt,
                "server_s": s1.server_s - s0.server_s,
                "sent": s1.bytes_sent - s0.bytes_sent,
                "received": s1.bytes_received - s0.bytes_received,
            }
        )
        return out

    # VerifierSession
    @property
    def first_logprobs(self):
        return self.inner.first_logprobs

    def prefill(self, ids):
        return self._call("prefill", self.inner.prefill, ids)

    def decide(self, last, draft):
        return self._call("verify", self.inner.decide, last, draft)

    # DrafterSession
    def draft(self, aux, last, b):
        return self._call("draft", self.inner.draft, aux, last, b)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def run_split(verifier, drafter, prompt, max_tokens, block_size):
    log: list = []
    vs = Recorded(verifier.open_session(), "verifier", log)
    ds = Recorded(drafter.open_session(), "drafter", log)
    try:
        gen = loop.run(vs, ds, prompt, max_tokens, block_size, ngram=True)  # as the engine runs by default
    finally:
        vs.close()
        ds.close()
    return gen, log


def per_block(log):
    """Group the call log into blocks (draft, verify); prefill separately."""
    prefill = [c for c in log if c["step"] == "prefill"]
    blocks, cur = [], []
    for c in log:
        if c["step"] == "prefill":
            continue
        cur.append(c)
        if c["step"] == "verify":
            blocks.append(cur)
            cur = []
    return prefill, blocks


# --------------------------------------------------------------------------- measurement


def measure_block_size(local, verifier, drafter, prompt, args, block_size):
    from kakeya.orchestrator.decode.engine import Request

    req = Request(prompt, max_tokens=args.max_tokens, block_size=block_size, ignore_eos=True)
    local.generate(req)  # warm-up
    run_split(verifier, drafter, prompt, args.max_tokens, block_size)  # warm-up
    co_tok_s, sp_tok_s, co_block, sp_block, hop, hop_steps = [], [], [], [], [], {"draft": [], "verify": []}
    sent, received, accept, kept = [], [], [], []
    prefill_bytes = []
    identical = True
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both alike
        co = local.generate(req)
        sp, log = run_split(verifier, drafter, prompt, args.max_tokens, block_size)
        identical &= co.token_ids == sp.token_ids
        co_tok_s.append(co.decode_tok_s)
        sp_tok_s.append(sp.decode_tok_s)
        co_block += [b.total_s for b in co.blocks[1:]]
        sp_block += [b.total_s for b in sp.blocks[1:]]
        accept.append(sp.mean_acceptance)
        pre, blocks = per_block(log)
        prefill_bytes += [c["sent"] + c["received"] for c in pre]
        for calls, b in zip(blocks, sp.blocks[1:]):
            hop.append(sum(c["client_s"] - c["server_s"] for c in calls))
            for c in calls:
                hop_steps[c["step"]].append(c["client_s"] - c["server_s"])
            sent.append(sum(c["sent"] for c in calls))
            received.append(sum(c["received"] for c in calls))
            kept.append(len(b.tokens))
    per_block_bytes = [s + r for s, r in zip(sent, received)]
    return {
        "block_size": block_size,
        "blocks_measured": len(sp_block),
        "mean_acceptance": round(statistics.mean(accept), 3),
        "output_identical": identical,
        "bytes_per_block": {
            "median_total": med(per_block_bytes),
            "median_request": med(sent),
            "median_response": med(received),
            "max_total": max(per_block_bytes),
            "per_committed_token_median": round(med([b / k for b, k in zip(per_block_bytes, kept)]), 1),
        },
        "prefill_bytes_median": med(prefill_bytes),
        "block_ms_median": {
            "colocated": round(med(co_block) * 1e3, 3),
            "split": round(med(sp_block) * 1e3, 3),
            "added_by_split": round((med(sp_block) - med(co_block)) * 1e3, 3),
        },
        "network_hop_ms_per_block_median": round(med(hop) * 1e3, 3),
        "network_hop_ms_per_call_median": {k: round(med(v) * 1e3, 3) for k, v in hop_steps.items()},
        "decode_tok_s_median": {
            "colocated": round(med(co_tok_s), 2),
            "split": round(med(sp_tok_s), 2),
            "split_over_colocated": round(med(sp_tok_s) / med(co_tok_s), 4) if med(co_tok_s) else 0.0,
        },
    }


def measure_api(addr, prompt, args, block_size):
    import grpc

    from kakeya.wire.kakeya.v1 import generate_pb2 as pb
    from kakeya.wire.kakeya.v1 import generate_pb2_grpc
    from kakeya.wire.limits import channel_options

    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(addr, options=channel_options()))
    req = pb.GenerateRequest(
        tokenized=pb.TokenIds(ids=prompt),
        sampling_params=pb.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
        block_size=block_size,
    )

    def once():
        t0 = time.perf_counter()
        complete = None
        n_bytes = 0
        for r in stub.Generate(req, timeout=600):
            n_bytes += r.ByteSize()
            if r.HasField("complete"):
                complete = r.complete
        return complete, time.perf_counter() - t0, n_bytes

    once()
    runs = [once() for _ in range(args.repeats)]
    return {
        "block_size": block_size,
        "decode_tok_s_median": round(med([c.stats.decode_tok_s for c, _, _ in runs]), 2),
        "end_to_end_s_median": round(med([t for _, t, _ in runs]), 4),
        "response_bytes_per_token_median": round(med([b / c.completion_tokens for c, _, b in runs]), 1),
    }


def unary_rtt_ms(verifier, n=200):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        verifier.get_info()
        ts.append(time.perf_counter() - t0)
    return round(med(ts) * 1e3, 4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", default="import os\nimport sys\n\ndef main(argv):\n    ")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wire.json"))
    args = ap.parse_args(argv)

    from kakeya.orchestrator.assembly import build_local_engine

    local = build_local_engine(args.target, args.draft)
    pair = ["--target", local.target, "--draft", local.draft]
    prompt = local.codec.encode(args.prompt)
    procs = []
    with tempfile.TemporaryDirectory(prefix="kakeya-wire-") as tmp:
        tmp = Path(tmp)
        try:
            vp, vaddr = start("verifier", pair, tmp)
            procs.append(vp)
            dp, daddr = start("drafter", pair, tmp)
            procs.append(dp)
            op, oaddr = start("orchestrator", ["--verifier", vaddr, "--drafter", daddr], tmp)
            procs.append(op)
            drafter = GrpcDrafter(daddr)
            verifier = GrpcVerifier(vaddr, aux_layers=drafter.target_layer_ids)
            rtt = unary_rtt_ms(verifier)
            results = [measure_block_size(local, verifier, drafter, prompt, args, b) for b in args.block_sizes]
            api = [measure_api(oaddr, prompt, args, b) for b in args.block_sizes]
            aux = verifier.remote
        finally:
            stop(procs)

    out = {
        "benchmark": "wire",
        "target": local.target,
        "draft": local.draft,
        "prompt_tokens": len(prompt),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "aux": {
            "layers": list(aux.target_layer_ids),
            "hidden_size": aux.hidden_size,
            "dtype": codec.dtype_name(aux.aux_dtype),
            "bytes_per_position": len(aux.target_layer_ids)
            * aux.hidden_size
            * ITEMSIZE[codec.dtype_name(aux.aux_dtype)],
        },
        "loopback_unary_rtt_ms_median": rtt,
        "split_vs_colocated": results,
        "public_api": api,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "notes": (
            "Loopback, all processes on one machine sharing its cores (verifier, drafter, client). "
            "bytes = protobuf payload (Message.ByteSize) of every request and response of a block: "
            "draft (aux of the rows committed last block + ids), verify (block ids; answered with the verdict and the aux of kept rows); "
            "never logits. network_hop = client-observed call time minus the server's own elapsed_s. "
            "The tiny pair's drafter is random: acceptance ~1, so each block commits ~1 token; bytes scale with "
            "committed rows x aux bytes_per_position."
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
