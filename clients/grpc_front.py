"""The public gRPC port of `easel serve`: every call, unary or streaming, forwarded as raw bytes
to tritonserver on a loopback port, without the request headers that switch Triton 2.51's gRPC
frontend into modes it crashes in.

Why: sent with the header `triton_grpc_error: true`, failing stream requests beside another
client's stream crashed tritonserver (SIGSEGV, once SIGABRT) within seconds, with no
authentication. The header asks Triton to end a stream with the error's status instead of
sending the error as a message; Easel's clients never send it (`easel_stream` heads its errors
with their status in band, clients/client.STREAM_STATUS). Stripping it needs something in front
of Triton, and a deployment may have no proxy, so `easel serve` puts this one there.

Each call keeps its method, messages, deadline and the rest of its headers; a client's cancel
cancels the call to Triton (which stops the denoiser: backends/triton/bls_pipeline.py), and Triton's
status and trailing headers come back as they were. The messages are not parsed.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

log = logging.getLogger(__name__)

# Request headers never passed on (lower case, as gRPC delivers them).
DROPPED_HEADERS = frozenset({"triton_grpc_error"})
NO_DEADLINE_S = 1e9  # a call's time remaining past this means it has no deadline
MAX_MESSAGE_BYTES = 2**31 - 1  # Triton's own limit (its clients' too): a control image may be MBs
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class GrpcFront:
    """Listens on `host:port` (0: any free port, see `.port`) and forwards to `upstream`
    (HOST:PORT). `max_calls`: calls in flight at once (a stream counts as one for its life);
    past it a call gets RESOURCE_EXHAUSTED."""

    def __init__(self, upstream: str, port: int, host: str = "0.0.0.0", max_calls: int = 256):
        self.upstream = upstream
        self.channel = grpc.insecure_channel(upstream, options=_OPTIONS)
        self.server = grpc.server(ThreadPoolExecutor(max_calls, thread_name_prefix="easel-grpc-front"),
                                  options=_OPTIONS, maximum_concurrent_rpcs=max_calls)
        self.server.add_generic_rpc_handlers([_Forward(self.channel)])
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"the gRPC front cannot listen on {host}:{port}")

    def start(self) -> "GrpcFront":
        self.server.start()
        log.info("gRPC front on port %d, forwarding to %s", self.port, self.upstream)
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Refuses new calls; the ones in flight get `grace_s` to finish (None: all the time they need)."""
        self.server.stop(grace_s).wait()
        self.channel.close()


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.Channel):
        self.channel = channel

    def service(self, details: grpc.HandlerCallDetails):
        headers = tuple((k, v) for k, v in details.invocation_metadata if k.lower() not in DROPPED_HEADERS)
        # One streaming handler serves every method: on the wire a unary call is a stream of one
        # message each way, and with no (de)serializers the messages pass as bytes.
        upstream = self.channel.stream_stream(details.method)

        def forward(requests, context: grpc.ServicerContext):
            remaining = context.time_remaining()  # ~9.2e18 s for a call without a deadline
            call = upstream(requests, metadata=headers, timeout=remaining if remaining < NO_DEADLINE_S else None)
            context.add_callback(call.cancel)  # the client left or cancelled: so does the call to Triton
            try:
                yield from call
            except grpc.RpcError as err:
                context.set_trailing_metadata(err.trailing_metadata() or ())
                context.abort(err.code(), err.details() or "")
            context.set_trailing_metadata(call.trailing_metadata() or ())

        return grpc.stream_stream_rpc_method_handler(forward)
