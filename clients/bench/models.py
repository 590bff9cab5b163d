"""`easel bench`'s command line, the run's typed settings, the host it runs on, and the helpers
both measured systems share (control images, freeing the GPU between phases)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from clients.triton_install import DEFAULT_CUDA_POOL_MIB
from export.cli import gib_triple, int_list

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"  # the checkout's
PROMPT = "a yellow car"
SCHEDULER = "euler"  # Easel's name for diffusers' EulerDiscreteScheduler, the model's own
WARMUP_STEPS = 3  # warm-up calls: compile, then CUDA-graph record, then a replay (reduce-overhead)
LORA_SCALE = 0.8
LORA_STD = 1e-3
SERVER_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")  # compile caches a phase must not inherit
CONTROLNET_NAMES = ("canny", "depth")  # the ControlNet bench's names (same seeds: same files); then cn<i>


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="easel bench", description=__doc__.splitlines()[0],
        epilog="GPU defaults shown; --cpu-smoke runs the tiny model on CPU at 64 px, 4 steps, 2 runs, concurrency 1,2.")
    p.add_argument("--work", type=Path, default=None,
                   help="models, adapters and repositories (default: <tmp>/easel-bench, reused between runs)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: bench/results/<YYYY-MM-DD>-<gpu>/)")
    p.add_argument("--size", type=int, default=None, help="image width and height in px (1024)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps of the latency requests (50)")
    p.add_argument("--throughput-steps", type=int, default=None, help="steps of the throughput requests (30)")
    p.add_argument("--runs", type=int, default=None, help="timed single requests per system (5)")
    p.add_argument("--concurrency", type=int_list("--concurrency", 0), default=None, help="concurrency levels, comma-separated (1,2,4,8)")
    p.add_argument("--throughput-rounds", type=int, default=None,
                   help="Easel: rounds of c concurrent requests per level (default max(2, 8 // c); smoke 2); "
                        "diffusers makes one batched call per level")
    p.add_argument("--runtime", choices=("eager", "graphs", "compiled"), default=None,
                   help="Easel's UNet runtime (export --runtime; default: export's, compiled on a GPU)")
    p.add_argument("--row-buckets", type=int_list("--row-buckets", 0), default=None,
                   help="Easel: UNet row counts captured at load (default: export's, 2,4,8,16)")
    p.add_argument("--fused-kernels", action="store_true", help="Easel with plugins' fused GroupNorm+SiLU and GEGLU")
    p.add_argument("--vae-dtype", choices=("fp32", "fp16", "bf16"), default=None,
                   help="Easel's VAE dtype (export --vae-dtype; default: diffusers', fp32 for SDXL)")
    p.add_argument("--fp8", type=fp8_parts, default=(),
                   help="Easel's transformer products in FP8 (export --fp8: parts, or all; approximate)")
    p.add_argument("--fp8-fast-accum", action="store_true", help="with --fp8: export --fp8-fast-accum")
    p.add_argument("--controlnets", type=int, default=0, help="ControlNets per request (random SDXL-size ones)")
    p.add_argument("--loras", type=int, default=0, help="LoRAs per request (random SDXL-size ones)")
    p.add_argument("--lora-mib", type=float, default=340.0, help="size of each random LoRA file (fp16)")
    p.add_argument("--configs", type=config_list, default=None,
                   help="several configurations in one run, e.g. 0C/0L,1C/1L,3C/2L (instead of --controlnets "
                        "and --loras); each is measured in turn into the same results")
    p.add_argument("--controlnet-gpus", type=int_list("--controlnet-gpus", 0), default=None,
                   help="GPU ids of Easel's ControlNet service (default: the denoisers' GPUs)")
    p.add_argument("--cfg-parallel", type=gpu_pairs, default=(),
                   help="Easel with latent parallelism: one denoiser per GPU pair, e.g. 0:1 (export --cfg-parallel; "
                        "instead of --gpus)")
    p.add_argument("--gpus", type=int_list("--gpus", 0), default=None, help="Easel's GPU ids (one denoiser each; default 0); "
                   "diffusers runs on the first")
    p.add_argument("--skip-easel", action="store_true", help="keep Easel's results already in --out")
    p.add_argument("--skip-diffusers-eager", action="store_true", help="keep those already in --out")
    p.add_argument("--skip-diffusers-compiled", action="store_true", help="keep those already in --out (or none)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server start may take")
    p.add_argument("--controlnet-row-split", action="store_true",
                   help="export --controlnet-row-split (a guided request's ControlNets called per row)")
    p.add_argument("--cuda-pool-mib", type=int, default=DEFAULT_CUDA_POOL_MIB,
                   help="Triton's CUDA memory pool per GPU (default: easel serve's, %(default)s)")
    p.add_argument("--shared-compile-cache", action="store_true",
                   help="every configuration's server compiles into one cache in --work and starts once: a later "
                        "configuration (or run) loads what an earlier one compiled. No cold-start figures then")
    p.add_argument("--edit", action="store_true",
                   help="template edits instead of text-to-image: reusing a recording against exact inpainting per "
                        "mask ratio (latency, PSNR/SSIM) and at each --concurrency (images/s); writes edits.json")
    p.add_argument("--load-rates", type=rates, default=(),
                   help="with --edit: edits a second arriving at random (Poisson) for an open-loop load at each "
                        "rate, routed by predicted seconds and by row-steps (export --routing) over two --gpus or more")
    p.add_argument("--load-requests", type=int, default=40, help="with --load-rates: edits at each rate")
    p.add_argument("--template-cache-gib", type=gib_triple, default=None, metavar="DEVICE,HOST,DISK",
                   help="with --edit: export --template-cache-gib (default 48,0,0 on a GPU: recordings stay on the "
                        "device; 0,48,0 streams them from host memory)")
    p.add_argument("--conv-subsets", action="store_true",
                   help="with --edit: export --conv-subsets (reusing edits also run the ResNet blocks on the mask's box)")
    p.add_argument("--profile-template", action="store_true",
                   help="with --edit: run easel profile-template on the exported repository before the server starts "
                        "(reusing edits then take the recording only where Algorithm 1 says it pays; copied to "
                        "template_blocks.json beside edits.json)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the whole run on CPU with the tiny model (fp32, eager, no torch.compile): tests the script")
    p.add_argument("--replot", type=Path, default=None, metavar="DIR",
                   help="only rewrite DIR/results.md and the plots from DIR/results.json")
    return p


def rates(text: str) -> tuple[float, ...]:
    """--load-rates: comma-separated positive numbers."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--load-rates: {text!r} is not a comma-separated list of numbers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"--load-rates: {text!r} must list rates above 0")
    return values


def gpu_pairs(text: str) -> tuple[tuple[int, int], ...]:
    from export.cli import _gpu_pairs

    return _gpu_pairs(text)


def fp8_parts(text: str) -> tuple[str, ...]:
    from export.cli import _fp8_parts

    return _fp8_parts(text)


def config_list(text: str) -> tuple[tuple[int, int], ...]:
    """"0C/0L,1C/1L" -> ((0, 0), (1, 1)): ControlNets and LoRAs per request of each configuration."""
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        match = re.fullmatch(r"(\d+)C/(\d+)L", name)
        if not match:
            raise argparse.ArgumentTypeError(f"--configs: {name!r} is not of the form <m>C/<n>L, e.g. 1C/2L")
        out.append((int(match[1]), int(match[2])))
    if not out:
        raise argparse.ArgumentTypeError("--configs: no configuration given")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Setup:
    """The resolved settings of one run."""

    work: Path
    device: str  # cpu | cuda
    dtype: str  # fp16 | fp32
    size: int
    steps: int
    throughput_steps: int
    runs: int
    concurrency: tuple[int, ...]
    rounds: int | None
    runtime: str | None
    row_buckets: tuple[int, ...] | None
    fused_kernels: bool
    controlnets: int
    loras: int
    lora_mib: float
    gpus: tuple[int, ...]  # one denoiser each (with cfg_parallel: each pair's first)
    cfg_parallel: tuple[tuple[int, int], ...]
    controlnet_gpus: tuple[int, ...] | None
    ready_timeout: float
    smoke: bool
    shared_compile_cache: bool = False
    cuda_pool_mib: int = DEFAULT_CUDA_POOL_MIB  # TritonServer.cuda_pool_mib
    controlnet_row_split: bool = False
    vae_dtype: str | None = None
    fp8: tuple[str, ...] = ()
    fp8_fast_accum: bool = False
    conv_subsets: bool = False  # (template edits: RuntimeConfig.conv_subsets)
    profile_template: bool = False  # (template edits: easel profile-template before the server starts)
    # What the run's repository is exported for: the most of any configuration sharing its server
    # (None: this configuration's own). Never fewer than the configuration's own.
    served_controlnets: int | None = None
    served_loras: int | None = None

    def __post_init__(self):
        for own, served in (("controlnets", "served_controlnets"), ("loras", "served_loras")):
            given = getattr(self, served)
            object.__setattr__(self, served, max(getattr(self, own), given or 0))

    @property
    def name(self) -> str:
        return f"{self.controlnets}C/{self.loras}L"

    @property
    def denoiser_gpus(self) -> tuple[int, ...]:
        """Every GPU the denoisers compute on."""
        return tuple(g for pair in self.cfg_parallel for g in pair) or self.gpus

    def placement(self) -> dict:
        """Where Easel ran, as a configuration's entry records it (and tells entries apart)."""
        return {"gpus": list(self.denoiser_gpus),
                "controlnet_gpus": list(self.controlnet_gpus) if self.controlnet_gpus else None,
                "cfg_parallel": [list(p) for p in self.cfg_parallel] or None,
                **({"controlnet_row_split": True} if self.controlnet_row_split else {}),
                # a configuration measured on a larger repository than its own is another entry
                "served": self.served_name if self.served_name != self.name else None}

    @property
    def served_name(self) -> str:
        return f"{self.served_controlnets}C/{self.served_loras}L"

    @property
    def adapter_store(self) -> Path | None:
        """Where prepare() writes the served ControlNets and LoRAs (None: no adapters served)."""
        return self.work / "adapters" if self.served_controlnets or self.served_loras else None

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.gpus[0]}" if self.device == "cuda" else "cpu"

    @property
    def resolved_runtime(self) -> str:
        from backends.core.runtime.config import default_kind

        return ((self.runtime or default_kind(self.device)) + ("+fused" if self.fused_kernels else "")
                + (f"+vae-{self.vae_dtype}" if self.vae_dtype else "")
                + ("+fp8-" + "-".join(self.fp8) if self.fp8 else "")
                + ("+fast-accum" if self.fp8_fast_accum else ""))

    def easel_rounds(self, c: int) -> int:
        return self.rounds or (2 if self.smoke else max(2, 8 // c))


def shares_server(args: argparse.Namespace) -> bool:
    """Whether the run's configurations share one tritonserver: only when no diffusers baseline
    needs the GPU between them."""
    return bool(args.skip_diffusers_eager and args.skip_diffusers_compiled)


def resolve_all(args: argparse.Namespace) -> list[Setup]:
    """One Setup per configuration: --configs, or the one --controlnets/--loras name. When they
    share a server, each is served by a repository sized for the most adapters of any of them."""
    setup = resolve(args)
    if args.configs is None:
        return [setup]
    if args.controlnets or args.loras:
        raise SystemExit("easel bench: give --configs or --controlnets/--loras, not both")
    shared = shares_server(args)
    most = (max(c for c, _ in args.configs), max(n for _, n in args.configs))
    return [dataclasses.replace(setup, controlnets=c, loras=n, served_controlnets=most[0] if shared else c,
                                served_loras=most[1] if shared else n) for c, n in args.configs]


def resolve(args: argparse.Namespace) -> Setup:
    smoke = args.cpu_smoke
    if smoke and args.runtime not in (None, "eager"):
        raise SystemExit(f"easel bench: --cpu-smoke runs the eager runtime, not {args.runtime}")
    defaults = dict(size=64, steps=4, throughput_steps=4, runs=2, concurrency=(1, 2)) if smoke else dict(
        size=1024, steps=50, throughput_steps=30, runs=5, concurrency=(1, 2, 4, 8))
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    if min(pick["concurrency"]) < 1 or pick["runs"] < 1:
        raise SystemExit("easel bench: --runs and every --concurrency level must be at least 1")
    if args.cfg_parallel and (args.gpus or smoke):
        raise SystemExit("easel bench: --cfg-parallel names the GPUs (not with --gpus or --cpu-smoke)")
    gpus = tuple(a for a, _ in args.cfg_parallel) or tuple(args.gpus or (0,))
    work = args.work or Path(tempfile.gettempdir()) / ("easel-bench-smoke" if smoke else "easel-bench")
    return Setup(work=work, device="cpu" if smoke else "cuda", dtype="fp32" if smoke else "fp16",
                 runtime="eager" if smoke else args.runtime, rounds=args.throughput_rounds,
                 row_buckets=args.row_buckets, fused_kernels=args.fused_kernels, controlnets=args.controlnets,
                 loras=args.loras,
                 lora_mib=0.25 if smoke else args.lora_mib, gpus=gpus, cfg_parallel=tuple(args.cfg_parallel),
                 controlnet_gpus=tuple(args.controlnet_gpus) if args.controlnet_gpus else None,
                 ready_timeout=args.ready_timeout, shared_compile_cache=args.shared_compile_cache,
                 cuda_pool_mib=args.cuda_pool_mib, controlnet_row_split=args.controlnet_row_split,
                 vae_dtype=args.vae_dtype, fp8=tuple(args.fp8), fp8_fast_accum=args.fp8_fast_accum,
                 conv_subsets=args.conv_subsets, profile_template=args.profile_template, smoke=smoke, **pick)


def gpu_name(setup: Setup) -> str:
    if setup.device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(setup.gpus[0])


def gpu_slug(name: str, count: int = 1) -> str:
    """'NVIDIA H200' -> 'h200'; two of them -> 'h200x2'."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"
    return f"{slug}x{count}" if count > 1 else slug


def driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for package in ("torch", "diffusers", "transformers", "triton", "tritonclient", "nvidia-pytriton", "numpy"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    try:
        import torch

        out["torch"], out["cuda"] = torch.__version__, torch.version.cuda
    except ImportError:
        pass
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def control_images(setup: Setup, count: int) -> list[bytes]:
    from clients.bench.adapters import control_png

    return [control_png(setup.size, i) for i in range(count)]


def free_gpu(setup: Setup) -> None:
    gc.collect()
    if setup.device == "cuda":
        import torch

        torch.cuda.empty_cache()
