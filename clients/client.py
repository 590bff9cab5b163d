"""Python client for the public models: `easel` (unary text-to-image) and `easel_stream` (the same,
with a response per denoising step over a gRPC stream)."""
from __future__ import annotations

import io
import json
import logging
import queue
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
STREAM_MODEL = "easel_stream"
# A gRPC stream's error reaches the client as a message alone, so `easel_stream` heads it with its
# status ("INVALID_ARGUMENT: width: ..."). Not Triton's header `triton_grpc_error`, which ends the
# stream with the status: in Triton 2.51 it crashes tritonserver (backends/triton/adapter.py).
STREAM_STATUS = re.compile(r"(INVALID_ARGUMENT|NOT_FOUND|UNAVAILABLE|CANCELLED|INTERNAL): (.*)", re.DOTALL)
# Diffusion on CPU can take minutes; tritonclient's HTTP default (60 s) would cut it off.
DEFAULT_TIMEOUT_S = 3600.0


class EaselError(RuntimeError):
    """The server (or the connection to it) rejected a request."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenerateRequest:
    """Inputs of the `easel` model; None means "not sent, use the model default"."""

    prompt: str
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    scheduler: str | None = None
    # ControlNets: names with their images (PNG/JPEG bytes), one each; scales and guidance
    # windows optional (all or none).
    controlnets: tuple[str, ...] | None = None
    control_images: tuple[bytes, ...] | None = None
    control_scales: tuple[float, ...] | None = None
    control_guidance_start: tuple[float, ...] | None = None
    control_guidance_end: tuple[float, ...] | None = None
    loras: tuple[str, ...] | None = None
    lora_scales: tuple[float, ...] | None = None
    # The image's encoding: "png" (server default), "jpeg" or "webp"; quality 1-100, jpeg/webp only.
    output_format: str | None = None
    quality: int | None = None
    # An edit (inpainting): the template and its mask (PNG/JPEG bytes; mask 0 keeps, 255 repaints),
    # and how far the template is noised (0, 1].
    image: bytes | None = None
    mask_image: bytes | None = None
    strength: float | None = None
    template: str | None = None  # the edit's template name: later edits reuse the first's activations


# Input name -> (Triton datatype, numpy dtype); every input has dims [1].
INPUT_TYPES: dict[str, tuple[str, Any]] = {
    "prompt": ("BYTES", np.object_),
    "negative_prompt": ("BYTES", np.object_),
    "width": ("INT32", np.int32),
    "height": ("INT32", np.int32),
    "steps": ("INT32", np.int32),
    "guidance_scale": ("FP32", np.float32),
    "seed": ("INT64", np.int64),
    "scheduler": ("BYTES", np.object_),
    "controlnets": ("BYTES", np.object_),
    "control_images": ("BYTES", np.object_),
    "control_scales": ("FP32", np.float32),
    "control_guidance_start": ("FP32", np.float32),
    "control_guidance_end": ("FP32", np.float32),
    "loras": ("BYTES", np.object_),
    "image": ("BYTES", np.object_),
    "mask_image": ("BYTES", np.object_),
    "strength": ("FP32", np.float32),
    "template": ("BYTES", np.object_),
    "lora_scales": ("FP32", np.float32),
    "output_format": ("BYTES", np.object_),
    "quality": ("INT32", np.int32),
}


@dataclass
class GenerateResult:
    png: bytes  # the encoded image: PNG unless the request asked for another output_format
    info: dict = field(default_factory=dict)

    def image(self):
        from PIL import Image

        img = Image.open(io.BytesIO(self.png))
        img.load()
        return img

    def save(self, path) -> None:
        with open(path, "wb") as f:
            f.write(self.png)


@dataclass(frozen=True)
class Progress:
    """One denoising step of a streamed request (`EaselClient.stream`)."""

    step: int  # steps done, 1 to steps
    steps: int
    elapsed_s: float  # since the server received the request
    preview: bytes | None = None  # a PNG at the latent grid's size, every `preview_every` steps

    def image(self):
        from PIL import Image

        img = Image.open(io.BytesIO(self.preview))
        img.load()
        return img


def _protocol_module(protocol: str):
    # Import lazily: the gRPC stack is slow to import and not always needed.
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError(f"protocol must be 'http' or 'grpc', not {protocol!r}")
    return mod


def build_inputs(request: GenerateRequest, protocol: str = "http") -> list:
    """InferInputs for exactly the fields of `request` that are set."""
    mod = _protocol_module(protocol)
    inputs = []
    for f in fields(request):
        value = getattr(request, f.name)
        if value is None:
            continue
        datatype, dtype = INPUT_TYPES[f.name]
        values = list(value) if isinstance(value, (tuple, list)) else [value]
        if dtype is np.object_:
            try:
                values = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values]
            except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8
                raise ValueError(f"{f.name}: is not valid UTF-8 text") from None
        elif np.issubdtype(dtype, np.integer):  # numpy would wrap a value past the type's range
            bounds = np.iinfo(dtype)
            for v in values:
                if not bounds.min <= int(v) <= bounds.max:
                    raise ValueError(f"{f.name}: {v} is outside {datatype}'s [{bounds.min}, {bounds.max}]")
        arr = np.array(values, dtype=dtype)
        tensor = mod.InferInput(f.name, [len(values)], datatype)
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return inputs


def default_url(protocol: str) -> str:
    return f"localhost:{DEFAULT_PORTS[protocol]}"


class EaselClient:
    def __init__(self, url: str | None = None, protocol: str = "http",
                 model: str = "easel", timeout_s: float | None = None):
        self._mod = _protocol_module(protocol)  # validates `protocol` first
        self.protocol = protocol
        self.url = url or default_url(protocol)
        self.model = model
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        if protocol == "http":
            self._client = self._mod.InferenceServerClient(
                self.url, connection_timeout=min(self.timeout_s, 60.0),
                network_timeout=self.timeout_s)
        else:
            self._client = self._mod.InferenceServerClient(self.url, channel_args=grpc_channel_args())

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "EaselClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_model_ready(self.model))
        except Exception:  # unreachable server counts as not ready
            return False

    def generate(self, prompt: str, negative_prompt: str | None = None,
                 width: int | None = None, height: int | None = None,
                 steps: int | None = None, guidance_scale: float | None = None,
                 seed: int | None = None, scheduler: str | None = None,
                 timeout_s: float | None = None, output_format: str | None = None,
                 quality: int | None = None, **controls) -> GenerateResult:
        """`output_format`: "png" (default), "jpeg" or "webp"; `quality` (1-100) for jpeg/webp.
        Both are sent only when given. `controls`: controlnets, control_images, control_scales,
        control_guidance_start/end, loras, lora_scales; an edit's image, mask_image, strength, template."""
        request = GenerateRequest(prompt, negative_prompt, width, height, steps,
                                  guidance_scale, seed, scheduler, output_format=output_format,
                                  quality=quality, **controls)
        return self.run(request, timeout_s)

    def run(self, request: GenerateRequest, timeout_s: float | None = None) -> GenerateResult:
        from tritonclient.utils import InferenceServerException

        inputs = build_inputs(request, self.protocol)
        outputs = self._outputs()
        # The deadline goes to the server too, as the request's timeout (microseconds): that is
        # what stops the denoiser at its next step once the deadline passes, also over HTTP, which
        # has no cancel (backends/triton/bls_pipeline.py says more).
        kwargs: dict[str, Any] = {"timeout": int((timeout_s or self.timeout_s) * 1e6)}
        client = self._client
        if self.protocol == "grpc":
            kwargs["client_timeout"] = timeout_s or self.timeout_s
        elif timeout_s and timeout_s != self.timeout_s:
            # HTTP's limit is the client's network_timeout, fixed at construction.
            client = EaselClient(self.url, "http", self.model, timeout_s)._client
        try:
            result = client.infer(self.model, inputs, outputs=outputs, **kwargs)
        except InferenceServerException as e:
            raise easel_error(e) from e
        except (ConnectionError, OSError) as e:
            raise EaselError(f"cannot reach Triton at {self.url} ({self.protocol}): {e}") from e
        finally:
            if client is not self._client:
                client.close()
        return parse_result(result.as_numpy("image"), result.as_numpy("info"))

    def start(self, request: GenerateRequest, on_done: Callable[[GenerateResult | EaselError], None],
              timeout_s: float | None = None) -> Callable[[], None]:
        """`request` sent without waiting (gRPC): `on_done` gets its GenerateResult, or an
        EaselError, on one of tritonclient's threads. Returns a function that cancels the request:
        the server drops it at its next denoising step (`easel` sees a gRPC cancel,
        backends/triton/bls_pipeline.py), and `on_done` gets the cancel's error."""
        if self.protocol != "grpc":
            raise EaselError("a request that can be cancelled needs --protocol grpc (HTTP has no cancel)")
        timeout_s = timeout_s or self.timeout_s

        def done(result, error) -> None:
            try:
                if error is not None:
                    answer = easel_error(error)
                else:
                    answer = parse_result(result.as_numpy("image"), result.as_numpy("info"))
            except Exception as exc:  # a malformed answer must still reach on_done
                answer = EaselError(f"unreadable answer from {self.url}: {exc}")
            on_done(answer)

        call = self._client.async_infer(self.model, build_inputs(request, "grpc"), done,
                                        outputs=self._outputs(),
                                        timeout=int(timeout_s * 1e6), client_timeout=timeout_s)
        return call.cancel

    def _outputs(self) -> list:
        return [self._mod.InferRequestedOutput(n) for n in ("image", "info")]

    def limits(self) -> dict[str, Any]:
        """The deployment's limits (backends/core/request/params.Limits' fields), as export wrote
        them into the public model's config."""
        from tritonclient.utils import InferenceServerException

        try:
            as_json = {"as_json": True} if self.protocol == "grpc" else {}  # (HTTP answers JSON anyway)
            config = self._client.get_model_config(self.model, **as_json)
        except InferenceServerException as e:
            raise easel_error(e) from e
        except (ConnectionError, OSError) as e:
            raise EaselError(f"cannot reach Triton at {self.url} ({self.protocol}): {e}") from e
        config = config.get("config", config)
        try:
            return json.loads(config["parameters"]["limits"]["string_value"])
        except (KeyError, TypeError, ValueError) as e:
            raise EaselError(f"model {self.model!r} declares no limits (a repository from another export?)") from e

    def can_stream(self) -> bool:
        """Whether `stream` can run here: gRPC, and a repository with `easel_stream` (older ones
        have only `easel`)."""
        if self.protocol != "grpc":
            return False
        try:
            return bool(self._client.is_model_ready(STREAM_MODEL))
        except Exception:  # unreachable, or no such model
            return False

    def stream(self, request: GenerateRequest, preview_every: int | None = None,
               timeout_s: float | None = None) -> Iterator[Progress | GenerateResult]:
        """`request` through `easel_stream` over a gRPC stream: a Progress per denoising step, then
        the GenerateResult. Closing the iterator before its end (a `break`, an exception, Ctrl-C;
        `contextlib.closing` makes it prompt) cancels the request: the server stops denoising it
        at its next step. Errors raise EaselError with the status `run` would give."""
        if self.protocol != "grpc":
            raise EaselError("streaming needs --protocol grpc (HTTP has no streams in Triton 2.51)")
        from tritonclient.utils import InferenceServerException

        timeout_s = timeout_s or self.timeout_s
        inputs = build_inputs(request, "grpc")
        if preview_every:
            tensor = self._mod.InferInput("preview_every", [1], "INT32")
            tensor.set_data_from_numpy(np.array([preview_every], dtype=np.int32))
            inputs.append(tensor)
        answers: queue.Queue = queue.Queue()
        # A client of its own: one stream per client in tritonclient, and streams may run at once.
        client = self._mod.InferenceServerClient(self.url, channel_args=grpc_channel_args())
        finished = False
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)),
                                stream_timeout=timeout_s)
            # The deadline also goes as the request's timeout: the denoiser drops it past that.
            client.async_stream_infer(STREAM_MODEL, inputs, timeout=int(timeout_s * 1e6))
            deadline = time.monotonic() + timeout_s
            while True:
                try:  # (a grace past the deadline: the stream's own timeout answers first)
                    result, error = answers.get(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
                except queue.Empty:
                    raise EaselError(f"no answer from {self.url} within {timeout_s:.0f} s",
                                     "StatusCode.DEADLINE_EXCEEDED") from None
                if error is not None:
                    finished = True
                    raise stream_error(error)
                image = result.as_numpy("image")
                if image is not None:
                    finished = True
                    yield parse_result(image, result.as_numpy("info"))
                    return
                yield progress_of(result)
        except InferenceServerException as e:
            raise easel_error(e) from e
        finally:
            client.stop_stream(cancel_requests=not finished)
            client.close()


def easel_error(error) -> EaselError:
    """tritonclient's InferenceServerException as ours, keeping its status."""
    return EaselError(error.message() or str(error), error.status())


def grpc_channel_args() -> list[tuple[str, Any]]:
    """tritonclient's own channel options, and reconnects within a second: gRPC's default backoff
    grows to minutes, so a client that saw the server restart kept failing for many seconds
    after it was ready again."""
    from tritonclient.grpc import KeepAliveOptions

    keepalive, most = KeepAliveOptions(), 2**31 - 1  # (tritonclient's message size limit)
    return [("grpc.max_send_message_length", most), ("grpc.max_receive_message_length", most),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000)]


def stream_error(error) -> EaselError:
    """A stream's error as EaselError: its gRPC status when the stream ended with one (its
    deadline), else the status `easel_stream` named at the head of the message (STREAM_STATUS)."""
    message = error.message() or str(error)
    if error.status() is not None:
        return EaselError(message, error.status())
    named = STREAM_STATUS.fullmatch(message)
    if named is None:  # (Triton's own, before the model ran: e.g. a wrong input type)
        return EaselError(message)
    return EaselError(named[2], f"StatusCode.{named[1]}")


def progress_of(result) -> Progress:
    """A progress response of `easel_stream` as a Progress."""
    def first(name):
        array = result.as_numpy(name)
        return None if array is None or array.size == 0 else array.reshape(-1)[0]

    preview = first("preview")
    return Progress(int(first("step")), int(first("steps")), float(first("elapsed_s")),
                    bytes(preview) if preview is not None else None)


def parse_result(image: np.ndarray | None, info: np.ndarray | None) -> GenerateResult:
    if image is None or image.size == 0:
        raise EaselError("response has no 'image' output")
    png = image.reshape(-1)[0]
    info_dict: dict = {}
    if info is not None and info.size:
        raw = info.reshape(-1)[0]
        try:
            info_dict = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        except (ValueError, UnicodeDecodeError):
            log.warning("info output is not JSON: %r", raw[:200])
    return GenerateResult(bytes(png), info_dict)
