"""`easel` command line: serve a model repository, generate images, export models.

Kept free of torch/diffusers: `tiny`, `export`, `profile-lora` and `profile-template` are forwarded
to `export.cli`, imported only when one of them runs.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from clients.triton_install import DEFAULT_CUDA_POOL_MIB

OUTPUT_FORMATS = ("png", "jpeg", "webp")
EXTENSION_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}

EXPORT_COMMANDS = {
    "tiny": "build the tiny random SDXL demo pipeline (CPU)",
    "export": "export a diffusers pipeline into a Triton model repository",
    "profile-lora": "measure LoRA adapter cost",
    "profile-template": "measure where template edits' reuse pays, per transformer block",
}


def parse_size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected WIDTHxHEIGHT, e.g. 1024x1024")
    width, height = int(m[1]), int(m[2])
    if width <= 0 or height <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: both sides must be > 0")
    return width, height


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="easel",
        description="Serve SDXL text-to-image on NVIDIA Triton and talk to it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser(
        "serve", help="run tritonserver on a model repository",
        description="Start tritonserver on REPO and wait until every model is ready. "
                    "In the foreground (default) the server log streams to stderr and "
                    "Ctrl-C stops the server; --detach returns once ready and prints "
                    "EASEL_SERVER_PID=... / EASEL_SERVER_LOG=... lines.")
    s.add_argument("--repo", required=True, type=Path, help="Triton model repository")
    s.add_argument("--http-port", type=int, default=8000, help="default: %(default)s")
    s.add_argument("--grpc-port", type=int, default=8001, help="default: %(default)s")
    s.add_argument("--metrics-port", type=int, default=8002, help="default: %(default)s")
    s.add_argument("--detach", action="store_true",
                   help="return once ready and leave the server running")
    s.add_argument("--pid-file", type=Path, help="with --detach: write the server pid here")
    s.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait for readiness before giving up (default: %(default)s)")
    s.add_argument("--log-verbose", type=int, default=0, metavar="N",
                   help="tritonserver --log-verbose level (default: %(default)s)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds to let admitted requests finish "
                        "(default: %(default)s)")
    s.add_argument("--admin-key-file", type=Path, metavar="FILE",
                   help="file holding the admin key that opens the restricted APIs (client "
                        "shared memory, logging, tracing, model repository) to requests with "
                        "header easel-admin-key; or set EASEL_ADMIN_KEY. Without either they "
                        "stay closed. Statistics stay open: perf_analyzer reads them, and the "
                        "metrics port publishes the same counters")
    s.add_argument("--max-restarts", type=int, metavar="N",
                   help="stop once tritonserver (or the OpenAI API) needed N restarts within ten "
                        "minutes (default: keep restarting, waiting up to 60 s between restarts)")
    s.add_argument("--cuda-pool-mib", type=int, default=DEFAULT_CUDA_POOL_MIB, metavar="MIB",
                   help="Triton's CUDA memory pool on each GPU the repository uses, where "
                        "ControlNet residuals cross between models without allocations "
                        "(default: %(default)s; 0: tritonserver's own 64 MiB)")
    s.add_argument("--no-grpc-front", action="store_true",
                   help="let clients reach tritonserver's gRPC port directly instead of through "
                        "Easel's front, which drops the triton_grpc_error header (it crashes "
                        "Triton 2.51): only behind a proxy of your own that drops it")
    s.add_argument("--openai-port", type=int, metavar="PORT",
                   help="also serve the OpenAI images API (easel openai) on PORT, started once "
                        "the server is ready and stopped after its drain; foreground only")

    g = sub.add_parser(
        "generate", help="generate one image from a prompt",
        description="Send one text-to-image request and write the image (PNG, JPEG or WebP), "
                    "with a progress bar of its denoising steps: over gRPC (the default) through "
                    "the streaming model `easel_stream`, else (HTTP, --no-stream, a repository "
                    "without it) through the unary `easel`. Options left out use the "
                    "deployment's defaults.")
    g.add_argument("prompt", help="text prompt")
    g.add_argument("-o", "--output", required=True, type=Path, help="where to write the image")
    g.add_argument("--negative", metavar="TEXT", help="negative prompt")
    g.add_argument("--url", metavar="HOST:PORT",
                   help="server address (default: localhost:8001 for grpc, localhost:8000 for http)")
    g.add_argument("--protocol", choices=("http", "grpc"), default="grpc",
                   help="default: %(default)s (only gRPC streams progress)")
    g.add_argument("--no-stream", action="store_true",
                   help="send to the unary model even where easel_stream is there (a spinner, no steps)")
    g.add_argument("--model", default="easel", help="model name (default: %(default)s)")
    g.add_argument("--size", type=parse_size, metavar="WxH", help="image size, e.g. 1024x1024")
    g.add_argument("--steps", type=int, help="denoising steps")
    g.add_argument("--seed", type=int, help="random seed (default: random; see info)")
    g.add_argument("--guidance", type=float, metavar="G", help="classifier-free guidance scale")
    g.add_argument("--scheduler", metavar="NAME", help="sampler, e.g. euler, euler_a, ddim")
    g.add_argument("--timeout", type=float, metavar="S", help="request timeout in seconds")
    g.add_argument("--format", choices=OUTPUT_FORMATS, dest="output_format",
                   help="image format (default: from the -o extension .png/.jpg/.jpeg/.webp, else png)")
    g.add_argument("--quality", type=int, metavar="N", help="jpeg/webp quality, 1-100 (server default: 90)")
    g.add_argument("--controlnet", action="append", type=parse_controlnet, default=[],
                   metavar="NAME:IMAGE[:SCALE]", help="a ControlNet and its control image (repeatable)")
    g.add_argument("--lora", action="append", type=parse_lora, default=[], metavar="NAME[:SCALE]",
                   help="a LoRA from the adapter store (repeatable)")
    g.add_argument("--image", type=Path, metavar="PNG",
                   help="edit this template (inpainting; with --mask): the image is its size unless --size")
    g.add_argument("--mask", type=Path, metavar="PNG", help="the edit's mask: 255 (white) repaints, 0 keeps")
    g.add_argument("--strength", type=float, metavar="S",
                   help="how far the template is noised, (0, 1] (server default: 0.9999, diffusers')")
    g.add_argument("--template", metavar="NAME",
                   help="the edit's template name: later edits of it reuse this one's activations (approximate)")

    o = sub.add_parser(
        "openai", help="serve the OpenAI images API in front of a Triton server",
        description="Serve POST /v1/images/generations, POST /v1/images/edits and GET /v1/models "
                    "(OpenAI images API, response_format b64_json; Easel's steps, seed, guidance_scale, "
                    "negative_prompt, scheduler, output_format, loras, controlnets (generations) and "
                    "strength (edits) as extra fields), forwarding each image to the `easel` model over gRPC.")
    o.add_argument("--triton", default="localhost:8001", metavar="HOST:PORT",
                   help="Triton's gRPC address (default: %(default)s)")
    o.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    o.add_argument("--port", type=int, default=8080, help="default: %(default)s")
    o.add_argument("--model", default="easel", help="Triton model, and the API's model id "
                                                    "(default: %(default)s)")
    o.add_argument("--max-n", type=int, default=4, metavar="N",
                   help="most images per request (default: %(default)s)")
    o.add_argument("--timeout", type=float, metavar="S",
                   help="each image's deadline in seconds (default: the client's, 3600)")
    o.add_argument("--max-body-mib", type=float, default=32.0, metavar="MIB",
                   help="a request body's limit; past it: 413 (default: %(default)s)")
    o.add_argument("--docs", action="store_true", help="also serve /docs and /openapi.json")

    for name, text in EXPORT_COMMANDS.items():
        # Parsed by export.cli; registered here only so `easel --help` lists them.
        sub.add_parser(name, help=text, add_help=False)
    # Parsed by clients/bench/harness.py (GPU machine; --cpu-smoke anywhere).
    sub.add_parser("bench", help="Easel against diffusers eager/compiled in one run: latency, throughput, "
                                 "stages, PSNR, cold start", add_help=False)
    return parser


class Spinner:
    """Elapsed-time spinner on stderr; silent when stderr is not a terminal."""

    FRAMES = "|/-\\"

    def __init__(self, label: str, stream=None):
        self.label = label
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_time = 0.0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start_time

    def __enter__(self) -> "Spinner":
        self.start_time = time.monotonic()
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            print(f"{self.label}...", file=self.stream, flush=True)
        return self

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(0.1):
            frame = self.FRAMES[i % len(self.FRAMES)]
            self.stream.write(f"\r{frame} {self.label} {self.elapsed:5.1f}s")
            self.stream.flush()
            i += 1

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.stream.write("\r\033[K")
            self.stream.flush()


class ProgressBar:
    """The denoising steps of a streamed request on stderr: redrawn in place on a terminal, one
    line per step elsewhere (a log shows how the request went)."""

    WIDTH = 30

    def __init__(self, label: str, stream=None):
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start_time = 0.0
        self.drawn = False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start_time

    def __enter__(self) -> "ProgressBar":
        self.start_time = time.monotonic()
        print(f"{self.label}...", file=self.stream, flush=True)
        return self

    def update(self, step: int, steps: int) -> None:
        filled = self.WIDTH * step // max(steps, 1)
        line = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {step}/{steps} steps {self.elapsed:5.1f}s"
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.stream.flush()
        self.drawn = True

    def __exit__(self, *exc) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _seconds(value) -> str:
    return f"{value:.2f}s" if isinstance(value, (int, float)) else "?"


def format_info(info: dict, elapsed: float) -> str:
    """Two lines: the parameters used, then wall/stage timings from `info`."""
    params = " ".join(f"{k}={info[k]}" for k in ("seed", "steps", "scheduler",
                                                  "guidance_scale") if k in info)
    if "width" in info and "height" in info:
        params += f" size={info['width']}x{info['height']}"
    stages = info.get("stages_s") or {}
    timing = f"client {elapsed:.2f}s"
    if info.get("total_s") is not None:
        timing += f", server {_seconds(info['total_s'])}"
    if info.get("queue_s") is not None:
        timing += f", queue {_seconds(info['queue_s'])}"
    if isinstance(stages, dict) and stages:
        parts = [f"{k.removesuffix('_s')} {_seconds(v)}" for k, v in stages.items()]
        timing += " | " + ", ".join(parts)
    return (params + "\n" if params else "") + timing


def cmd_serve(args: argparse.Namespace) -> int:
    from clients.serve import serve

    if args.pid_file and not args.detach:
        print("easel serve: --pid-file needs --detach", file=sys.stderr)
        return 2
    if args.max_restarts is not None and args.max_restarts < 0:
        print("easel serve: --max-restarts must be 0 or more", file=sys.stderr)
        return 2
    if args.cuda_pool_mib < 0:
        print("easel serve: --cuda-pool-mib must be 0 or more", file=sys.stderr)
        return 2
    try:
        admin_key = (args.admin_key_file.read_text().strip() if args.admin_key_file
                     else os.environ.get("EASEL_ADMIN_KEY") or None)
        return serve(args.repo, args.http_port, args.grpc_port, args.metrics_port,
                     args.log_verbose, foreground=not args.detach,
                     timeout=args.timeout, pid_file=args.pid_file,
                     drain_timeout=args.drain_timeout, admin_key=admin_key,
                     openai_port=args.openai_port, max_restarts=args.max_restarts,
                     grpc_front=not args.no_grpc_front, cuda_pool_mib=args.cuda_pool_mib)
    except (FileNotFoundError, ValueError) as e:
        print(f"easel serve: {e}", file=sys.stderr)
        return 1


def cmd_openai(args: argparse.Namespace) -> int:
    from clients.openai_api import run

    if args.max_n < 1:
        print("easel openai: --max-n must be at least 1", file=sys.stderr)
        return 2
    if not args.max_body_mib > 0:
        print("easel openai: --max-body-mib must be positive", file=sys.stderr)
        return 2
    run(args.triton, host=args.host, port=args.port, model=args.model, max_n=args.max_n,
        timeout_s=args.timeout, max_body_bytes=int(args.max_body_mib * 2**20), docs=args.docs)
    return 0


def parse_controlnet(text: str) -> tuple[str, Path, float]:
    """'depth:depth.png' or 'depth:depth.png:0.8' -> (name, image path, scale)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise argparse.ArgumentTypeError(f"--controlnet: {text!r} is not NAME:IMAGE[:SCALE]")
    try:
        scale = float(parts[2]) if len(parts) == 3 else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"--controlnet: scale {parts[2]!r} is not a number") from None
    return parts[0], Path(parts[1]), scale


def parse_lora(text: str) -> tuple[str, float]:
    """'papercut' or 'papercut:0.8' -> (name, scale)."""
    name, _, scale = text.partition(":")
    try:
        return name, float(scale) if scale else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lora: scale {scale!r} is not a number") from None


def output_format(args: argparse.Namespace) -> str:
    """--format, else the one the -o file's extension names, else png."""
    return args.output_format or EXTENSION_FORMATS.get(args.output.suffix.lower(), "png")


def generate_kwargs(args: argparse.Namespace) -> dict:
    """EaselClient.generate keyword arguments from parsed `generate` options."""
    width, height = args.size if args.size else (None, None)
    fmt = output_format(args)
    kwargs = dict(prompt=args.prompt, negative_prompt=args.negative, width=width,
                  height=height, steps=args.steps, guidance_scale=args.guidance,
                  seed=args.seed, scheduler=args.scheduler, timeout_s=args.timeout,
                  # png is the server's default: sent only when asked for by name
                  output_format=fmt if args.output_format or fmt != "png" else None,
                  quality=args.quality)
    if args.controlnet:
        names, images, scales = zip(*args.controlnet)
        kwargs.update(controlnets=names, control_images=tuple(p.read_bytes() for p in images),
                      control_scales=scales)
    if args.lora:
        names, scales = zip(*args.lora)
        kwargs.update(loras=names, lora_scales=scales)
    if args.image or args.mask:
        kwargs.update(image=args.image.read_bytes() if args.image else None,
                      mask_image=args.mask.read_bytes() if args.mask else None)
    if args.strength is not None:
        kwargs.update(strength=args.strength)
    if args.template is not None:
        kwargs.update(template=args.template)
    return kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from clients.client import EaselClient, EaselError

    named = EXTENSION_FORMATS.get(args.output.suffix.lower())
    if named and named != output_format(args):
        print(f"easel generate: note: writing {output_format(args)} into {args.output}", file=sys.stderr)
    try:
        with EaselClient(args.url, args.protocol, args.model) as client:
            if args.model == "easel" and not args.no_stream and client.can_stream():
                result, elapsed = _generate_streaming(client, args)
            else:
                with Spinner(f"generating on {client.url} ({args.protocol})") as spin:
                    result = client.generate(**generate_kwargs(args))
                elapsed = spin.elapsed
    except EaselError as e:
        print(f"easel generate: server error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a stream was cancelled on the server too (see _generate_streaming)
        print("\neasel generate: cancelled", file=sys.stderr)
        return 130
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result.save(args.output)
    print(f"wrote {args.output} ({len(result.png) / 1024:.1f} kB)", file=sys.stderr)
    print(format_info(result.info, elapsed), file=sys.stderr)
    return 0


def _generate_streaming(client, args: argparse.Namespace):
    """(result, seconds) through easel_stream, drawing each step; Ctrl-C cancels the request on
    the server too (closing the stream stops its denoising at the next step)."""
    from contextlib import closing

    from clients.client import EaselError, GenerateRequest, GenerateResult

    kwargs = generate_kwargs(args)
    timeout_s = kwargs.pop("timeout_s")
    with ProgressBar(f"generating on {client.url} (grpc, streaming)") as bar:
        with closing(client.stream(GenerateRequest(**kwargs), timeout_s=timeout_s)) as events:
            for event in events:
                if isinstance(event, GenerateResult):
                    return event, bar.elapsed
                bar.update(event.step, event.steps)
    raise EaselError("the stream ended without an image")


def forward_to_export(command: str, rest: Sequence[str]) -> int:
    try:
        export_cli = importlib.import_module("export.cli")
    except ModuleNotFoundError as e:
        if e.name not in ("export.cli", "export"):
            raise  # export.cli exists but a dependency of it is missing
        print(f"easel {command}: export.cli is not available in this checkout "
              "(the export tooling is not installed yet)", file=sys.stderr)
        return 1
    code = export_cli.main([command, *rest])
    return int(code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Export subcommands own their options; forward them untouched.
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in EXPORT_COMMANDS:
        i = argv.index(first)
        if all(a in ("-v", "--verbose") for a in argv[:i]):
            logging.basicConfig(level=logging.DEBUG if argv[:i] else logging.INFO,
                                format="%(levelname)s %(name)s: %(message)s")
            return forward_to_export(first, argv[i + 1:])

    if first == "bench" and argv.index(first) == 0:
        from clients.bench.harness import main as bench_main

        return int(bench_main(argv[1:]) or 0)

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "openai":
        return cmd_openai(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
