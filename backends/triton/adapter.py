"""Helpers shared by the Triton adapters (backends/easel_*/model.py): tensors in and out.

Only the adapters import this module; the core (backends/core) never sees Triton types.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import hmac
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.core.runtime.placement import Placement
from backends.triton.stub_checks import numpy_refusal
from backends.core.request.contract import INTERNAL_KEY_ENV, INTERNAL_KEY_PARAMETER, ModelDecl
from backends.core.request.adapter_inputs import checked_params
from backends.core.request.params import (Cancelled, GenerateParams, InvalidInput, Limits, Overloaded, UnknownAdapter,
                                          no_paths)

# Triton 2.51's stub corrupts its own heap when a response sender's is_cancelled(), asked from
# another thread, overlaps the model's execute on the main thread: under a flood of refusals beside
# streams the client cancels, `easel_stream` died in 6 of 9 runs of bench/micro/stream_stress.py
# (87-186 s); with no is_cancelled() calls, 240 s clean in 3 of 3; with the two kept apart by this
# lock, clean in every run (bench/results/2026-11-24c-cpu/notes.md). Execute holds it
# (`holds_execute_lock`); every is_cancelled() outside execute goes through `is_cancelled`. One per
# stub process, as the stub is; re-entrant, since a query inside execute overlaps nothing.
EXECUTE_LOCK = threading.RLock()


def holds_execute_lock(execute):
    """A model's `execute`, run under EXECUTE_LOCK: for the models whose other threads ask
    `is_cancelled()`."""
    @functools.wraps(execute)
    def locked(*args, **kwargs):
        with EXECUTE_LOCK:
            return execute(*args, **kwargs)
    return locked


def is_cancelled(sender) -> bool:
    """`sender.is_cancelled()` from a thread other than execute's (see EXECUTE_LOCK). While an
    execute runs it answers False without asking or waiting: the caller (the pipeline's watcher,
    the denoiser's loop at a step boundary) asks again at its next poll or step, and is never held
    up by an execute that decodes images."""
    if not EXECUTE_LOCK.acquire(blocking=False):
        return False
    try:
        return sender.is_cancelled()
    finally:
        EXECUTE_LOCK.release()


# Error messages sent to clients are cut to this many characters: gRPC carries them in a header,
# and one over its metadata limit drops the whole stream (RESOURCE_EXHAUSTED) instead.
MAX_MESSAGE_CHARS = 600


class TritonLogHandler(logging.Handler):
    """Routes the core's `logging` records into Triton's log."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(msg)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(msg)
        else:
            pb_utils.Logger.log_info(msg)


# glibc's malloc keeps this much above the top of a heap it grows or trims (M_TOP_PAD). The stubs
# move each image's megabytes through freshly allocated buffers (numpy arrays, the bytes of a BYTES
# tensor); with glibc's default pad of 128 KiB, a buffer that is freed hands its pages back and the
# next request faults zeroed pages in again. On the CPU dev machine
# (bench/results/2026-11-24f-cpu/notes.md) a 1024 px request's hand-offs between the models and to
# its client fell from 23-26 ms to 18-19 ms with it; setting it for tritonserver's own process as
# well (MALLOC_TOP_PAD_) gained nothing more.
MALLOC_TOP_PAD_BYTES = 64 << 20
_M_TOP_PAD = -2  # glibc's malloc.h


def setup_stub() -> None:
    """What every model's `initialize` sets up for its stub process: Triton's log for the
    `backends` loggers, a refusal to run on numpy 2 (stub_checks), and malloc's top pad
    (MALLOC_TOP_PAD_BYTES; a process-wide setting, so a deployment's own tritonserver command
    needs nothing for it)."""
    _setup_logging()
    refusal = numpy_refusal(np.__version__, np.__file__)
    if refusal:
        raise RuntimeError(refusal)
    try:
        libc = ctypes.CDLL(None)
        if not libc.mallopt(_M_TOP_PAD, MALLOC_TOP_PAD_BYTES):
            logging.getLogger("backends").warning("mallopt(M_TOP_PAD) refused; images' buffers are not kept")
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): only a speed-up is lost
        logging.getLogger("backends").info("no glibc mallopt here; malloc keeps its default top pad")


def _setup_logging() -> None:
    root = logging.getLogger("backends")
    if not any(isinstance(h, TritonLogHandler) for h in root.handlers):
        handler = TritonLogHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def parameters(args: dict[str, Any]) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def version_folder(args: dict[str, Any]) -> Path:
    return Path(args["model_repository"]) / str(args["model_version"])


def artifact_folder(args: dict[str, Any]) -> Path:
    """The folder holding this model's weights: its own version folder, or the one another model
    of the repository exported (parameter `artifacts`, relative to the repository root, so that
    several denoisers share one copy of the UNet). The path comes from the config, never a request."""
    rel = parameters(args).get("artifacts")
    if not rel:
        return version_folder(args)
    root = Path(args["model_repository"]).parent.resolve()
    folder = (root / rel).resolve()
    if root not in folder.parents:
        raise ValueError(f"parameter artifacts={rel!r} leaves the model repository")
    return folder


def adapter_store_folder(args: dict[str, Any]) -> Path | None:
    """The adapter store named by parameter `adapters` (relative to the repository root), if any."""
    rel = parameters(args).get("adapters")
    return (Path(args["model_repository"]).parent / rel).resolve() if rel else None


def placement(args: dict[str, Any]) -> Placement:
    dtype = parameters(args).get("dtype", "fp32")
    if args.get("model_instance_kind") == "GPU":
        return Placement(device=f"cuda:{args['model_instance_device_id']}", dtype=dtype)
    return Placement(device="cpu", dtype=dtype)


def read_inputs(request, decl: ModelDecl) -> dict[str, np.ndarray | None]:
    out = {}
    for t in decl.inputs:
        tensor = pb_utils.get_input_tensor_by_name(request, t.name)
        out[t.name] = None if tensor is None else tensor.as_numpy()
    return out


def input_array(request, name: str) -> np.ndarray | None:
    """An input of the request as numpy, or None when the request leaves it out."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def scalar(array: np.ndarray | None):
    """The one element of a [1]-shaped input (bytes for BYTES), or None when absent."""
    if array is None:
        return None
    value = array.reshape(-1)[0]
    return value if isinstance(value, bytes) else value.item()


def limits(args: dict[str, Any]) -> Limits:
    """The deployment's limits (parameter `limits`, written by export into every model's config)."""
    return Limits.from_json(parameters(args)["limits"])


def read_params(request, limits: Limits) -> GenerateParams:
    """The request's params, checked again against `limits` (the model may be called directly)."""
    tensor = pb_utils.get_input_tensor_by_name(request, "params")
    return checked_params(scalar(tensor.as_numpy()), limits)


def params_tensor(params: GenerateParams):
    return pb_utils.Tensor("params", np.array([params.to_json()], dtype=np.object_))


def remaining_us(timeout_us: int, params: GenerateParams, what: str) -> int:
    """What is left of the client's deadline, in microseconds (0: none), for the denoiser.

    The request's `timeout` (the protocol's timeout parameter, in microseconds; Easel's client
    sends its deadline there) is the one deadline an HTTP client can give: HTTP has no cancel. So
    the denoiser gets what remains of it and drops the request at the first step boundary past it
    (backends/core/engine/loop.py); a gRPC client's own cancel or deadline reaches it too, by the
    public model's watcher (backends/triton/bls_pipeline.py). A BLS request cannot be cancelled in 2.51
    (no cancel() on its response iterator before 24.11), so a timeout is what a BLS caller can pass.
    `timeout_us`: the request's timeout(), the client's whole deadline."""
    if not timeout_us:
        return 0
    received = params.trace.get("received_at")  # preprocess's clock: when the request began
    elapsed = max(0.0, time.time() - received) if isinstance(received, (int, float)) else 0.0
    remaining = timeout_us - int(elapsed * 1e6)
    if remaining <= 0:
        raise Cancelled(f"{what}: the request's deadline ({timeout_us / 1e6:.3g} s) passed before denoising")
    return remaining


# Triton 2.51 hands a decoupled model's error responses to its BLS caller with code INTERNAL
# whatever code they were sent with (seen: the denoiser sent INVALID_ARG, its caller got INTERNAL).
# So our decoupled models also mark the code in the message, and the caller restores the code
# from the mark (ForwardedError).
MARKS = {"[invalid input] ": "INVALID_ARG", "[not found] ": "NOT_FOUND", "[unavailable] ": "UNAVAILABLE",
         "[cancelled] ": "CANCELLED"}  # (pb_utils' codes exist only once the stub runs a model: by name)
INVALID_MARK = "[invalid input] "
# Any model's errors reach a BLS caller as INTERNAL in 2.51, a plain model's too (seen: preprocess's
# INVALID_ARG reached easel_stream as INTERNAL). A BLS caller that passes on statuses (the public
# models, backends/triton/bls_pipeline.py) sends this request parameter, and the model marks its errors
# for it; clients never see a mark.
MARKS_PARAMETER = "easel_marks"


def request_parameters(request) -> dict:
    """A request's parameters ({} where they cannot be read)."""
    try:
        given = json.loads(request.parameters() or "{}")
    except (ValueError, AttributeError):
        return {}
    return given if isinstance(given, dict) else {}


def wants_marks(request) -> bool:
    """Whether the request's caller asked for marked errors (MARKS_PARAMETER)."""
    return bool(request_parameters(request).get(MARKS_PARAMETER))


# The internal models (preprocess, text encoder, denoisers, ControlNet service, VAE decoder) serve
# the public models' BLS calls, but Triton cannot hide them from clients: a client could cancel
# other clients' requests or run work the pipeline never asks for. Every BLS call of ours carries
# the server's per-start secret as a request parameter; an internal model refuses a request
# without it. The secret is in the server's environment (set by clients/serve.py, inherited by
# the stubs, readable only by the server's user); without one, as when tritonserver is started
# by hand without it, internal models take every call.
def internal_parameters() -> dict[str, str]:
    """The parameters that open an internal model to a BLS call of ours."""
    key = os.environ.get(INTERNAL_KEY_ENV)
    return {INTERNAL_KEY_PARAMETER: key} if key else {}


def check_caller(request, model: str) -> None:
    """NOT_FOUND for a request that does not carry the server's secret (INTERNAL_KEY_ENV)."""
    key = os.environ.get(INTERNAL_KEY_ENV)
    if not key:
        return
    given = request_parameters(request).get(INTERNAL_KEY_PARAMETER)
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), key.encode()):
        raise UnknownAdapter("model", f"{model} is a part of Easel's pipeline, not a model to call: "
                                      "call easel or easel_stream")


class ForwardedError(RuntimeError):
    """An error another model (called by BLS) answered with, passed on with its status code."""

    def __init__(self, triton_error):
        message, code = triton_error.message(), triton_error.code()
        for mark, name in MARKS.items():
            if message.startswith(mark):
                message, code = message[len(mark):], code_of(name)
                break
        super().__init__(message)
        self.code = code


def code_of(name: str):
    """A status code by name: INVALID_ARG, NOT_FOUND, UNAVAILABLE, CANCELLED, ..."""
    return getattr(pb_utils.TritonError, name)


def status_of(exc: BaseException):
    """The status a failure goes back with; None for our own faults (INTERNAL / 500)."""
    if isinstance(exc, ForwardedError):
        return exc.code
    if isinstance(exc, UnknownAdapter):  # before InvalidInput, which it is too
        return pb_utils.TritonError.NOT_FOUND
    if isinstance(exc, InvalidInput):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(exc, Overloaded):
        return pb_utils.TritonError.UNAVAILABLE
    if isinstance(exc, Cancelled):
        return pb_utils.TritonError.CANCELLED
    return None


def mark(message: str, code) -> str:
    """`message` with the mark of `code` (for decoupled models' errors, see MARKS)."""
    return next((m for m, name in MARKS.items() if code_of(name) == code), "") + message


def public_message(message: str) -> str:
    """What a client may see of a message: no server paths, bounded in length."""
    message = no_paths(message)
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."


def error(message: str, invalid: bool = False, code=None):
    """A failed response. `invalid`: the client's mistake (gRPC INVALID_ARGUMENT, HTTP 400),
    so that clients and proxies do not count it as a server fault or retry it. `code`: any
    other status (None: INTERNAL)."""
    if invalid:
        code = pb_utils.TritonError.INVALID_ARG
    message = public_message(message)
    if code is None:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


# The gRPC name of each status a failure can carry (None: INTERNAL), for stream_status_message.
GRPC_NAMES = {"INVALID_ARG": "INVALID_ARGUMENT", "NOT_FOUND": "NOT_FOUND", "UNAVAILABLE": "UNAVAILABLE",
              "CANCELLED": "CANCELLED"}


def stream_status_message(message: str, code) -> str:
    """`message` headed by its status's gRPC name ("INVALID_ARGUMENT: width: ..."), for a gRPC
    stream's errors: Triton 2.51 hands those to the client as a message alone, and its mode that
    ends the stream with the status instead (header `triton_grpc_error`) crashes tritonserver
    (SIGSEGV in its gRPC frontend, seen after 200-1,700 failed requests while other streams ran)."""
    name = next((g for n, g in GRPC_NAMES.items() if code_of(n) == code), "INTERNAL")
    return f"{name}: {message}"


def failure(exc: BaseException, what: str, log: logging.Logger, marked: bool = False, stream: bool = False):
    """The response for a request that failed with `exc`. A refused request (the client's
    mistake, an unknown adapter, overload, a cancel) logs one warning line; only our own faults
    log a traceback. A failure another model answered with was logged there. `marked`: for
    decoupled models, whose codes reach a BLS caller only through the message's mark. `stream`:
    for a model that clients call over gRPC streams (stream_status_message)."""
    code = status_of(exc)
    if code is None:
        log.error("request failed", exc_info=exc)
        message = f"{what}: {exc}"
    else:
        if not isinstance(exc, ForwardedError):
            log.warning("request refused: %s", public_message(str(exc)))
        message = str(exc)
    if marked and code is not None:
        message = mark(public_message(message), code)
    elif stream:
        message = stream_status_message(public_message(message), code)
    return error(message, code=code)


def each_request(requests, handle, what: str, marked: bool = False) -> list:
    """One response per request: `handle(request)` returns its output tensors; whatever it raises
    fails that request alone, with the status of status_of (InvalidInput as is, since it already
    names the field, and as the client's mistake). `marked`: for models called by BLS (see MARKS).
    For the internal models: a request that is not a BLS call of ours is refused (check_caller)."""
    log = logging.getLogger(f"backends.{what}")
    responses = []
    for request in requests:
        try:
            check_caller(request, what)
            responses.append(pb_utils.InferenceResponse(handle(request)))
        except Exception as exc:
            responses.append(failure(exc, what, log, marked or wants_marks(request)))
    return responses


def drop_metrics(owner, *names: str) -> None:
    """Drops `owner`'s metric objects (attributes `names`) from a model's `finalize`, while the stub
    still reaches Triton. Left to the stub's own teardown, Triton 2.51 clears them after its shared
    memory is gone: the stub crashed (SIGSEGV in Metric::Clear from ~MetricFamily) at every stop of
    the server (bench/results/2026-11-24-cpu/notes.md)."""
    for name in names:
        delattr(owner, name)
    gc.collect()  # (a metric in a reference cycle would otherwise wait for the teardown too)


class Metrics:
    """Prometheus metrics of one model on Triton's metrics port: `specs` maps a key to
    (name, description, kind) with kind "counter" or "gauge"."""

    def __init__(self, labels: dict[str, str], specs: dict[str, tuple[str, str, str]]):
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
        # The families must outlive their metrics: Triton drops a metric whose family is gone.
        self.families = {key: pb_utils.MetricFamily(name=name, description=desc, kind=kinds[kind])
                         for key, (name, desc, kind) in specs.items()}
        self.metrics = {key: family.Metric(labels=labels) for key, family in self.families.items()}
        self._totals: dict[str, float] = {}

    def increment(self, key: str, value: float) -> None:
        if value:
            self.metrics[key].increment(value)

    def set_total(self, key: str, total: float) -> None:
        """A counter from a running total kept elsewhere (Prometheus counters take increments)."""
        self.increment(key, total - self._totals.get(key, 0.0))
        self._totals[key] = total

    def set(self, key: str, value: float) -> None:
        self.metrics[key].set(value)
