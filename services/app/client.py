"""``kakeya client ...``: call a running orchestrator (``kakeya serve orchestrator|all``).

::

    kakeya client --addr HOST:PORT generate [--prompt TEXT] [--max-tokens N] [--json] ...
    kakeya client --addr HOST:PORT generate --chat --tools tools.json --tool-choice required ...
    kakeya client --addr HOST:PORT info | health

``client generate`` prints what ``kakeya generate`` prints: the same ``--json`` object, from the
report rebuilt from the stream (``grpc_api.report_from_stream``); with tools, also the calls the server
parsed (``content`` and ``tool_calls`` in ``--json``; one ``tool call`` line each otherwise).
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kakeya.app import flags as serve_flags
from kakeya.app import options
from kakeya.app.serve import DEFAULT_PORTS
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import generate_pb2_grpc

# A stream that broke this way (its orchestrator died, restarted or drains) resumes on the next address.
RETRY_CODES = ("UNAVAILABLE", "CANCELLED")


def _rpc_error(exc) -> int:
    code = exc.code().name if exc.code() else "UNKNOWN"
    rid = dict(exc.trailing_metadata() or ()).get("x-request-id")  # what the server's logs name it by
    print(f"kakeya: error: {code}: {exc.details()}" + (f" (request id {rid})" if rid else ""), file=sys.stderr)
    return 1


TOOL_MODES = ("auto", "none", "required")


def add_tool_options(p) -> None:
    """``--tools FILE|JSON`` (OpenAI's ``tools``: a list of ``{"type": "function", "function": {name, description,
    parameters}}``, read as the HTTP API reads it) and ``--tool-choice auto|none|required|NAME`` (a name: that
    function). The server checks them as every front's (INVALID_ARGUMENT naming the field) and returns the calls
    it reads in ``Complete.tool_calls``."""
    g = p.add_argument_group("tools (with --chat; the calls come back parsed, see the README's Tool calls)")
    g.add_argument("--tools", metavar="FILE|JSON", help="function tools in OpenAI's format (a JSON list)")
    g.add_argument("--tool-choice", metavar="auto|none|required|NAME",
                   help="whether the model may call a tool (default: auto with --tools), must call one, or must"
                        " call NAME")  # fmt: skip


def set_tools(messages, args) -> None:
    """``--tools`` and ``--tool-choice`` into ``messages`` (a ``ChatMessages``); ValueError naming the flag."""
    from kakeya.orchestrator.fronts.http_params import Refused, tools

    if args.tools is not None:
        try:
            declared = tools(json.loads(options.text_or_file(args.tools)))
        except (ValueError, RecursionError) as exc:  # Refused is a ValueError, as is bad JSON
            why = str(exc) if isinstance(exc, Refused) else f"not JSON ({exc})"
            raise ValueError(f"--tools: {why}") from None
        for t in declared:
            schema = json.dumps(dict(t.parameters)) if t.parameters is not None else ""
            messages.tools.add(name=t.name, description=t.description, parameters_json=schema)
    if args.tool_choice in TOOL_MODES:
        messages.tool_choice.mode = pb.ToolChoiceMode.Value(f"TOOL_CHOICE_MODE_{args.tool_choice.upper()}")
    elif args.tool_choice is not None:
        messages.tool_choice.function = args.tool_choice


def generate_request(args):
    options.sampling_from_args(args)  # checked as `kakeya generate` checks it: the wire's top_p 0 would read as off
    for name in ("temperature", "top_p", "min_p", "top_k", "max_tokens", "logprobs"):  # float32 0 would read as off
        v = getattr(args, name) or 0  # as the wire's int32 / float32 carries it (1e-50 is 0 there, 1e40 inf)
        if abs(v) >= 2**31 if isinstance(v, int) else not 0 < abs(pb.SamplingParams(min_p=v).min_p) < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')}: {v} does not fit the wire's 32 bits")
    sp = pb.SamplingParams(
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, stop=args.stop or [],
        stop_token_ids=args.stop_token_id or [], temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, rule=wire_contract.rule_to_proto(args.sampling_rule), seed=args.seed,
        logprobs=args.logprobs,  # None: unset; the server checks it (INVALID_ARGUMENT naming sampling_params.logprobs)
    )  # fmt: skip
    req = pb.GenerateRequest(request_id=args.request_id or "", sampling_params=sp, block_size=args.block_size or 0)
    constraint, _ = options.constraint_from_args(args)
    if constraint is not None:
        req.constraint.CopyFrom(wire_contract.constraint_to_proto(constraint))
    if args.chat and args.prompt_ids is not None:
        raise ValueError("--chat renders a text prompt in the chat template: give --prompt, not --prompt-ids")
    if (args.tools is not None or args.tool_choice is not None) and not args.chat:
        raise ValueError("--tools and --tool-choice need --chat (tools are declared in the chat template)")
    prompt = args.prompt if args.prompt is not None else options.DEFAULT_PROMPT
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated token ids, got {args.prompt_ids!r}") from None
        req.tokenized.SetInParent()  # set, even with no ids (the server refuses an empty prompt by name)
        req.tokenized.ids.extend(ids)
    elif args.chat:  # one user message, in the model's chat template (the server renders it)
        req.messages.messages.add(role="user", content=prompt)
        set_tools(req.messages, args)
    else:
        req.text = prompt
    policy = options.cache_policy_from_args(args)
    if policy is not None:
        req.cache_policy.CopyFrom(wire_contract.policy_to_proto(policy))
    return req


def cmd_client_generate(args) -> int:
    if args.max_tokens < 1:  # refused here, as `kakeya generate` refuses it: the wire's 0 is the server's default
        raise ValueError(f"--max-tokens: must be an integer >= 1, got {args.max_tokens}")
    if not 0 <= (args.block_size or 0) <= MAX_BLOCK_SIZE:  # as `kakeya generate`: 0 or omitted is auto
        raise ValueError(f"--block-size: must be 0 (auto) or 1..{MAX_BLOCK_SIZE}, got {args.block_size}")
    if args.prompt is not None and args.prompt_ids is not None:
        raise ValueError("give --prompt or --prompt-ids, not both")
    req = generate_request(args)
    if not (addrs := [a.strip() for a in args.addr.split(",") if a.strip()]):
        raise ValueError(f"--addr: give HOST:PORT, or a comma-separated list of them, got {args.addr!r}")
    tries = max(1, args.retries) * len(addrs)
    if req.sampling_params.temperature > 0 and not req.sampling_params.HasField("seed"):
        req.sampling_params.seed = random.getrandbits(63)  # a resumed sampled stream needs the seed it ran with
    ids, logprobs, text = [], [], []  # what has streamed: token ids, their logprobs (wire messages), text pieces
    complete = model = server = None
    for k in itertools.count():  # each orchestrator in turn, resuming after what came (``resume_token_ids``)
        stub = generate_pb2_grpc.GenerationStub(serve_flags.client_channel(args, addrs[k % len(addrs)]))
        del req.resume_token_ids[:]
        req.resume_token_ids.extend(ids)
        try:
            model = model or stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout or 30)
            server = server or stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=args.timeout or 30)
            for resp in stub.Generate(req, timeout=args.timeout):
                if resp.HasField("chunk"):
                    ids.extend(resp.chunk.token_ids)
                    logprobs.extend(resp.chunk.logprobs)
                    text.append(resp.chunk.text)
                    options.show(args, resp.chunk.text)
                else:
                    complete = resp.complete
            # A drain's end stops a stream with a clean prefix (our own cancel gets no Complete): it goes on elsewhere.
            if complete is None or complete.finish_reason != pb.FINISH_REASON_ABORT or k + 1 >= tries:
                break
            code = pb.FinishReason.Name(complete.finish_reason)
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() else "UNKNOWN"
            if code not in RETRY_CODES or k + 1 >= tries:
                if not args.json and text:
                    print()
                return _rpc_error(exc)
        print(f"kakeya: {addrs[k % len(addrs)]}: {code}; resuming after {len(ids)} tokens"
              f" on {addrs[(k + 1) % len(addrs)]}", file=sys.stderr)  # fmt: skip
        time.sleep(min(2.0, 0.1 * 2 ** (k // len(addrs))))  # a full turn of the list backs off
    if complete is None:
        print("kakeya: error: the stream ended without a Complete message", file=sys.stderr)
        return 1
    from kakeya.orchestrator.fronts.grpc_api import report_from_stream

    report = report_from_stream(model, server.verifier_backend, complete, ids, "".join(text))
    out = report.to_json()
    if args.logprobs is not None:
        out["logprobs"] = options.logprobs_json([wire_contract.logprobs_from_proto(m) for m in logprobs])
    if complete.HasField("content"):  # the calls were read (tools, tool_choice not none)
        out["content"], out["tool_calls"] = complete.content, [
            {"id": c.id, "name": c.name, "arguments": _arguments(c.arguments_json)} for c in complete.tool_calls]  # fmt: skip
        if not args.json:
            print()
            for call in out["tool_calls"]:
                print(f"tool call {call['id']}: {call['name']} {json.dumps(call['arguments'], ensure_ascii=False)}")
    options.print_result(args, out)
    if complete.finish_reason == pb.FINISH_REASON_ERROR:
        print(f"kakeya: error: generation failed: {complete.error_message}", file=sys.stderr)
        return 1
    return 0


def _arguments(text: str):
    try:  # a call's arguments: their object, or, where --max-tokens or a stop string cut the call, its JSON text so far
        return json.loads(text or "{}")
    except ValueError:
        return text


def cmd_client_info(args) -> int:
    from google.protobuf.json_format import MessageToDict

    stub = generate_pb2_grpc.GenerationStub(serve_flags.client_channel(args))
    try:
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout or 10)
        server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=args.timeout or 10)
    except grpc.RpcError as exc:
        return _rpc_error(exc)
    print(json.dumps({"model": MessageToDict(model), "server": MessageToDict(server)}, indent=1))
    return 0


def cmd_client_health(args) -> int:
    stub = health_pb2_grpc.HealthStub(serve_flags.client_channel(args))
    try:
        r = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout or 5)
    except grpc.RpcError as exc:
        return _rpc_error(exc)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def register(sub) -> None:
    p = sub.add_parser("client", help="call a running orchestrator (kakeya serve orchestrator|all)")
    p.add_argument("--addr", default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}",
                   help="HOST:PORT of the orchestrator; a comma-separated list: a generation whose stream"
                        " breaks resumes on the next one (resume_token_ids), with exactly the tokens it"
                        " has not had")  # fmt: skip
    p.add_argument("--retries", type=int, default=3, help="turns through --addr a stream may take (default 3)")
    p.add_argument("--timeout", type=float, help="deadline in seconds (propagates to the verifier and drafter;"
                                                 " default: none for generate, 10 for info, 5 for health)")  # fmt: skip
    serve_flags.add_client(p)
    cmds = p.add_subparsers(dest="client_command", required=True)

    g = cmds.add_parser("generate", help="streaming generation, same options and --json as `kakeya generate`")
    options.add_generation_options(g)
    g.add_argument("--prompt-ids", help="pre-tokenized prompt, comma-separated ids (instead of --prompt)")
    g.add_argument("--chat", action="store_true", help="send --prompt as one user message in the model's chat template")
    g.add_argument("--stop", action="append", help="stop string (repeatable); cut from the output")
    g.add_argument("--stop-token-id", type=int, action="append", help="extra stop token id (repeatable)")
    g.add_argument("--request-id", help="request id for the server's logs")
    add_tool_options(g)
    options.add_cache_args(g, default_kind=None)
    g.set_defaults(func=cmd_client_generate)

    i = cmds.add_parser("info", help="GetModelInfo + GetServerInfo as JSON")
    i.set_defaults(func=cmd_client_info)

    h = cmds.add_parser("health", help="grpc.health.v1 Check; exit 0 when SERVING")
    h.add_argument("--service", default="", help="service name ('' = the whole server)")
    h.set_defaults(func=cmd_client_health)
