"""Python client for the public `easel` ensemble (unary text-to-image)."""
from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
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
            values = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values]
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
            self._client = self._mod.InferenceServerClient(self.url)

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
        control_guidance_start/end, loras, lora_scales."""
        request = GenerateRequest(prompt, negative_prompt, width, height, steps,
                                  guidance_scale, seed, scheduler, output_format=output_format,
                                  quality=quality, **controls)
        return self.run(request, timeout_s)

    def run(self, request: GenerateRequest, timeout_s: float | None = None) -> GenerateResult:
        from tritonclient.utils import InferenceServerException

        inputs = build_inputs(request, self.protocol)
        outputs = [self._mod.InferRequestedOutput(n) for n in ("image", "info")]
        # The deadline goes to the server too, as the request's timeout (microseconds): that is
        # what stops the denoiser at its next step once the deadline passes (Triton 2.51 does not
        # pass a client's cancel on to the models already running; backends/easel_generate says more).
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
            raise EaselError(e.message() or str(e), e.status()) from e
        except (ConnectionError, OSError) as e:
            raise EaselError(f"cannot reach Triton at {self.url} ({self.protocol}): {e}") from e
        finally:
            if client is not self._client:
                client.close()
        return parse_result(result.as_numpy("image"), result.as_numpy("info"))


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
