"""Forced tool calls against schemas as clients generate them: the demo pair, speculative and ``--no-drafter``.

    python benchmarks/tool_schemas.py [--max-tokens 64] [--backend torch]

For the ten pydantic argument models of ``tests/orchestrator/tool_models.py``: pydantic's own schema
(``model_json_schema()``) with ``tool_choice`` naming the function, and the ``openai`` SDK's strict
``pydantic_function_tool`` schema with ``tool_choice: "required"`` (``--cases alternate``, the default: the
first for every other model, the second for the rest, half the CPU time; ``--cases both``: both for each);
each generated greedily by the speculative
engine and by the same pair without its drafter (the AR reference). Records per case whether the model
finished its call within ``--max-tokens``, whether the finished call's arguments are valid (``jsonschema``
against the schema sent, and pydantic's own ``model_validate``), and whether the speculative tokens equal the
reference's. Goal (issue 58): every finished call valid, every case identical. Writes
``benchmarks/results/tool_schemas.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--cases", choices=("alternate", "both"), default="alternate")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tool_schemas.json"))
    args = ap.parse_args(argv)

    import jsonschema
    from record import provenance, write_result

    from kakeya.checkpoints.tiny import demo_pair
    from kakeya.orchestrator.assembly import build_local_engine
    from kakeya.orchestrator.decode.checks import check_request
    from kakeya.orchestrator.fronts.http_api import chat_request
    from kakeya.orchestrator.tools import calls
    from tests.orchestrator.tool_models import MODELS, schemas

    record = provenance()
    pair = demo_pair()
    device = "cpu" if args.backend == "torch" else None
    spec = build_local_engine(str(pair.target), str(pair.draft), args.backend, device)
    ar = build_local_engine(str(pair.target), str(pair.draft), args.backend, device, no_drafter=True)
    cases = []
    for i, model in enumerate(MODELS):
        both = (("pydantic", {"type": "function", "function": {"name": model.__name__}}), ("openai", "required"))
        for source, choice in both if args.cases == "both" else both[i % 2 : i % 2 + 1]:
            schema = schemas(model)[source]
            tool = {"type": "function", "function": {"name": model.__name__, "description": model.__doc__ or "",
                                                     "parameters": schema}}  # fmt: skip
            body = {"model": "demo", "messages": [{"role": "user", "content": f"Call {model.__name__}."}],
                    "max_tokens": args.max_tokens, "temperature": 0, "tools": [tool], "tool_choice": choice}  # fmt: skip
            req, _, _ = chat_request(body, "demo")
            t0 = time.perf_counter()
            out = spec.generate(check_request(req, spec))
            spec_s = time.perf_counter() - t0
            reference = ar.generate(check_request(req, ar))
            _, made = calls.split(spec.codec.decode(out.token_ids))
            finished = out.finish_reason == "stop" and len(made) == 1
            valid = None
            if finished:
                args_json = json.loads(made[0].arguments)
                try:
                    jsonschema.validate(args_json, schema)
                    model.model_validate(args_json)
                    valid = True
                except (jsonschema.ValidationError, ValueError) as exc:
                    valid, error = False, str(exc)[:200]
                    print(model.__name__, source, "INVALID", error, flush=True)
            case = {"model": model.__name__, "schema": source, "tool_choice": "named" if source == "pydantic" else
                    "required", "finish_reason": out.finish_reason, "tokens": len(out.token_ids),
                    "finished_call": finished, "valid": valid, "identical": out.token_ids == reference.token_ids,
                    "spec_s": round(spec_s, 2), "mean_acceptance": round(out.mean_acceptance, 3)}  # fmt: skip
            print(json.dumps(case), flush=True)
            cases.append(case)
    summary = {
        "cases": len(cases),
        "finished": sum(c["finished_call"] for c in cases),
        "valid": sum(c["valid"] is True for c in cases),
        "identical": sum(c["identical"] for c in cases),
    }
    print(json.dumps(summary))
    result = {"benchmark": "tool_schemas", "max_tokens": args.max_tokens, "backend": args.backend, "cases": args.cases,
              "summary": summary, "results": cases}  # fmt: skip
    write_result(Path(args.out), result, record)
    return 0 if summary["valid"] == summary["finished"] and summary["identical"] == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
