"""The public gRPC Generation API (``protos/kakeya/v1/generate.proto``): translation only.

A ``GenerateRequest`` becomes a ``Request`` (``fronts/grpc_api.py``) and runs through the generation service; each
committed block goes out as a ``Chunk`` (ids + text, cut at stop strings), then one ``Complete`` from the report. A
drafter failing mid-generation leaves the verifier to finish alone (``drafter_fallback``). A failing verifier ends the
RPC with its status before the first chunk, or ``FINISH_REASON_ERROR`` after it. Cancelling the call cancels the run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc

from kakeya.core.generation import Block
from kakeya.core.request import CachePolicy, InvalidRequest
from kakeya.orchestrator.decode.takeover import some_replica_serving
from kakeya.orchestrator.fronts import grpc_api
from kakeya.orchestrator.fronts.service import GenerationService
from kakeya.orchestrator.tools import grammar as tool_choice
from kakeya.runtime import logs
from kakeya.runtime.bounds import check_request_id
from kakeya.runtime.lifecycle import RequestError, ServerSpec, bounded, version, workers_for
from kakeya.runtime.security.guard import add_servicer
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import generate_pb2_grpc
from kakeya.wire.limits import PUBLIC_MAX_RECEIVE_BYTES

GENERATION = pb.DESCRIPTOR.services_by_name["Generation"]

PUBLIC_DRAFTER_STATUS = ("state", "failures")  # of ``Drafter.status()``: not ``last_error`` (an address, a trace)


def public_backend(name: str) -> str:
    """A backend as ``GetServerInfo`` names it: its kind, never a remote one's address."""
    return name.partition(":")[0]


def model_name(path: str) -> str:
    """A checkpoint's public name: its directory's name, never the server's path to it."""
    return Path(path).name if path else ""


class GenerationServicer(GenerationService, generate_pb2_grpc.GenerationServicer):
    """The generation service (``service.py``) behind the public gRPC API."""

    def Generate(self, request: pb.GenerateRequest, context) -> Iterator[pb.GenerateResponse]:
        names = grpc_api.FIELD_NAMES
        try:
            default = self.engine.verifier.policy if self.engine is not None else CachePolicy()
            req, names = grpc_api.request_from_proto(request, default)
            proxy_id = dict(context.invocation_metadata()).get("x-request-id", "")
            if proxy_id and not req.request_id:  # a proxy's id of the call (Envoy sends one) names it in every log
                req, names = replace(req, request_id=proxy_id), names | {"request_id": "x-request-id metadata"}
            req = replace(req, request_id=check_request_id(req.request_id) or uuid.uuid4().hex[:16])
            logs.bind(request_id=req.request_id)  # a refusal's line too (RpcInterceptor, which resets the context)
            told = (("x-request-id", req.request_id),)  # the id every log line names goes back, as HTTP's X-Request-Id:
            context.send_initial_metadata(told)  # at once, and in the trailers (where a refusal's client reads it)
            context.set_trailing_metadata(told)
            streamed = 0  # characters of text sent so far
            for item in self.stream(req, context):
                if isinstance(item, Block):
                    streamed += len(item.text)
                    logprobs = [wire_contract.logprobs_to_proto(lp) for lp in item.logprobs or ()]
                    chunk = pb.GenerateResponse.Chunk(token_ids=item.tokens, text=item.text, logprobs=logprobs)
                    yield pb.GenerateResponse(chunk=chunk)
                    continue
                if item.text[streamed:]:  # the text held back to the end (a partial character, a stop string)
                    yield pb.GenerateResponse(chunk=pb.GenerateResponse.Chunk(text=item.text[streamed:]))
                complete = grpc_api.complete_from_report(item, tool_choice.reads_calls(req.prompt))
                yield pb.GenerateResponse(complete=complete)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(exc.public(names)))
        except RequestError as exc:
            context.abort(exc.code, exc.message)

    def GetModelInfo(self, request, context):
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "orchestrator is loading")
        e = self.engine
        i = e.verifier.info
        policy = e.verifier.policy.resolve(i.sliding_window)
        if self.restore is not None:  # colocated: a restoration directory goes out as its source's name
            policy = self.restore.to_wire(policy)
        return wire_contract.public_model_info(
            i,
            target_model=model_name(e.target),
            draft_model=model_name(e.draft),
            default_block_size=e.default_block_size,
            max_tokens_limit=self.max_tokens_limit,
            default_max_tokens=self.default_max_tokens,
            has_tokenizer=e.codec is not None,
            default_cache_policy=wire_contract.policy_to_proto(policy),
            target_layer_ids=list(e.verifier.aux_layers),
            max_prompt_tokens=self.limits.max_prompt_tokens,
            max_position_embeddings=self.limits.max_context,  # the servers' --max-context, else the model's
            has_chat_template=e.codec is not None and e.codec.chat is not None,
        )

    def GetServerInfo(self, request, context):
        """The server's version, deployment, load and drafter state, as a public caller may see them: never a
        backend's address or error text (the operator's: docs/security.md)."""
        e = self.engine
        drafter = e.drafter if e is not None else None
        status = drafter.status() if drafter is not None else {}
        extra = {f"drafter_{k}": v for k, v in status.items() if k in PUBLIC_DRAFTER_STATUS}
        with self._lock:
            active, total = self.active, self.total
        return pb.ServerInfo(
            version=version(),
            verifier_backend=public_backend(e.verifier.info.backend) if e is not None else "",
            drafter_backend=public_backend(drafter.backend) if drafter is not None else "",
            deployment="colocated" if self.colocated else "split",
            active_requests=active,
            total_requests=total,
            uptime_s=time.monotonic() - self.started,
            extra=extra,
        )


def server_spec(servicer: GenerationServicer, tls=None, http=None) -> ServerSpec:
    """``http``: the OpenAI HTTP front (``http_server.HttpFront``) served beside the gRPC API, or None."""

    def backends_ok() -> bool:
        """SERVING only while the verifier answers (a missing drafter only costs speed: AR fallback)."""
        ok = (e := servicer.engine) is None or some_replica_serving(e.verifier)  # one hung replica of several: SERVING
        servicer.verifier_down = not ok
        return ok

    def near_deadline() -> None:
        servicer.aborting = True  # in-flight generations end with FINISH_REASON_ABORT

    return ServerSpec(
        name="orchestrator",
        service_names=[GENERATION.full_name],
        load=servicer.load,
        set_ready=lambda flag: setattr(servicer, "ready", flag),
        add_to_server=lambda server: add_servicer(server, servicer, GENERATION, servicer.auth_token),
        before_drain=servicer.drain,
        near_deadline=near_deadline,
        busy=servicer.busy,
        max_receive_bytes=PUBLIC_MAX_RECEIVE_BYTES,
        public=True,
        max_workers=workers_for(servicer.max_sessions, servicer.queue),  # queued generations hold a thread too
        health_watch=None if servicer.colocated else backends_ok,
        tls=tls,
        metrics=servicer.metrics,
        http=http,
    )
