"""A generate request as typed parameters, validated against the deployment's limits.

Plain Python (no torch): `preprocess` validates here, every later stage reads the same object
back from the JSON it travels in. Errors name the field and the limit.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping

from backends.core.request.output_format import DEFAULT_FORMAT, FORMATS, check_quality
from backends.core.typed_config import strict_from_dict

MAX_SEED = 2**63 - 1
# Sampler names a request may choose; `default` is the model folder's own scheduler.
# backends/core/engine/diffusers_schedulers.py maps each onto a diffusers class.
SCHEDULER_NAMES = ("default", "euler", "euler_a", "dpmpp_2m_karras", "ddim")


# At most this many characters of a client's value go back in an error message: a whole 9 kB
# value no longer fits gRPC's metadata limit, and gRPC then drops the stream.
ECHO_CHARS = 100


def shorten(value: Any, limit: int = ECHO_CHARS) -> str:
    """repr() of a client's value, cut to `limit` characters (with how long it was)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(value) if hasattr(value, '__len__') else len(text)} long)"


_PATH = re.compile(r"(?<![\w.])(?:/[\w.@+-]+){2,}/?")


def no_paths(text: str) -> str:
    """`text` with file paths cut out: messages that reach clients never show the server's files."""
    return _PATH.sub("<path>", text)


class InvalidInput(ValueError):
    """A request input that breaks a rule; the message names the field and the limit."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class UnknownAdapter(InvalidInput):
    """A request names an adapter the store does not hold (NOT_FOUND / 404, not a bad value)."""


class Overloaded(RuntimeError):
    """The server is full: the request is refused at once (UNAVAILABLE), a retry later may pass."""


class Cancelled(RuntimeError):
    """The client cancelled or gave up (its deadline): the work stopped at a step boundary."""


@dataclass(frozen=True)
class Limits:
    """What one deployment accepts, and its defaults (written by export into the configs)."""

    default_width: int = 1024
    default_height: int = 1024
    max_width: int = 2048
    max_height: int = 2048
    min_size: int = 64
    size_multiple: int = 8
    default_steps: int = 30
    max_steps: int = 150
    default_guidance_scale: float = 5.0
    max_guidance_scale: float = 50.0
    default_scheduler: str = "default"
    max_prompt_bytes: int = 16384
    max_controlnets: int = 3
    max_loras: int = 3
    max_control_image_pixels: int = 4096 * 4096

    @classmethod
    def from_json(cls, text: str) -> "Limits":
        return strict_from_dict(cls, json.loads(text), "limits")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class ControlParams:
    """One ControlNet of a request (its image travels beside the params, by index)."""

    name: str
    scale: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0


@dataclass(frozen=True)
class LoraParams:
    name: str
    scale: float = 1.0


@dataclass(frozen=True)
class GenerateParams:
    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    scheduler: str
    controls: tuple[ControlParams, ...] = ()
    loras: tuple[LoraParams, ...] = ()
    # How the pipeline encodes the image (backends/core/stages/image_files.py); quality None
    # is the format's default.
    output_format: str = DEFAULT_FORMAT
    quality: int | None = None
    # An edit (the template and mask travel beside the params, request/edit_inputs.py): how far
    # the template is noised before denoising starts, in (0, 1]. None: text to image.
    strength: float | None = None
    # An edit's template name: its activations are recorded by its first edit and reused by later
    # ones (approximate; runtime/token_subsets.py). None: exact inpainting.
    template: str | None = None
    # Stage timings and other facts that travel with the request into `info`.
    trace: dict[str, Any] = field(default_factory=dict)

    @property
    def cfg(self) -> bool:
        """Classifier-free guidance, on exactly when diffusers turns it on (guidance_scale > 1)."""
        return self.guidance_scale > 1.0

    @property
    def denoising_steps(self) -> int:
        """The steps that run: an edit below strength 1 skips the first ones, as diffusers'
        get_timesteps does."""
        return self.steps if self.strength is None else min(int(self.steps * self.strength), self.steps)

    def work(self, steps: int | None = None) -> float:
        """Denoising work of `steps` (default: all that run) of this request, in 1024x1024 row-steps:
        the cost a step grows with (rows: 2 with guidance). What requests are routed by."""
        steps = self.denoising_steps if steps is None else steps
        return steps * (2 if self.cfg else 1) * self.width * self.height / 2**20

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "GenerateParams":
        fields = json.loads(data)
        fields["controls"] = tuple(strict_from_dict(ControlParams, c, "params.controls")
                                   for c in fields.get("controls", ()))
        fields["loras"] = tuple(strict_from_dict(LoraParams, c, "params.loras") for c in fields.get("loras", ()))
        return strict_from_dict(cls, fields, "params")

    def with_trace(self, **entries: Any) -> "GenerateParams":
        return dataclasses.replace(self, trace={**self.trace, **entries})


def _text(raw: Mapping[str, Any], name: str, limits: Limits, required: bool) -> str | None:
    value = raw.get(name)
    if value is None:
        if required:
            raise InvalidInput(name, "is required")
        return None
    if isinstance(value, str):
        try:
            value = value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8
            raise InvalidInput(name, "is not valid UTF-8") from None
    if len(value) > limits.max_prompt_bytes:
        raise InvalidInput(name, f"is {len(value)} bytes, over the limit of {limits.max_prompt_bytes}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(name, "is not valid UTF-8") from None


def _size(raw: Mapping[str, Any], name: str, default: int, maximum: int, limits: Limits) -> int:
    value = raw.get(name)
    if value is None:
        return default
    value = int(value)
    if value % limits.size_multiple:
        raise InvalidInput(name, f"{value} is not a multiple of {limits.size_multiple}")
    if value < limits.min_size or value > maximum:
        raise InvalidInput(name, f"{value} is outside [{limits.min_size}, {maximum}]")
    return value


def validate(raw: Mapping[str, Any], limits: Limits) -> GenerateParams:
    """Turn the scalars of a request (None where absent) into GenerateParams, or raise InvalidInput."""
    prompt = _text(raw, "prompt", limits, required=True)
    negative = _text(raw, "negative_prompt", limits, required=False)
    width = _size(raw, "width", limits.default_width, limits.max_width, limits)
    height = _size(raw, "height", limits.default_height, limits.max_height, limits)

    steps = raw.get("steps")
    steps = limits.default_steps if steps is None else int(steps)
    if not 1 <= steps <= limits.max_steps:
        raise InvalidInput("steps", f"{steps} is outside [1, {limits.max_steps}]")

    guidance = raw.get("guidance_scale")
    guidance = limits.default_guidance_scale if guidance is None else float(guidance)
    if not 0.0 <= guidance <= limits.max_guidance_scale:  # also refuses NaN
        raise InvalidInput("guidance_scale", f"{guidance} is outside [0, {limits.max_guidance_scale}]")

    seed = raw.get("seed")
    seed = secrets.randbelow(2**31) if seed is None else int(seed)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidInput("seed", f"{seed} is outside [0, {MAX_SEED}]")

    scheduler = _text(raw, "scheduler", limits, required=False) or limits.default_scheduler
    if scheduler not in SCHEDULER_NAMES:
        raise InvalidInput("scheduler", f"unknown name {shorten(scheduler)}; allowed: {', '.join(SCHEDULER_NAMES)}")

    output_format = _text(raw, "output_format", limits, required=False) or DEFAULT_FORMAT
    if output_format not in FORMATS:
        raise InvalidInput("output_format", f"unknown format {shorten(output_format)}; allowed: {', '.join(FORMATS)}")
    quality = raw.get("quality")
    if quality is not None:
        quality = int(quality)
        try:
            check_quality(output_format, quality)
        except ValueError as exc:
            raise InvalidInput("quality", str(exc).removeprefix("quality: ")) from None

    strength = raw.get("strength")
    if strength is not None:
        # It crosses as FP32 (0.7 arrives as 0.69999999): back to the client's decimal, or
        # int(steps * strength), the steps that run, would fall a step short of diffusers' (6 of 10).
        strength = round(float(strength), 6)
        if not 0.0 < strength <= 1.0:  # also refuses NaN
            raise InvalidInput("strength", f"{strength:g} is outside (0, 1]")
        if int(steps * strength) == 0:
            raise InvalidInput("strength", f"{strength:g} leaves no step of {steps}")

    return GenerateParams(prompt=prompt, negative_prompt=negative, width=width, height=height, steps=steps,
                          guidance_scale=guidance, seed=seed, scheduler=scheduler,
                          output_format=output_format, quality=quality, strength=strength)
