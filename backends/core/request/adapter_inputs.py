"""A request's adapter inputs, validated: ControlNet names, images, scales and guidance windows;
LoRA names and scales.

Torch-free: `preprocess` checks everything here so that a bad input fails before any GPU work;
the denoiser decodes the same images again with the same limits.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

from backends.core.request.edit_inputs import edit_defaults
from backends.core.request.image_inputs import decode_image
from backends.core.request.params import (ControlParams, GenerateParams, InvalidInput, Limits, LoraParams, shorten,
                                          validate)

MAX_SCALE = 10.0
MAX_LORA_SCALE = 4.0  # diffusers takes any; past this a LoRA only breaks the image

# What an adapter may be called: a file or folder name in the store, never a path.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_name(field_name: str, name: str, kind: str = "adapter") -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidInput(field_name, f"{shorten(name)} is not a valid {kind} name "
                                       "(letters, digits, '_', '.', '-'; at most 128; no paths)")
    return name


def decode_control_image(data: bytes, max_pixels: int, index: int):
    """PNG/JPEG bytes -> RGB PIL image, refusing what is over `max_pixels` before decoding it."""
    return decode_image(data, f"control_images[{index}]", max_pixels).convert("RGB")


def _floats(values: Sequence[float] | None, n: int, default: float, field: str, lo: float, hi: float) -> list[float]:
    if values is None or len(values) == 0:
        return [default] * n
    if len(values) != n:
        raise InvalidInput(field, f"has {len(values)} values for {n} names")
    out = [float(v) for v in values]
    for i, v in enumerate(out):
        if not (lo <= v <= hi) or math.isnan(v):
            raise InvalidInput(f"{field}[{i}]", f"{v:g} is outside [{lo:g}, {hi:g}]")
    return out


def validate_controls(names: Sequence[bytes] | None, images: Sequence[bytes] | None,
                      scales: Sequence[float] | None, starts: Sequence[float] | None,
                      ends: Sequence[float] | None, max_controlnets: int, max_pixels: int) -> list[ControlParams]:
    names = [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in (names or [])]
    images = list(images or [])
    if len(names) > max_controlnets:
        raise InvalidInput("controlnets", f"{len(names)} given, over the limit of {max_controlnets}")
    if len(images) != len(names):
        raise InvalidInput("control_images", f"has {len(images)} images for {len(names)} controlnets")
    for i, name in enumerate(names):
        check_name(f"controlnets[{i}]", name)
    for i, data in enumerate(images):
        decode_control_image(data, max_pixels, i)
    n = len(names)
    scales = _floats(scales, n, 1.0, "control_scales", 0.0, MAX_SCALE)
    starts = _floats(starts, n, 0.0, "control_guidance_start", 0.0, 1.0)
    ends = _floats(ends, n, 1.0, "control_guidance_end", 0.0, 1.0)
    for i, (s, e) in enumerate(zip(starts, ends)):
        if s >= e:
            raise InvalidInput(f"control_guidance_start[{i}]", f"{s:g} is not below control_guidance_end {e:g}")
    return [ControlParams(*args) for args in zip(names, scales, starts, ends)]


def validate_request(raw: Mapping[str, Any], limits: Limits) -> GenerateParams:
    """The whole public request: scalars (None where absent), the ControlNet and LoRA lists, and
    an edit's template and mask (their size is the request's unless it names another)."""
    raw, edit = edit_defaults(raw, limits)
    params = validate(raw, limits)
    if edit is not None:
        edit.check(params.width, params.height)
    controls = validate_controls(raw.get("controlnets"), raw.get("control_images"), raw.get("control_scales"),
                                 raw.get("control_guidance_start"), raw.get("control_guidance_end"),
                                 limits.max_controlnets, limits.max_control_image_pixels)
    loras = validate_loras(raw.get("loras"), raw.get("lora_scales"), limits.max_loras)
    template = _template(raw.get("template"), params)
    return dataclasses.replace(params, controls=tuple(controls), loras=tuple(loras), template=template)


def _template(name, params: GenerateParams) -> str | None:
    if name is None:
        return None
    if params.strength is None:
        raise InvalidInput("template", "is for edits: give image and mask_image too")
    return check_name("template", name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name),
                      "template")


def validate_loras(names: Sequence[bytes] | None, scales: Sequence[float] | None, max_loras: int) -> list[LoraParams]:
    names = [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in (names or [])]
    if len(names) > max_loras:
        raise InvalidInput("loras", f"{len(names)} given, over the limit of {max_loras}")
    if len(set(names)) != len(names):
        raise InvalidInput("loras", "names a LoRA twice")
    for i, name in enumerate(names):
        check_name(f"loras[{i}]", name)
    scales = _floats(scales, len(names), 1.0, "lora_scales", -MAX_LORA_SCALE, MAX_LORA_SCALE)
    return [LoraParams(n, s) for n, s in zip(names, scales)]


# A params JSON bigger than this is refused before it is parsed: two prompts at their limit
# plus the adapters' names and the stage timings fit many times over.
MAX_PARAMS_BYTES = 1 << 18


def checked_params(data: bytes | str, limits: Limits) -> GenerateParams:
    """The params an internal model received, checked again against the deployment's limits.

    Triton cannot hide the internal models (denoiser, text_encoder, vae_decoder): a
    client may call any of them with params preprocess never saw. So every model parses its
    params here, and they pass the same rules as a public request."""
    if len(data) > MAX_PARAMS_BYTES:
        raise InvalidInput("params", f"is {len(data)} bytes, over the limit of {MAX_PARAMS_BYTES}")
    try:
        params = GenerateParams.from_json(data)
    except (ValueError, TypeError, AttributeError) as exc:  # bad JSON, unknown keys, wrong shapes
        raise InvalidInput("params", f"is not valid ({shorten(str(exc))})") from None
    if not isinstance(params.trace, dict):
        raise InvalidInput("params.trace", "is not an object")
    raw = {f: getattr(params, f) for f in ("prompt", "negative_prompt", "width", "height", "steps",
                                           "guidance_scale", "seed", "scheduler", "output_format", "quality",
                                           "strength")}
    for name in ("width", "height", "steps", "seed", "quality"):  # JSON floats or strings are not integers
        if raw[name] is not None and (isinstance(raw[name], bool) or not isinstance(raw[name], int)):
            raise InvalidInput(name, f"{shorten(raw[name])} is not an integer")
    if raw["seed"] is None:
        raise InvalidInput("seed", "is required")
    try:
        checked = validate(raw, limits)
        controls = [dataclasses.replace(c, name=check_name(f"controlnets[{i}]", c.name)) for i, c in
                    enumerate(params.controls)]
        if len(controls) > limits.max_controlnets:
            raise InvalidInput("controlnets", f"{len(controls)} given, over the limit of {limits.max_controlnets}")
        n = len(controls)
        _floats([c.scale for c in controls], n, 1.0, "control_scales", 0.0, MAX_SCALE)
        starts = _floats([c.guidance_start for c in controls], n, 0.0, "control_guidance_start", 0.0, 1.0)
        ends = _floats([c.guidance_end for c in controls], n, 1.0, "control_guidance_end", 0.0, 1.0)
        for i, (s, e) in enumerate(zip(starts, ends)):
            if s >= e:
                raise InvalidInput(f"control_guidance_start[{i}]", f"{s:g} is not below control_guidance_end {e:g}")
        validate_loras([lora.name for lora in params.loras], [lora.scale for lora in params.loras], limits.max_loras)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidInput):
            raise
        raise InvalidInput("params", f"has a value of the wrong type ({shorten(str(exc))})") from None
    _template(params.template, checked)
    return dataclasses.replace(params, **{f: getattr(checked, f) for f in raw})
