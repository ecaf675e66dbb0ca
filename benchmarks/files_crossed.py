"""How many of services/' files a request crosses: one greedy block, and one streamed HTTP chat request.

    python benchmarks/files_crossed.py            # the demo pair, torch, colocated

What a newcomer reads to follow a request is every file whose functions run for it. This counts them:
a profile hook on every thread records the source file of each Python function called while the
measured span runs, and keeps those under ``services/``. The spans:

- **one greedy block**: ``next()`` on a colocated run of README command 1's prompt, block 8, after the
  prefill and a first block (the engine's caches, sizer and scheduler already made), on the calling thread;
- **a streamed chat request**: ``POST /v1/chat/completions`` with ``stream: true`` and 16 tokens against the
  orchestrator's HTTP front in this process (the colocated server's objects, as ``serve orchestrator`` builds
  them), after one warm-up request, on every thread it touches (the HTTP server's, the compute thread).

It also records the house's size (issue 57's other goals): the hand-written lines of ``services/`` (every
``.py`` but protoc's stubs under ``services/wire/kakeya/``, as ``wc -l`` counts them) and the most modules one
folder holds at its top level.

Writes ``benchmarks/results/files_crossed.json`` (``--out``): the counts and the files, by room.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
from pathlib import Path

from record import write_result

ROOT = Path(__file__).resolve().parents[1]
SERVICES = str(ROOT / "services") + "/"
OUT = ROOT / "benchmarks" / "results" / "files_crossed.json"
PROMPT = "def fibonacci(n):"


class Recorder:
    """A profile hook for every thread started after it: the files of the functions called while ``on``."""

    def __init__(self):
        self.on, self.files = False, set()

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(SERVICES):
                self.files.add(name[len(SERVICES) :])

    def install(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)

    def measure(self, fn) -> list[str]:
        self.files = set()
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return sorted(self.files)


def one_block(rec: Recorder, target: str, draft: str) -> list[str]:
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine

    engine = build_local_engine(target, draft, "torch")
    run = engine.start(Request(prompt=PROMPT, max_tokens=64, block_size=8))
    next(run)  # the prefill and a first block
    files = rec.measure(lambda: next(run))
    run.close()
    return files


def chat_request(rec: Recorder, target: str, draft: str) -> list[str]:
    from kakeya.orchestrator.assembly import build_local_engine
    from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
    from kakeya.orchestrator.fronts.http_server import HttpFront

    servicer = GenerationServicer(lambda: build_local_engine(target, draft, "torch"), colocated=True)
    servicer.load()
    servicer.ready = True
    front = HttpFront(servicer, 0, "demo")
    port = front.start("127.0.0.1")
    body = json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": True}
    ).encode()

    def post() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        if answer.status != 200 or b"[DONE]" not in data:
            raise RuntimeError(f"the chat request failed: {answer.status} {data[:200]!r}")

    post()  # warm-up
    files = rec.measure(post)
    front.drain()
    front.join(5)
    return files


def by_room(files: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in files:
        room, _, name = f.rpartition("/")
        out.setdefault(room, []).append(name)
    return out


def house() -> dict:
    """The hand-written lines of services/ and its most crowded folder (``__init__.py`` counted as a module)."""
    source = ROOT / "services"
    generated = source / "wire" / "kakeya"
    files = [p for p in source.rglob("*.py") if generated not in p.parents]
    lines = sum(len(p.read_bytes().splitlines()) for p in files)
    folders = {p.parent for p in source.rglob("*.py") if "models" not in p.relative_to(source).parts}
    crowded = max(folders, key=lambda d: len(list(d.glob("*.py"))))
    return {
        "handwritten_lines": lines,
        "modules": len(files),
        "most_modules_in_a_folder": {
            "folder": str(crowded.relative_to(ROOT)),
            "modules": len(list(crowded.glob("*.py"))),
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "services/models/demo/target"))
    ap.add_argument("--draft", default=str(ROOT / "services/models/demo/draft"))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rec = Recorder()
    rec.install()
    block = one_block(rec, args.target, args.draft)
    chat = chat_request(rec, args.target, args.draft)
    result = {
        "one_greedy_block": {"files": len(block), "by_room": by_room(block)},
        "streamed_chat_request": {"files": len(chat), "by_room": by_room(chat)},
        "services": house(),
    }
    write_result(args.out, result)
    print(
        f"one greedy block: {len(block)} files; a streamed chat request: {len(chat)} files; "
        f"services/: {result['services']['handwritten_lines']} hand-written lines -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
