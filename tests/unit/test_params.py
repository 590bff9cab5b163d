"""backends/core/request/params.py: request validation against Limits, and the JSON the params travel in."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from backends.core.request.params import (MAX_SEED, SCHEDULER_NAMES, GenerateParams, InvalidInput, Limits,
                                  validate)

LIMITS = Limits(default_width=512, default_height=768, max_width=1024, max_height=896, min_size=64,
                size_multiple=8, default_steps=25, max_steps=60, default_guidance_scale=6.5,
                max_guidance_scale=20.0, default_scheduler="euler", max_prompt_bytes=40)


def raw(**overrides):
    """A request as preprocess reads it: every input present, None where the client sent nothing."""
    fields = dict(prompt=b"a red cat", negative_prompt=None, width=None, height=None, steps=None,
                  guidance_scale=None, seed=None, scheduler=None, output_format=None, quality=None)
    fields.update(overrides)
    return fields


def invalid(field: str, *fragments: str, **overrides) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        validate(raw(**overrides), LIMITS)
    exc = info.value
    assert exc.field == field
    message = str(exc)
    assert message.startswith(f"{field}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return exc


def test_defaults_come_from_the_limits():
    p = validate(raw(seed=3), LIMITS)
    assert (p.prompt, p.negative_prompt) == ("a red cat", None)
    assert (p.width, p.height, p.steps) == (512, 768, 25)
    assert p.guidance_scale == 6.5 and p.cfg
    assert (p.seed, p.scheduler, p.trace) == (3, "euler", {})


def test_missing_seed_is_drawn_at_random_and_in_range():
    seeds = {validate(raw(), LIMITS).seed for _ in range(20)}
    assert len(seeds) > 1
    assert all(0 <= s <= MAX_SEED for s in seeds)


def test_explicit_values_are_kept():
    p = validate(raw(prompt="str prompt", negative_prompt=b"blurry", width=1024, height=64, steps=60,
                     guidance_scale=0.0, seed=MAX_SEED, scheduler=b"dpmpp_2m_karras"), LIMITS)
    assert (p.prompt, p.negative_prompt, p.width, p.height, p.steps) == ("str prompt", "blurry", 1024, 64, 60)
    assert (p.guidance_scale, p.seed, p.scheduler) == (0.0, MAX_SEED, "dpmpp_2m_karras")
    assert not p.cfg  # diffusers runs CFG only for guidance_scale > 1
    assert not validate(raw(guidance_scale=1.0), LIMITS).cfg
    assert validate(raw(guidance_scale=1.01), LIMITS).cfg


def test_every_scheduler_name_is_accepted():
    for name in SCHEDULER_NAMES:
        assert validate(raw(scheduler=name.encode()), LIMITS).scheduler == name


def test_empty_negative_prompt_is_kept_distinct_from_none():
    assert validate(raw(negative_prompt=b""), LIMITS).negative_prompt == ""


def test_unicode_prompt_is_decoded():
    assert validate(raw(prompt="café ☕".encode()), LIMITS).prompt == "café ☕"


def test_prompt_is_required():
    invalid("prompt", "required", prompt=None)


@pytest.mark.parametrize("name", ["width", "height"])
@pytest.mark.parametrize("value", [100, 65, 1020])
def test_size_not_a_multiple(name, value):
    invalid(name, str(value), "multiple of 8", **{name: value})


@pytest.mark.parametrize("name,maximum", [("width", 1024), ("height", 896)])
def test_size_under_min_or_over_max(name, maximum):
    invalid(name, "56", "[64, %d]" % maximum, **{name: 56})
    invalid(name, "0", "[64, %d]" % maximum, **{name: 0})
    invalid(name, str(maximum + 8), "[64, %d]" % maximum, **{name: maximum + 8})
    assert getattr(validate(raw(**{name: maximum}), LIMITS), name) == maximum
    assert getattr(validate(raw(**{name: 64}), LIMITS), name) == 64


@pytest.mark.parametrize("steps", [0, -1, 61, 10_000])
def test_steps_out_of_range(steps):
    invalid("steps", str(steps), "[1, 60]", steps=steps)


def test_steps_bounds_are_inclusive():
    assert validate(raw(steps=1), LIMITS).steps == 1
    assert validate(raw(steps=60), LIMITS).steps == 60


@pytest.mark.parametrize("guidance", [-0.5, 20.5, math.inf, -math.inf])
def test_guidance_out_of_range(guidance):
    invalid("guidance_scale", str(guidance), "[0, 20.0]", guidance_scale=guidance)


def test_nan_guidance_is_refused():
    invalid("guidance_scale", "nan", "[0, 20.0]", guidance_scale=math.nan)


def test_unknown_scheduler_lists_the_allowed_names():
    exc = invalid("scheduler", "'lms'", scheduler=b"lms")
    assert "allowed: " + ", ".join(SCHEDULER_NAMES) in str(exc)


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64])
def test_seed_out_of_range(seed):
    invalid("seed", str(seed), f"[0, {MAX_SEED}]", seed=seed)


@pytest.mark.parametrize("name", ["prompt", "negative_prompt"])
def test_prompt_over_max_bytes(name):
    invalid(name, "41 bytes", "limit of 40", **{name: b"x" * 41})
    assert getattr(validate(raw(**{name: b"x" * 40}), LIMITS), name) == "x" * 40
    # the limit counts bytes, not characters: 14 three-byte characters are 42 bytes
    invalid(name, "42 bytes", "limit of 40", **{name: "☕".encode() * 14})


@pytest.mark.parametrize("name", ["prompt", "negative_prompt", "scheduler"])
def test_invalid_utf8(name):
    invalid(name, "UTF-8", **{name: b"\xff\xfe cat"})


def test_invalid_input_is_a_value_error():
    assert issubclass(InvalidInput, ValueError)


# --- JSON ---


def test_generate_params_json_round_trip():
    p = validate(raw(prompt="café ☕".encode(), negative_prompt=b"", seed=MAX_SEED, guidance_scale=7.25,
                     scheduler=b"euler_a", width=72, height=888), LIMITS)
    p = p.with_trace(received_at=1234.5, stages={"text": [0.1, 0.2]})
    data = p.to_json()
    assert isinstance(data, bytes)
    back = GenerateParams.from_json(data)
    assert back == p
    assert GenerateParams.from_json(data.decode()) == p
    assert type(back.seed) is int and back.seed == MAX_SEED


def test_with_trace_merges_and_does_not_mutate():
    p = validate(raw(seed=1), LIMITS)
    q = p.with_trace(a=1).with_trace(b=2, a=3)
    assert q.trace == {"a": 3, "b": 2} and p.trace == {}


def test_generate_params_from_json_rejects_unknown_keys():
    data = json.loads(validate(raw(seed=1), LIMITS).to_json())
    data["strenght"] = 0.5
    with pytest.raises(ValueError, match=r"params: unknown keys \['strenght'\]"):
        GenerateParams.from_json(json.dumps(data))


def test_limits_json_round_trip():
    assert Limits.from_json(LIMITS.to_json()) == LIMITS
    assert Limits.from_json("{}") == Limits()
    assert Limits.from_json('{"max_steps": 7}') == dataclasses.replace(Limits(), max_steps=7)


def test_limits_from_json_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"limits: unknown keys \['max_widht'\]") as info:
        Limits.from_json('{"max_widht": 10, "max_width": 10}')
    assert "max_width" in str(info.value)  # the allowed names are listed


def test_prompt_limit_also_applies_to_str_prompts():
    invalid("prompt", "41 bytes", "limit of 40", prompt="x" * 41)


# --- output format and quality ---


def test_output_format_defaults_to_png_without_quality():
    p = validate(raw(seed=1), LIMITS)
    assert (p.output_format, p.quality) == ("png", None)
    assert validate(raw(output_format=b""), LIMITS).output_format == "png"  # empty means default, as scheduler


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_every_output_format_is_accepted(fmt):
    assert validate(raw(output_format=fmt.encode()), LIMITS).output_format == fmt


@pytest.mark.parametrize("fmt", [b"gif", b"jpg", b"PNG", b"png "])
def test_unknown_output_format_lists_the_allowed_values(fmt):
    exc = invalid("output_format", repr(fmt.decode()), output_format=fmt)
    assert "allowed: png, jpeg, webp" in str(exc)


def test_output_format_invalid_utf8():
    invalid("output_format", "UTF-8", output_format=b"\xff")


@pytest.mark.parametrize("fmt", [b"jpeg", b"webp"])
def test_quality_bounds_are_inclusive(fmt):
    for quality in (1, 100, 75):
        p = validate(raw(output_format=fmt, quality=quality), LIMITS)
        assert p.quality == quality and type(p.quality) is int
    assert validate(raw(output_format=fmt), LIMITS).quality is None


@pytest.mark.parametrize("quality", [0, -5, 101, 2**31 - 1])
def test_quality_out_of_range(quality):
    invalid("quality", str(quality), "[1, 100]", output_format=b"jpeg", quality=quality)


@pytest.mark.parametrize("fmt", [None, b"png"])
def test_quality_is_refused_for_png(fmt):
    invalid("quality", "only for jpeg and webp", output_format=fmt, quality=90)


def test_output_format_survives_the_json_round_trip():
    p = validate(raw(seed=2, output_format=b"webp", quality=80), LIMITS).with_trace(received_at=1.0)
    back = GenerateParams.from_json(p.to_json())
    assert back == p and (back.output_format, back.quality) == ("webp", 80)


def test_params_json_without_the_new_fields_still_reads():
    """JSON written before output_format/quality existed reads back with their defaults."""
    data = json.loads(validate(raw(seed=1), LIMITS).to_json())
    del data["output_format"], data["quality"]
    back = GenerateParams.from_json(json.dumps(data))
    assert (back.output_format, back.quality) == ("png", None)


# --- params an internal model receives (backends/core/request/adapter_inputs.checked_params) ---

def _params_json(**overrides) -> bytes:
    fields = dict(prompt="a red cat", negative_prompt=None, width=512, height=512, steps=20, guidance_scale=5.0,
                  seed=3, scheduler="euler", controls=[], loras=[], output_format="png", quality=None,
                  trace={"received_at": 1.0})
    fields.update(overrides)
    return json.dumps(fields).encode()


def test_checked_params_pass_what_preprocess_made():
    from backends.core.request.adapter_inputs import checked_params

    p = validate(raw(seed=3, width=512, height=512, steps=20), LIMITS).with_trace(received_at=1.0)
    assert checked_params(p.to_json(), LIMITS) == p


@pytest.mark.parametrize("overrides, expected", [
    (dict(steps=600), "steps: 600 is outside [1, 60]"),
    (dict(width=60), "width: 60 is not a multiple of 8"),
    (dict(seed=-5), "seed: -5 is outside [0, "),
    (dict(seed=None), "seed: is required"),
    (dict(steps=2.5), "steps: 2.5 is not an integer"),
    (dict(width=True), "width: True is not an integer"),
    (dict(prompt="x" * 41), "prompt: is 41 bytes, over the limit of 40"),
    (dict(scheduler="s" * 30), "scheduler: unknown name"),
    (dict(controls=[{"name": "canny", "scale": 99.0}]), "control_scales[0]: 99 is outside [0, 10]"),
    (dict(controls=[{"name": "a/b"}]), "controlnets[0]: 'a/b' is not a valid adapter name"),
    (dict(loras=[{"name": "x", "scale": 9.0}]), "lora_scales[0]: 9 is outside [-4, 4]"),
    (dict(loras=[{"name": f"l{i}"} for i in range(4)]), "loras: 4 given, over the limit of 3"),
    (dict(trace=[1]), "params.trace: is not an object"),
    (dict(colour="red"), "params: is not valid"),
])
def test_checked_params_refuse_what_preprocess_would(overrides, expected):
    from backends.core.request.adapter_inputs import checked_params

    with pytest.raises(InvalidInput) as err:
        checked_params(_params_json(**overrides), LIMITS)
    assert expected in str(err.value), str(err.value)


def test_checked_params_refuse_bad_json_and_huge_params_briefly():
    from backends.core.request.adapter_inputs import MAX_PARAMS_BYTES, checked_params

    with pytest.raises(InvalidInput, match="params: is not valid"):
        checked_params(b"{not json", LIMITS)
    with pytest.raises(InvalidInput, match=f"over the limit of {MAX_PARAMS_BYTES}"):
        checked_params(b" " * (MAX_PARAMS_BYTES + 1), LIMITS)


def test_echoed_values_are_cut_to_about_100_characters():
    with pytest.raises(InvalidInput) as err:
        validate(raw(scheduler="x" * 9000), dataclasses.replace(LIMITS, max_prompt_bytes=16384))
    assert len(str(err.value)) < 250 and "(9000 long)" in str(err.value)


def test_strength_arrives_as_the_clients_decimal():
    """FP32 on the wire: 0.7 arrives as 0.699999988, whose 10 steps would run 6, not diffusers' 7."""
    import numpy as np

    params = validate(raw(seed=1, steps=10, strength=float(np.float32(0.7))), LIMITS)
    assert params.strength == 0.7 and params.denoising_steps == 7
    with pytest.raises(InvalidInput, match=r"strength: 0.05 leaves no step of 10"):
        validate(raw(seed=1, steps=10, strength=0.05), LIMITS)
    with pytest.raises(InvalidInput, match=r"strength: 0 is outside \(0, 1\]"):
        validate(raw(seed=1, strength=0.0), LIMITS)
