"""The OpenAI images API in front of Triton's `easel` model: `easel openai --triton HOST:PORT`.

Serves `POST /v1/images/generations` (the OpenAI request body, plus Easel's own parameters as
extra fields), `POST /v1/images/edits` (OpenAI's multipart body: clients/openai_edits.py), `GET /v1/models` and `GET /health/ready`, and forwards each image to Triton over
gRPC with `clients.client.EaselClient`, without waiting: the `n` images of a request run at once
(the denoiser batches them), and a client that leaves has them cancelled at once. Errors come back
as OpenAI error JSON, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status of
what happened (see `STATUS_MAP`).

What a client cannot do: send a body over `max_body_bytes` or take longer than BODY_TIMEOUT_S to
send it, hold a connection open without finishing its headers (HEADER_TIMEOUT_S), or get anything
forwarded that breaks the deployment's limits: every request is checked here first, by the same
rules as the server's (backends/core/request), against the limits the `easel` model declares.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.core.request.adapter_inputs import validate_request
from backends.core.request.params import InvalidInput, Limits
from backends.core.typed_config import strict_from_dict
from clients.client import EaselClient, EaselError, GenerateRequest, GenerateResult
from clients.openai_edits import easel_edit_files, read_form

log = logging.getLogger(__name__)

MODEL = "easel"
DEFAULT_MAX_N = 4  # images per request
# A body past this is refused (413) before it is read: the largest request of the default limits
# with three 1024 px control images as PNGs is a few MiB; incompressible 16 Mpixel ones are not.
DEFAULT_MAX_BODY_BYTES = 32 << 20
BODY_TIMEOUT_S = 60.0  # to send the whole body (408 past it)
HEADER_TIMEOUT_S = 10.0  # to send a request's headers, from the connection or the previous response
LIMITS_TTL_S = 10.0  # the deployment's limits are asked again after this (a new export may change them)
DISCONNECT_POLL_S = 0.2  # how often a running request checks that its client is still there
SEED_MAX = 2**63 - 1  # the `easel` model's limit
OUTPUT_FORMATS = ("png", "jpeg", "webp")

# Triton status (gRPC code name, or the HTTP status of tritonclient.http) -> (HTTP status,
# OpenAI error type, code). Anything not listed is a fault of the server: 500.
STATUS_MAP: dict[str, tuple[int, str, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", "invalid_value"),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "UNAVAILABLE": (503, "server_error", "unavailable"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "resource_exhausted"),
    "DEADLINE_EXCEEDED": (504, "server_error", "timeout"),
}
INTERNAL = (500, "server_error", "internal_error")
HTTP_STATUS_NAMES = {"400": "INVALID_ARGUMENT", "404": "NOT_FOUND", "503": "UNAVAILABLE",
                     "429": "RESOURCE_EXHAUSTED", "504": "DEADLINE_EXCEEDED"}

# The `easel` input a Triton message names ("width: 100 is not a multiple of 8") -> the field of
# the request body it came from.
TRITON_FIELDS = {
    "prompt": "prompt", "negative_prompt": "negative_prompt", "width": "size", "height": "size",
    "steps": "steps", "guidance_scale": "guidance_scale", "seed": "seed",
    "scheduler": "scheduler", "controlnets": "controlnets", "control_images": "controlnets",
    "control_scales": "controlnets", "control_guidance_start": "controlnets",
    "control_guidance_end": "controlnets", "loras": "loras", "lora_scales": "loras",
    "output_format": "output_format", "quality": "output_format",
    "image": "image", "mask_image": "mask", "strength": "strength", "template": "template",
}
_FIELD_RE = re.compile(r"(?:^|[\s,'\"(])(" + "|".join(sorted(TRITON_FIELDS, key=len, reverse=True))
                       + r")(?:\[\d+\])?: ")
# Absolute filesystem paths (two components or more): never sent to a client.
_PATH_RE = re.compile(r"(?<![\w:/.])/(?:[\w.@+-]+/)+[\w.@+-]*")
_UNREACHABLE = ("failed to connect", "connection refused", "cannot reach triton",
                "socket closed", "dns resolution failed", "name resolution")
_SIZE_RE = re.compile(r"\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*")


class ApiError(Exception):
    """An error that goes back to the client as OpenAI error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


class _Strict(BaseModel):
    # A misspelt field is a 400 that names it, not silently the default.
    model_config = ConfigDict(extra="forbid")


class ControlNetSpec(_Strict):
    name: str = Field(min_length=1, description="a ControlNet in the server's adapter store")
    image: str = Field(min_length=1, description="the control image, PNG or JPEG, base64 "
                                                 "(a data: URL is accepted too)")
    scale: float = 1.0
    guidance_start: float | None = None
    guidance_end: float | None = None

    def image_bytes(self) -> bytes:
        data = self.image
        if data.startswith("data:"):
            data = data.partition(",")[2]
        return base64.b64decode(data, validate=True)


class LoraSpec(_Strict):
    name: str = Field(min_length=1, description="a LoRA in the server's adapter store")
    scale: float = 1.0


class _ImagesRequest(_Strict):
    """What the OpenAI images API's bodies share; fields after `user` are Easel's extensions."""

    prompt: str
    model: str | None = None
    n: int | None = Field(1, ge=1)
    size: str | None = None  # "WIDTHxHEIGHT" or "auto" (the model's own size)
    response_format: str | None = None  # only "b64_json"
    # Sent by OpenAI clients; accepted and ignored.
    quality: str | None = None
    style: str | None = None
    user: str | None = None
    # Easel's extensions.
    steps: int | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    scheduler: str | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    loras: list[LoraSpec] | None = None

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is None or value == "auto" or _SIZE_RE.fullmatch(value):
            return value
        raise ValueError(f"{value[:40]!r} is not WIDTHxHEIGHT (e.g. 1024x1024) or auto")

    def width_height(self) -> tuple[int | None, int | None]:
        if self.size is None or self.size == "auto":
            return None, None
        m = _SIZE_RE.fullmatch(self.size)
        return int(m[1]), int(m[2])


class ImageGenerationRequest(_ImagesRequest):
    """`POST /v1/images/generations`' JSON body."""

    controlnets: list[ControlNetSpec] | None = None


class ImageEditRequest(_ImagesRequest):
    """`POST /v1/images/edits`' multipart fields beside its files (`image`, `mask`:
    clients/openai_edits.py); `loras` as JSON text, as a form carries it."""

    strength: float | None = None
    template: str | None = None

    @field_validator("loras", mode="before")
    @classmethod
    def _loras_json(cls, value):
        return json.loads(value) if isinstance(value, str) else value


def status_name(status: str | None) -> str | None:
    """'StatusCode.NOT_FOUND' (gRPC) or '404' (HTTP) -> 'NOT_FOUND'."""
    if status is None:
        return None
    name = status.rsplit(".", 1)[-1]
    return HTTP_STATUS_NAMES.get(name, name)


def clean_message(message: str) -> str:
    """A Triton message as a client may see it: no filesystem paths, bounded length."""
    message = _PATH_RE.sub("<path>", message).strip()
    return message[:1000]


def triton_error(err: EaselError) -> ApiError:
    """The OpenAI error for a failed `easel` request."""
    message = str(err)
    name = status_name(err.status)
    lowered = message.lower()
    if name is None or (name == "UNAVAILABLE" and any(s in lowered for s in _UNREACHABLE)):
        # Not the server's answer but no answer at all: say so without the address.
        return ApiError(503, "the inference server is unreachable; try again later",
                        "server_error", None, "unavailable")
    if name == "NOT_FOUND" and ("unknown model" in lowered or "no available versions" in lowered):
        # The public model itself is gone: the server is draining or restarting, a passing state
        # (OpenAI clients retry a 503, not a 404).
        return ApiError(503, "the model is not available now (the server is draining or "
                             "restarting); try again later", "server_error", None, "unavailable")
    status, type_, code = STATUS_MAP.get(name, INTERNAL)
    m = _FIELD_RE.search(message)
    param = TRITON_FIELDS[m[1]] if m and status < 500 else None
    if status == 500:
        message = "the inference server failed on this request: " + message
    return ApiError(status, clean_message(message), type_, param, code)


def validation_error(exc: RequestValidationError) -> ApiError:
    """Pydantic's first complaint about the body, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return ApiError(400, f"{param}: unknown parameter", param=param, code="unknown_parameter")
    if kind == "missing" and param:
        return ApiError(400, f"{param}: is required", param=param, code="missing_required_parameter")
    if kind in ("json_invalid", "model_attributes_type") or not param:
        return ApiError(400, "the body must be a JSON object: " + str(first.get("msg", "")),
                        code="invalid_json")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"{param}: {msg}", param=param, code="invalid_value")


def invalid_input(exc: InvalidInput) -> ApiError:
    """The server's own refusal, made here before forwarding: a 400 naming the body's field."""
    base = exc.field.split("[", 1)[0]
    return ApiError(400, clean_message(str(exc)), param=TRITON_FIELDS.get(base, base), code="invalid_value")


def check_limits(kwargs: dict[str, Any], seed: int | None, limits: Limits) -> None:
    """What preprocess would refuse (backends/core/request), refused before anything is sent:
    sizes, steps, guidance, texts, adapters' counts, names and scales, control images (decoded,
    so a bomb stops here). Raises ApiError 400."""
    try:
        validate_request({**kwargs, "seed": seed}, limits)
    except InvalidInput as exc:
        raise invalid_input(exc) from None


class DeploymentLimits:
    """The `easel` model's limits as its config declares them, asked again after LIMITS_TTL_S."""

    def __init__(self, client: EaselClient):
        self.client = client
        self._limits: tuple[float, Limits] | None = None

    def get(self) -> Limits:
        now = time.monotonic()
        if self._limits is None or now - self._limits[0] > LIMITS_TTL_S:
            self._limits = (now, strict_from_dict(Limits, self.client.limits(), "limits"))
        return self._limits[1]


class BodyLimits:
    """ASGI middleware: a request's body is read here first, refused with 413 past `max_bytes`
    (at once when its Content-Length says so) and with 408 if it takes over `timeout_s`; the
    route then reads it from memory, and later messages (a disconnect) from the client."""

    def __init__(self, app, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send, 413, f"the body is over this server's limit of {self.max_bytes} "
                                                  "bytes", "request_too_large")
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, f"the body did not arrive within {self.timeout_s:.0f} s",
                                          "request_timeout")
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, 413, f"the body is over this server's limit of {self.max_bytes} "
                                                      "bytes", "request_too_large")
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str) -> None:
        """The error, and the connection closed: the rest of the body is not read."""
        response = error_response(status, message, "invalid_request_error", None, code)
        response.headers["connection"] = "close"
        await response({"type": "http"}, None, send)


def _header_deadline_protocol(timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request headers are not all in within
    `timeout_s` of its opening or of its last response (uvicorn waits for them for ever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self):
            self.loop.call_later(timeout_s, self._headers_late)

        def _headers_late(self):
            waiting = self.cycle is None or self.cycle.response_complete  # no request under way
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def uvicorn_config(app: FastAPI, host: str = "0.0.0.0", port: int = 8080,
                   header_timeout_s: float = HEADER_TIMEOUT_S, **options):
    """How `run` serves the API (tests use it too): the header deadline, no uvicorn log config."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=_header_deadline_protocol(header_timeout_s),
                          log_config=None, **options)


class ClientLeft(Exception):
    """The HTTP client went away before its images were ready; they were cancelled."""


async def generate_all(client: EaselClient, requests: list[GenerateRequest], request: Request
                       ) -> list[GenerateResult | EaselError]:
    """Every request sent at once; their answers in order. If the HTTP client leaves first, all
    are cancelled (the denoiser drops each at its next step) and ClientLeft is raised."""
    loop = asyncio.get_running_loop()
    futures, cancels = [], []
    for r in requests:
        future = loop.create_future()

        def settle(answer, future=future):
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(answer))

        try:
            cancels.append(client.start(r, settle))
        except ValueError as exc:  # (build_inputs' own checks; check_limits passed first)
            for cancel in cancels:
                cancel()
            raise ApiError(400, clean_message(str(exc)), code="invalid_value") from None
        futures.append(future)
    answers = asyncio.gather(*futures)
    while not answers.done():
        await asyncio.wait([answers], timeout=DISCONNECT_POLL_S)
        if not answers.done() and await request.is_disconnected():
            for cancel in cancels:
                cancel()
            raise ClientLeft(len(requests))
    return answers.result()


def _generate_kwargs(body: _ImagesRequest, controlnets: list[ControlNetSpec] | None = None) -> dict[str, Any]:
    """EaselClient.generate keyword arguments for one image (seed left to the caller)."""
    width, height = body.width_height()
    kwargs: dict[str, Any] = dict(
        prompt=body.prompt, negative_prompt=body.negative_prompt, width=width, height=height,
        steps=body.steps, guidance_scale=body.guidance_scale, scheduler=body.scheduler,
        output_format=body.output_format)
    if controlnets:
        images = []
        for i, c in enumerate(controlnets):
            try:
                images.append(c.image_bytes())
            except (binascii.Error, ValueError):
                raise ApiError(400, f"controlnets.{i}.image: not valid base64",
                               param=f"controlnets.{i}.image", code="invalid_value") from None
        kwargs.update(controlnets=tuple(c.name for c in controlnets),
                      control_images=tuple(images),
                      control_scales=tuple(c.scale for c in controlnets))
        if any(c.guidance_start is not None or c.guidance_end is not None for c in controlnets):
            # The model takes the windows for all ControlNets or none: the defaults fill in.
            kwargs.update(
                control_guidance_start=tuple(0.0 if c.guidance_start is None else c.guidance_start
                                             for c in controlnets),
                control_guidance_end=tuple(1.0 if c.guidance_end is None else c.guidance_end
                                           for c in controlnets))
    if body.loras:
        kwargs.update(loras=tuple(lo.name for lo in body.loras),
                      lora_scales=tuple(lo.scale for lo in body.loras))
    return kwargs


def create_app(triton_url: str, *, model: str = MODEL, max_n: int = DEFAULT_MAX_N,
               timeout_s: float | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S, docs: bool = False, max_workers: int = 8) -> FastAPI:
    """The API, forwarding each image to model `model` of the Triton at `triton_url` (gRPC,
    HOST:PORT). `max_n`: images per request; `timeout_s`: each image's deadline (default the
    client's); `max_body_bytes`, `body_timeout_s`: a request body's limits; `docs`: serve /docs
    and /openapi.json; `max_workers`: threads for checking requests (decoding control images)
    and asking Triton."""
    client = EaselClient(triton_url, protocol="grpc", model=model, timeout_s=timeout_s)
    limits = DeploymentLimits(client)
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="easel-openai")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("OpenAI images API for Triton model %r at %s (gRPC)", model, triton_url)
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            client.close()

    app = FastAPI(title="Easel OpenAI images API", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    app.state.client = client
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, timeout_s=body_timeout_s)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = validation_error(exc)
        log.info("%s %s: 400 %s", request.method, request.url.path, err.message)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None, code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal error in the API server", "server_error", None,
                              "internal_error")

    created = int(time.time())

    def model_card() -> dict:
        return {"id": model, "object": "model", "created": created, "owned_by": "easel"}

    @app.get("/health/ready")
    async def ready():
        """200 while Triton's `easel` model is ready, else 503 (a load balancer's check)."""
        if await asyncio.get_running_loop().run_in_executor(pool, client.is_ready):
            return {"ready": True}
        return error_response(503, "the inference server is not ready", "server_error", None, "unavailable")

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        if model_id != model:
            raise ApiError(404, f"model {model_id[:100]!r} does not exist; this server serves "
                                f"{model!r}", param="model", code="model_not_found")
        return model_card()

    async def serve(route: str, body: _ImagesRequest, request: Request, kwargs: dict[str, Any],
                    files: dict[str, bytes] | None = None) -> dict:
        """The images of `body`: checked, sent at once, answered in OpenAI's form. `kwargs`: one
        image's EaselClient.generate keyword arguments; `files`: an edit's (clients/openai_edits.py),
        turned into Easel's inputs against the deployment's limits."""
        if body.model is not None and body.model != model:
            raise ApiError(404, f"model {body.model[:100]!r} does not exist; this server serves "
                                f"{model!r}", param="model", code="model_not_found")
        if body.response_format not in (None, "b64_json"):
            raise ApiError(400, f"response_format {body.response_format[:40]!r} is not supported: "
                                "this server keeps no images to link to; use b64_json",
                           param="response_format", code="unsupported_value")
        if (body.n or 1) > max_n:
            raise ApiError(400, f"n: {body.n} is more than this server's limit of {max_n}",
                           param="n", code="invalid_value")
        if body.seed is not None and body.seed + (body.n or 1) - 1 > SEED_MAX:
            raise ApiError(400, f"seed: images take seeds seed..seed+n-1, which must stay "
                                f"<= {SEED_MAX}", param="seed", code="invalid_value")
        n = body.n or 1
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        try:
            deployment = await loop.run_in_executor(pool, limits.get)
        except EaselError as exc:
            raise triton_error(exc) from None
        if files is not None:
            try:
                image, mask_image = await loop.run_in_executor(
                    pool, easel_edit_files, files.get("image"), files.get("mask_image"), deployment)
            except InvalidInput as exc:
                raise invalid_input(exc) from None
            kwargs = {**kwargs, "image": image, "mask_image": mask_image}
        await loop.run_in_executor(pool, check_limits, kwargs, body.seed, deployment)
        requests = [GenerateRequest(**kwargs, seed=None if body.seed is None else body.seed + i) for i in range(n)]
        try:
            results = await generate_all(client, requests, request)
        except ClientLeft:
            log.info("%s n=%d: the client left after %.2f s; its images were cancelled", route, n,
                     time.monotonic() - start)
            return error_response(499, "the client closed the request", "invalid_request_error", None,
                                  "client_closed_request")
        for r in results:
            if isinstance(r, EaselError):
                err = triton_error(r)
                log.warning("%s n=%d: %d %s (Triton: %s %s)", route, n, err.status, err.message, r.status,
                            str(r)[:300])
                raise err
        log.info("%s n=%d size=%s: 200 in %.2f s", route, n, body.size or "auto", time.monotonic() - start)
        first = results[0].info
        response: dict[str, Any] = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(r.png).decode("ascii"), "revised_prompt": None,
                      "info": r.info} for r in results],
            "output_format": first.get("output_format", body.output_format or "png"),
        }
        if "width" in first and "height" in first:
            response["size"] = f"{first['width']}x{first['height']}"
        return response

    @app.post("/v1/images/generations")
    async def generations(body: ImageGenerationRequest, request: Request):
        return await serve("images/generations", body, request, _generate_kwargs(body, body.controlnets))

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        """OpenAI's multipart edit: `image` and `mask` files (the mask's fully transparent pixels
        are edited; without a mask, the image's), the fields of ImageEditRequest."""
        try:
            fields, files = await read_form(request)
        except InvalidInput as exc:
            raise invalid_input(exc) from None
        try:
            body = ImageEditRequest.model_validate(fields)
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors())) from None
        except ValueError:  # `loras` that are not JSON
            raise ApiError(400, "loras: is not JSON", param="loras", code="invalid_value") from None

        kwargs = {**_generate_kwargs(body), "strength": body.strength, "template": body.template}
        return await serve("images/edits", body, request, kwargs, files)

    return app


def run(triton_url: str, host: str = "0.0.0.0", port: int = 8080, **options) -> None:
    """Serve the API with uvicorn until interrupted (logs through this process's logging)."""
    import uvicorn

    app = create_app(triton_url, **options)
    log.info("serving the OpenAI images API on http://%s:%d/v1", host, port)
    uvicorn.Server(uvicorn_config(app, host, port)).run()
