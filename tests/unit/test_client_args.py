"""CLI parsing and request building, without a server."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from clients import cli
from clients.client import (EaselClient, EaselError, GenerateRequest, build_inputs,
                            parse_result, stream_error)


def _generate_args(*extra: str):
    return cli.build_parser().parse_args(["generate", "a cat", "-o", "out.png", *extra])


def test_size_parses():
    args = _generate_args("--size", "64x96")
    assert args.size == (64, 96)
    kw = cli.generate_kwargs(args)
    assert (kw["width"], kw["height"]) == (64, 96)


@pytest.mark.parametrize("bad", ["64", "64x", "x96", "64*96", "-64x96", "0x64", "axb"])
def test_bad_size_message(bad, capsys):
    with pytest.raises(SystemExit) as info:
        _generate_args(f"--size={bad}")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--size" in err and "WIDTHxHEIGHT" in err or "must be > 0" in err


def test_generate_defaults_leave_options_unset():
    args = _generate_args()
    assert args.protocol == "grpc" and args.url is None and args.model == "easel" and not args.no_stream
    kw = cli.generate_kwargs(args)
    assert kw["prompt"] == "a cat"
    assert all(kw[k] is None for k in kw if k != "prompt")


def test_generate_options():
    args = _generate_args("--negative", "blurry", "--protocol", "grpc", "--steps", "4",
                          "--seed", "7", "--guidance", "2.5", "--scheduler", "euler",
                          "--url", "h:9")
    kw = cli.generate_kwargs(args)
    assert kw["negative_prompt"] == "blurry" and kw["steps"] == 4 and kw["seed"] == 7
    assert kw["guidance_scale"] == 2.5 and kw["scheduler"] == "euler"
    assert args.protocol == "grpc" and args.url == "h:9"


def test_generate_edit_options(tmp_path):
    (tmp_path / "t.png").write_bytes(b"template")
    (tmp_path / "m.png").write_bytes(b"mask")
    args = _generate_args("--image", str(tmp_path / "t.png"), "--mask", str(tmp_path / "m.png"), "--strength", "0.7")
    kw = cli.generate_kwargs(args)
    assert (kw["image"], kw["mask_image"], kw["strength"]) == (b"template", b"mask", 0.7)
    inputs = {i.name(): i for i in build_inputs(GenerateRequest(**{k: v for k, v in kw.items() if k != "timeout_s"}))}
    assert inputs["image"].datatype() == "BYTES" and inputs["strength"].datatype() == "FP32"


def test_serve_args():
    args = cli.build_parser().parse_args(
        ["serve", "--repo", "r", "--http-port", "9000", "--detach", "--timeout", "5"])
    assert (args.http_port, args.grpc_port, args.metrics_port) == (9000, 8001, 8002)
    assert args.detach and args.timeout == 5.0 and args.log_verbose == 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_only_set_inputs_are_sent(protocol):
    inputs = build_inputs(GenerateRequest("a cat", seed=3, width=64), protocol)
    names = [i.name() for i in inputs]
    assert names == ["prompt", "width", "seed"]
    assert [i.datatype() for i in inputs] == ["BYTES", "INT32", "INT64"]
    assert all(list(i.shape()) == [1] for i in inputs)


def test_all_inputs_typed():
    req = GenerateRequest("p", "n", 64, 96, 4, 5.0, 2**40, "euler")
    inputs = build_inputs(req, "http")
    assert [(i.name(), i.datatype()) for i in inputs] == [
        ("prompt", "BYTES"), ("negative_prompt", "BYTES"), ("width", "INT32"),
        ("height", "INT32"), ("steps", "INT32"), ("guidance_scale", "FP32"),
        ("seed", "INT64"), ("scheduler", "BYTES")]


def test_default_urls():
    assert EaselClient(protocol="http").url == "localhost:8000"
    assert EaselClient(protocol="grpc").url == "localhost:8001"
    with pytest.raises(ValueError):
        EaselClient(protocol="ftp")


def test_unreachable_server_raises_easel_error():
    with pytest.raises(EaselError):
        EaselClient("127.0.0.1:1", timeout_s=5).generate("a cat")


@pytest.mark.parametrize("message, status, expected", [
    # easel_stream's own errors: the status heads the message (backends/triton/adapter.py)
    ("INVALID_ARGUMENT: width: 60 is not a multiple of 8", None,
     ("width: 60 is not a multiple of 8", "StatusCode.INVALID_ARGUMENT")),
    ("NOT_FOUND: loras: unknown LoRA 'x'", None, ("loras: unknown LoRA 'x'", "StatusCode.NOT_FOUND")),
    ("INTERNAL: easel_stream: boom\nsecond line", None, ("easel_stream: boom\nsecond line", "StatusCode.INTERNAL")),
    # Triton's own in-band errors name no status; a stream that ended with one keeps it
    ("unexpected datatype TYPE_FP32 for input 'seed'", None, ("unexpected datatype TYPE_FP32 for input 'seed'", None)),
    ("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED", ("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED")),
    ("Invalid: not a status", None, ("Invalid: not a status", None)),
])
def test_a_streams_error_takes_the_status_its_message_names(message, status, expected):
    from tritonclient.utils import InferenceServerException

    err = stream_error(InferenceServerException(message, status=status))
    assert (str(err), err.status) == expected


def test_parse_result():
    png = b"\x89PNG fake"
    info = json.dumps({"seed": 1, "stages_s": {"unet_s": 1.5}}).encode()
    result = parse_result(np.array([png], dtype=np.object_), np.array([info], dtype=np.object_))
    assert result.png == png and result.info["seed"] == 1
    text = cli.format_info(result.info, 2.0)
    assert "seed=1" in text and "unet 1.50s" in text


def test_export_commands_forward(monkeypatch):
    import types

    calls = []
    fake = types.ModuleType("export.cli")
    fake.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "export.cli", fake)
    assert cli.main(["tiny", "--out", "x", "--help"]) == 0
    assert calls == [["tiny", "--out", "x", "--help"]]


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "clients.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for name in ("serve", "generate", "tiny", "export", "profile-lora"):
        assert name in out


def test_cli_imports_no_torch():
    code = ("import sys, clients.cli, clients.client, clients.serve, clients.tools; "
            "bad = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_controlnet_option(tmp_path):
    image = tmp_path / "depth.png"
    image.write_bytes(b"png bytes")
    args = cli.build_parser().parse_args(
        ["generate", "x", "-o", "o.png", "--controlnet", f"depth:{image}", "--controlnet", f"canny:{image}:0.5"])
    kw = cli.generate_kwargs(args)
    assert kw["controlnets"] == ("depth", "canny") and kw["control_scales"] == (1.0, 0.5)
    assert kw["control_images"] == (b"png bytes", b"png bytes")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "-o", "o.png", "--controlnet", "depth"])


@pytest.mark.parametrize("output, extra, sent", [
    ("out.png", [], None),  # png is the server's default: nothing sent, as before
    ("out", [], None),
    ("out.tiff", [], None),
    ("out.jpg", [], "jpeg"),
    ("OUT.JPEG", [], "jpeg"),
    ("out.webp", [], "webp"),
    ("out.png", ["--format", "png"], "png"),
    ("out.png", ["--format", "webp"], "webp"),
    ("out.jpg", ["--format", "png"], "png"),
])
def test_output_format_from_option_or_extension(output, extra, sent):
    args = cli.build_parser().parse_args(["generate", "a cat", "-o", output, *extra])
    kw = cli.generate_kwargs(args)
    assert kw["output_format"] == sent and kw["quality"] is None


def test_quality_option():
    args = cli.build_parser().parse_args(["generate", "a cat", "-o", "o.jpg", "--quality", "75"])
    kw = cli.generate_kwargs(args)
    assert (kw["output_format"], kw["quality"]) == ("jpeg", 75)


def test_unknown_format_option_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        _generate_args("--format", "gif")
    assert info.value.code == 2 and "--format" in capsys.readouterr().err


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_output_format_inputs_are_typed(protocol):
    inputs = build_inputs(GenerateRequest("a cat", output_format="webp", quality=80), protocol)
    assert [(i.name(), i.datatype()) for i in inputs] == [
        ("prompt", "BYTES"), ("output_format", "BYTES"), ("quality", "INT32")]


def test_generate_sends_format_and_quality_only_when_given(monkeypatch):
    sent = []
    monkeypatch.setattr(EaselClient, "run", lambda self, request, timeout_s=None: sent.append(request))
    client = EaselClient(protocol="http")
    client.generate("a cat", seed=1)
    client.generate("a cat", output_format="jpeg", quality=70)
    assert (sent[0].output_format, sent[0].quality) == (None, None)
    assert (sent[1].output_format, sent[1].quality) == ("jpeg", 70)
