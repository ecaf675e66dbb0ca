"""Mixed arrivals, churn and regex bombs against a live deployment: what issue 58 found broken, as goals.

::

    python benchmarks/arrivals.py [--requests 24] [--gap-ms 50] [--churn-s 45] [--streams 8]
                                  [--bomb-s 20] [--bomb-streams 4] [--deployments split colocated]
                                  [--out benchmarks/results/arrivals.json]

On ``serve all`` (the split: verifier, drafter and orchestrator processes, torch on the CPU, the embedded
demo pair) with its OpenAI HTTP front:

* **staggered**: ``--requests`` chat requests started ``--gap-ms`` apart (new streams' first drafts land beside
  the running streams' ``DraftRound`` calls on the drafter: the mix that once crashed it);
* **churn**: ``--streams`` clients sending chat and completion requests back to back for ``--churn-s``, some
  streamed, a few cancelled after their first chunk.

Counted: answers that were not 200, generations that finished without their drafter (each answer's
``kakeya.drafter_fallback``, and the orchestrator's ``kakeya_ar_fallbacks_total``), and tracebacks in the
three processes' log. Goal: 0, 0, 0.

* **bomb** (each of ``--deployments``): ``--bomb-streams`` clients stream completions back to back for
  ``--bomb-s`` quiet, then as long again while another client sends regex bombs (``X{99999997}``, a fresh
  letter each time: seconds of llguidance lexer, then "too many expressions constructed"). Per stream
  request: its longest pause between two chunks. Reported: the bombs' statuses (goal: every one a 400
  naming ``guided_regex``) and the median and worst longest-pause, quiet and bombed (goal: bombed <= 2x quiet).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from hostile_internal import fallbacks
from load import serve_all, stop_serve_all
from record import write_result

TOPICS = ["a config parser", "a retry loop", "merging sorted lists", "a word counter", "an LRU cache",
          "walking a directory", "a table formatter", "validating emails"]  # fmt: skip


def post(base: str, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def streamed(base: str, body: dict, stop_after: int | None = None) -> tuple[int, list[float]]:
    """A streamed completion: its status and the arrival times of its chunks (``stop_after``: leave after so many)."""
    request = urllib.request.Request(base + "/v1/completions", json.dumps(body | {"stream": True}).encode(),
                                     {"content-type": "application/json"})  # fmt: skip
    times: list[float] = []
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            for line in r:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    times.append(time.perf_counter())
                    if stop_after is not None and len(times) >= stop_after:
                        break
            return r.status, times
    except urllib.error.HTTPError as exc:
        return exc.code, times


def chat(topic: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Write Python code for {topic}."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.n = self.failed = self.fallbacks = 0
        self.errors: list[str] = []

    def note(self, status: int, answer: dict) -> None:
        with self.lock:
            self.n += 1
            if status != 200:
                self.failed += 1
                if len(self.errors) < 5:
                    self.errors.append(f"{status}: {json.dumps(answer)[:200]}")
            elif answer.get("kakeya", {}).get("drafter_fallback"):
                self.fallbacks += 1

    def result(self) -> dict:
        return {"requests": self.n, "not_200": self.failed, "drafter_fallbacks_seen": self.fallbacks,
                "errors": self.errors}  # fmt: skip


def staggered(base: str, n: int, gap_s: float) -> dict:
    counts = Counts()

    def one(i: int) -> None:
        counts.note(*post(base, "/v1/chat/completions", chat(TOPICS[i % len(TOPICS)], 24 + 8 * (i % 4))))

    threads = []
    for i in range(n):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        time.sleep(gap_s)
    for t in threads:
        t.join()
    return counts.result()


def churn(base: str, streams: int, seconds: float) -> dict:
    counts, stop, cancelled = Counts(), time.monotonic() + seconds, [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            topic, r = rng.choice(TOPICS), rng.random()
            if r < 0.15:  # a client that leaves after its first chunk
                streamed(base, {"prompt": f"# {topic}\ndef ", "max_tokens": 48, "ignore_eos": True}, stop_after=1)
                cancelled[0] += 1
            elif r < 0.5:
                counts.note(*post(base, "/v1/completions",
                                  {"prompt": f"# {topic}\ndef ", "max_tokens": rng.randint(8, 48), "ignore_eos": True}))  # fmt: skip
            else:
                counts.note(*post(base, "/v1/chat/completions", chat(topic, rng.randint(8, 48))))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts.result() | {"cancelled_after_first_chunk": cancelled[0]}


def pauses(base: str, streams: int, seconds: float, bombs: bool, letters) -> dict:
    """Each stream request's longest pause between chunks while ``streams`` clients stream for ``seconds``
    (and, with ``bombs``, another client sends regex bombs back to back)."""
    stop, longest, bomb_answers, lock = time.monotonic() + seconds, [], [], threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            body = {"prompt": f"# {rng.choice(TOPICS)}\ndef ", "max_tokens": 64, "ignore_eos": True}
            status, times = streamed(base, body)
            if status == 200 and len(times) > 2:
                with lock:
                    longest.append(max(b - a for a, b in itertools.pairwise(times[1:])))  # after the first chunk

    def bomber() -> None:
        while time.monotonic() < stop:
            regex = f"{next(letters)}{{99999997}}"
            t0 = time.perf_counter()
            status, answer = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": regex})
            error = answer.get("error", {})
            bomb_answers.append({"status": status, "param": error.get("param"), "seconds": time.perf_counter() - t0,
                                 "message": error.get("message", "")[:120]})  # fmt: skip

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    if bombs:
        threads.append(threading.Thread(target=bomber))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"stream_requests": len(longest), "longest_pause_median_s": statistics.median(longest) if longest else None,
           "longest_pause_max_s": max(longest) if longest else None}  # fmt: skip
    if bombs:
        out["bombs"] = len(bomb_answers)
        out["bombs_400_naming_guided_regex"] = sum(
            a["status"] == 400 and a["param"] == "guided_regex" for a in bomb_answers
        )
        out["bomb_answers"] = bomb_answers[:6]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--gap-ms", type=float, default=50.0)
    p.add_argument("--churn-s", type=float, default=45.0)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--bomb-s", type=float, default=20.0)
    p.add_argument("--bomb-streams", type=int, default=4)
    p.add_argument("--deployments", nargs="*", default=["split", "colocated"], choices=["split", "colocated"])
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/arrivals.json"))
    args = p.parse_args(argv)
    out: dict = {"pair": "embedded demo pair, torch on the CPU", "args": vars(args)}
    letters = iter(f"{a}{b}" for a, b in itertools.product("bcdefghijklmnopqrstuvwxyz", repeat=2))
    with tempfile.TemporaryDirectory(prefix="kakeya-arrivals-") as tmp:
        for name in ["split", *[d for d in args.deployments if d != "split"]]:
            role, extra = ("all", ["--verifier-backend", "torch", "--drafter-backend", "torch"]) if name == "split" \
                else ("orchestrator", ["--backend", "torch"])  # fmt: skip
            metrics_port = free_port()
            proc, info = serve_all(Path(tmp), ["--max-sessions", "64", "--http-port", "0", "--metrics-port",
                                               str(metrics_port), *extra], args.start_timeout, name, role)  # fmt: skip
            base = f"http://127.0.0.1:{info['http_port']}"
            result: dict = {}
            try:
                if name == "split":
                    before = fallbacks(metrics_port)
                    result["staggered"] = staggered(base, args.requests, args.gap_ms / 1000)
                    print("staggered", result["staggered"], flush=True)
                    if args.churn_s > 0:
                        result["churn"] = churn(base, args.streams, args.churn_s)
                        print("churn", result["churn"], flush=True)
                    after = fallbacks(metrics_port)
                    result["ar_fallbacks_total"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                if name in args.deployments and args.bomb_s > 0:
                    result["quiet"] = pauses(base, args.bomb_streams, args.bomb_s, False, letters)
                    result["bombed"] = pauses(base, args.bomb_streams, args.bomb_s, True, letters)
                    q, b = result["quiet"]["longest_pause_median_s"], result["bombed"]["longest_pause_median_s"]
                    result["bombed_over_quiet_median"] = b / q if q and b else None
                    print(name, "quiet", result["quiet"], flush=True)
                    print(
                        name, "bombed", {k: v for k, v in result["bombed"].items() if k != "bomb_answers"}, flush=True
                    )
            finally:
                stop_serve_all(proc)
            log = (Path(tmp) / f"serve-{name}.log").read_text(errors="replace")
            result["tracebacks_in_logs"] = log.count("Traceback")
            out[name] = result
    path = write_result(args.out, out)
    print(f"wrote {path}")
    split = out.get("split", {})
    bad = split.get("tracebacks_in_logs", 0) + sum(split.get("ar_fallbacks_total", {}).values())
    bad += sum(split.get(k, {}).get("not_200", 0) + split.get(k, {}).get("drafter_fallbacks_seen", 0)
               for k in ("staggered", "churn"))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
