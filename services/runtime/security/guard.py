"""Registers a servicer so that bad bytes and missing credentials get clear statuses.

grpc-python answers an exception in a request deserializer with ``INTERNAL``, so every method is registered
without one and parses its raw bytes itself: undecodable bytes (invalid UTF-8 in a ``string`` field
included) end the RPC ``INVALID_ARGUMENT``; on a stream, a bad message raises
:class:`~kakeya.runtime.lifecycle.RequestError` where the servicer reads it. With a bearer token configured
every method requires it (``UNAUTHENTICATED``), checked before decoding; health and reflection stay open.
"""

from __future__ import annotations

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from kakeya.runtime.lifecycle import RequestError
from kakeya.runtime.security.auth import authorized


def _decode(cls, raw: bytes, what: str):
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError, TypeError) as exc:
        detail = str(exc) or "malformed protobuf"
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{what}: cannot decode the request ({detail[:200]})"
        ) from None


def _handler(method, impl, service: str, token: str | None):
    cls = message_factory.GetMessageClass(method.input_type)
    resp_ser = message_factory.GetMessageClass(method.output_type).SerializeToString

    def admitted(raw, context):
        """The parsed request (a stream: decoded one message at a time as it is read), or the call aborted
        (UNAUTHENTICATED / INVALID_ARGUMENT)."""
        if not authorized(context, token):
            why = f"{service}: missing or wrong bearer token (authorization metadata)"
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        if method.client_streaming:
            return (_decode(cls, message, method.name) for message in raw)
        try:
            return _decode(cls, raw, method.name)
        except RequestError as exc:
            context.abort(exc.code, exc.message)

    def call(raw, context):
        return impl(admitted(raw, context), context)

    def stream(raw, context):
        yield from impl(admitted(raw, context), context)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[method.client_streaming, method.server_streaming]
    return make(stream if method.server_streaming else call, request_deserializer=None, response_serializer=resp_ser)


def add_servicer(server: grpc.Server, servicer, service_descriptor, token: str | None = None) -> None:
    """Register every method of ``service_descriptor`` as ``servicer.<Method>``, guarded as above."""
    handlers = {
        m.name: _handler(m, getattr(servicer, m.name), service_descriptor.full_name, token)
        for m in service_descriptor.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))
