"""A diffusers SDXL folder -> a complete Triton model repository.

Loads the pipeline with diffusers' own loaders (safetensors only), splits the UNet at the mid
block, writes each component's artifacts where its Triton model reads them
(backends/core/runtime/artifacts.py) and every config.pbtxt (export/triton_config.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from backends.core.request import contract
from backends.core.runtime.artifacts import DECODER_FILE, ENCODER_FILE, UNET_DIR
from backends.core.runtime.placement import DTYPE_NAMES, Placement
from backends.core.engine.config import DenoiserConfig
from backends.core.engine.denoiser import VAE_SCALE_FACTOR_FILE
from backends.core.runtime.config import RUNTIME_KINDS, RuntimeConfig, check_fp8_parts, default_kind
from backends.core.request.params import Limits
from backends.core.serving.routing import MEASURES as ROUTING_MEASURES
from backends.core.stages.text_encoding import OPTIONS_FILE

from .triton_config import DRAINING_VERSION, Instances, python_model

log = logging.getLogger(__name__)

VERSION = "1"
# Models earlier exports wrote and this one does not: `generate` (the ensemble's hand-off to the
# denoisers, before the public models ran the pipeline by BLS) and `postprocess` (the image
# encoder, before the pipeline encoded the image itself). A stale folder would keep tritonserver
# from starting (its backend is gone), so an export into the same folder removes it.
RETIRED_MODELS = ("generate", "postprocess")


@dataclass(frozen=True)
class ExportOptions:
    device: str = "cpu"  # where the repository's engines run: cpu or cuda
    dtype: str | None = None  # fp32 | fp16 | bf16; default fp32 on cpu, fp16 on cuda
    gpus: tuple[int, ...] = (0,)  # one denoiser per GPU (cuda only)
    # Latent parallelism (cuda): one denoiser per GPU pair, the conditional rows on the first GPU
    # and the unconditional on the second; `gpus` then lists the pairs' first GPUs.
    cfg_parallel: tuple[tuple[int, int], ...] = ()
    cpu_denoisers: int = 1  # cpu only: several denoisers share the ControlNet service (tests)
    cpu_cfg_parallel: bool = False  # cpu only: each denoiser splits guidance over two copies (tests)
    max_size: int = 2048
    max_steps: int = 150
    default_steps: int = 30
    # Requests each public model (easel, easel_stream) runs at once; past it: UNAVAILABLE at once.
    max_in_flight: int = 56
    # What the public models route by among the denoisers (backends/core/serving/routing.py):
    # predicted seconds (mask-aware) or row-steps of work.
    routing: str = "seconds"
    max_running: int = 16
    max_queue: int = 48  # per denoiser, beyond max_running; past it requests are refused (UNAVAILABLE)
    max_batch_rows: int = 16
    adapters: str | None = None  # the adapter store: with it, the ControlNet service is exported
    max_controlnets: int = 3
    max_loras: int = 3
    lora_bound_steps: int = 0  # steps a request may run before its LoRAs must be merged (0: exact)
    lora_loaders: int = 2  # LoRA loader processes per denoiser
    controlnet_gpus: tuple[int, ...] | None = None  # the service's GPUs; default: the denoisers' (all of each pair)
    controlnet_instances: int = 2  # per GPU (or on CPU): ControlNets that run at once
    controlnet_cache_gib: float = 16.0  # resident ControlNets per instance
    controlnet_mode: str = "sync"  # or "pipelined" (approximate; see backends/core/engine/denoiser.py)
    controlnet_row_split: bool = False  # DenoiserConfig.controlnet_row_split
    # GiB per denoiser of templates' recordings on the device, in host memory, on disk (engine/template_cache.py)
    template_cache_gib: tuple[float, float, float] = (8.0, 0.0, 0.0)
    edit_share_ratio: float | None = 2.0  # DenoiserConfig.edit_share_ratio
    onnx: bool = False  # also write <model>/1/onnx/<component>.onnx (export/onnx_export.py)
    # The UNet runtime (backends/core/runtime/config.py): eager | graphs | compiled; default: the
    # fast one on a GPU, eager on CPU.
    runtime: str | None = None
    # Default: 2, 4, 8, 16; with latent parallelism 1, 2, 4, 8 (each GPU runs half the rows).
    row_buckets: tuple[int, ...] | None = None
    # Image sizes (square, px) whose buckets are captured (compiled) at load; default for a fast
    # runtime: the model's own size.
    warmup_sizes: tuple[int, ...] = ()
    channels_last: bool | None = None  # None: where it pays (RuntimeConfig.channels_last)
    fused_kernels: bool = False
    # The VAE's mid-block attention product: fp32 (diffusers' upcast VAE, exact), or bf16/fp16
    # (approximate, faster); default: bf16 on a fast runtime, fp32 on eager.
    vae_attention: str | None = None
    # The whole VAE's dtype. Default: diffusers' (SDXL's VAE upcast to fp32, others the model's
    # dtype). bf16 keeps fp32's range (SDXL's VAE overflows in fp16): approximate, faster.
    vae_dtype: str | None = None
    # The transformer blocks' products in FP8 (RuntimeConfig.fp8: parts of FP8_PARTS; approximate).
    # Export writes the calibration data the runtime reads at load: the text of a few prompts.
    fp8: tuple[str, ...] = ()
    fp8_fast_accum: bool = False  # RuntimeConfig.fp8_fast_accum
    conv_subsets: bool = False  # RuntimeConfig.conv_subsets
    warmup_template_edits: bool = False  # RuntimeConfig.warmup_template_edits
    subset_graph_limit: int = RuntimeConfig.subset_graph_limit  # RuntimeConfig.subset_graph_limit

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device!r} is not cpu or cuda")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {list(DTYPE_NAMES)}")
        if self.device == "cuda" and not self.gpus:
            raise ValueError("gpus: at least one GPU id is needed with --device cuda")
        if self.cfg_parallel:
            used = self.denoiser_gpus
            if self.device != "cuda":
                raise ValueError("cfg_parallel: GPU pairs need --device cuda")
            if any(len(pair) != 2 for pair in self.cfg_parallel) or len(set(used)) != len(used) or min(used) < 0:
                raise ValueError(f"cfg_parallel: {self.cfg_parallel} must be pairs of distinct GPU ids")
            if self.gpus != tuple(a for a, _ in self.cfg_parallel):
                raise ValueError(f"gpus: {self.gpus} must be the first GPU of each cfg_parallel pair")
        if self.cpu_cfg_parallel and self.device != "cpu":
            raise ValueError("cpu_cfg_parallel: only with --device cpu (on GPUs, give cfg_parallel pairs)")
        if self.lora_loaders < 1:
            raise ValueError(f"lora_loaders: {self.lora_loaders} is not a positive number of processes")
        if self.routing not in ROUTING_MEASURES:
            raise ValueError(f"routing: {self.routing!r} is not one of {list(ROUTING_MEASURES)}")
        if self.runtime is not None and self.runtime not in RUNTIME_KINDS:
            raise ValueError(f"runtime: {self.runtime!r} is not one of {list(RUNTIME_KINDS)}")
        if self.vae_attention is not None and self.vae_attention not in DTYPE_NAMES:
            raise ValueError(f"vae_attention: {self.vae_attention!r} is not one of {list(DTYPE_NAMES)}")
        if self.vae_dtype is not None and self.vae_dtype not in DTYPE_NAMES:
            raise ValueError(f"vae_dtype: {self.vae_dtype!r} is not one of {list(DTYPE_NAMES)}")
        if self.device == "cpu" and self.runtime not in (None, "eager"):
            raise ValueError(f"runtime: {self.runtime!r} needs --device cuda (CUDA graphs)")
        check_fp8_parts(self.fp8, "fp8")
        if self.fp8 and self.resolved_runtime == "eager":
            raise ValueError("fp8: needs a fast runtime (--device cuda, --runtime graphs or compiled)")
        if self.fp8_fast_accum and not self.fp8:
            raise ValueError("fp8_fast_accum: needs --fp8 (parts in FP8)")

    @property
    def resolved_runtime(self) -> str:
        return self.runtime or default_kind(self.device)

    def runtime_config(self, vae_scale_factor: int, default_size: int) -> RuntimeConfig:
        # A fast runtime warms up at least the model's own size: under `compiled` a size without
        # buckets runs eager, so a deployment without warm-up sizes would never be fast.
        fast = self.resolved_runtime != "eager"
        pixels = self.warmup_sizes or ((default_size,) if fast else ())
        sizes = tuple((s // vae_scale_factor, s // vae_scale_factor) for s in pixels)
        return RuntimeConfig(kind=self.resolved_runtime, row_buckets=self.resolved_row_buckets, warmup_sizes=sizes,
                             warmup_residuals=bool(self.adapters), channels_last=self.channels_last,
                             fused_kernels=self.fused_kernels, fp8=self.fp8,
                             fp8_fast_accum=self.fp8_fast_accum, conv_subsets=self.conv_subsets,
                             warmup_template_edits=self.warmup_template_edits,
                             subset_graph_limit=self.subset_graph_limit)

    @property
    def denoiser_gpus(self) -> tuple[int, ...]:
        """Every GPU a denoiser computes on (both of each cfg_parallel pair)."""
        return tuple(g for pair in self.cfg_parallel for g in pair) or self.gpus

    @property
    def cfg_parallel_devices(self) -> list[str | None]:
        """Each denoiser's second device (DenoiserConfig.cfg_parallel_device), in denoiser order."""
        if self.cfg_parallel:
            return [f"cuda:{b}" for _, b in self.cfg_parallel]
        return [("cpu" if self.cpu_cfg_parallel else None)] * len(self.denoiser_names())

    @property
    def resolved_row_buckets(self) -> tuple[int, ...]:
        if self.row_buckets is not None:
            return self.row_buckets
        return (1, 2, 4, 8) if self.cfg_parallel or self.cpu_cfg_parallel else (2, 4, 8, 16)

    @property
    def resolved_vae_attention(self) -> str:
        return self.vae_attention or ("fp32" if self.resolved_runtime == "eager" else "bf16")

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("fp16" if self.device == "cuda" else "fp32")

    def denoiser_names(self) -> list[str]:
        if self.device == "cuda":
            return [f"denoiser_gpu{g}" for g in self.gpus]
        return ["denoiser"] if self.cpu_denoisers == 1 else [f"denoiser_cpu{i}" for i in range(self.cpu_denoisers)]

    def controlnet_instances_group(self) -> Instances:
        """Default: on every GPU a denoiser computes on (both of each cfg_parallel pair, whose
        ControlNets are called per row)."""
        if self.device == "cpu":
            return Instances("KIND_CPU", self.controlnet_instances)
        return Instances("KIND_GPU", self.controlnet_instances, tuple(self.controlnet_gpus or self.denoiser_gpus))

    def instances(self, gpu: int | None = None, count: int = 1) -> Instances:
        if self.device == "cpu":
            return Instances("KIND_CPU", count)
        return Instances("KIND_GPU", count, (self.gpus[0] if gpu is None else gpu,))

    def stage_instances(self) -> Instances:
        """The text encoder's and the VAE's: one on each denoiser's GPU, so that replicas scale
        (a single instance on the first GPU would serve every replica and slow that one's steps)."""
        if self.device == "cpu":
            return Instances("KIND_CPU", 1)
        return Instances("KIND_GPU", 1, self.gpus)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _fresh_model_dir(repo: Path, name: str) -> Path:
    model = repo / name
    if model.exists():
        shutil.rmtree(model)
    (model / VERSION).mkdir(parents=True)
    return model


def export_repository(model_dir: str | Path, out_dir: str | Path, options: ExportOptions = ExportOptions()) -> Path:
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import save_file

    from backends.core.runtime.unet_split import num_skips, split_unet

    model_dir, repo = Path(model_dir), Path(out_dir)
    repo.mkdir(parents=True, exist_ok=True)
    for name in RETIRED_MODELS:
        shutil.rmtree(repo / name, ignore_errors=True)
    dtype = options.resolved_dtype
    log.info("loading %s (%s)", model_dir, dtype)
    pipe = StableDiffusionXLPipeline.from_pretrained(model_dir, dtype=Placement(dtype=dtype).torch_dtype, use_safetensors=True)
    vae_scale_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    default_size = pipe.unet.config.sample_size * vae_scale_factor
    limits = Limits(default_width=default_size, default_height=default_size,
                    max_width=max(options.max_size, default_size), max_height=max(options.max_size, default_size),
                    size_multiple=vae_scale_factor, default_steps=options.default_steps, max_steps=options.max_steps,
                    max_controlnets=options.max_controlnets, max_loras=options.max_loras)
    engine_params = {"dtype": dtype}
    # Every model that reads a request's params checks them again against the limits: Triton
    # cannot hide the internal models from clients (backends/core/request/adapter_inputs.py).
    checks = {"limits": limits.to_json()}
    # The adapter store, relative to the repository so that it moves with it.
    store = os.path.relpath(Path(options.adapters).resolve(), repo.resolve()) if options.adapters else None

    # text_encoder: both CLIP encoders and tokenizers, as transformers folders; with the adapter
    # store, since LoRAs' text-encoder layers apply there.
    model = _fresh_model_dir(repo, "text_encoder")
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        component = getattr(pipe, name)
        kwargs = {} if name.startswith("tokenizer") else {"safe_serialization": True}
        component.save_pretrained(model / VERSION / name, **kwargs)
    (model / VERSION / OPTIONS_FILE).write_text(
        json.dumps({"force_zeros_for_empty_prompt": bool(pipe.config.force_zeros_for_empty_prompt)}))
    # On a fast runtime each encoder runs as a CUDA graph (requests with text-encoder LoRAs eagerly).
    text_params = {**engine_params, **checks, "graphs": _flag(options.resolved_runtime != "eager")}
    (model / "config.pbtxt").write_text(python_model(
        "text_encoder", "easel_text_encoder", contract.TEXT_ENCODER, options.stage_instances(),
        {**text_params, "adapters": store} if store else text_params))

    if store:  # the ControlNet service, placed on its own GPUs (or the denoisers')
        model = _fresh_model_dir(repo, "controlnet")
        decl = contract.controlnet_decl(num_skips(pipe.unet), contract.WIRE_DTYPES[dtype])
        (model / "config.pbtxt").write_text(python_model(
            "controlnet", "easel_controlnet", decl, options.controlnet_instances_group(),
            {**checks, "dtype": dtype, "adapters": store,
             "cache_bytes": str(int(options.controlnet_cache_gib * 2**30)),
             # On a fast runtime each resident ControlNet runs as CUDA graphs, one per call shape,
             # of compiled code under `compiled`.
             "runtime": options.resolved_runtime,
             # Keep the denoiser's GPU tensors on the GPU: by default the Python backend copies
             # every input to host memory first (~100 MB a call at 1024 px).
             "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}))

    # denoisers: the UNet's two halves once, in the first denoiser's folder; the others point there.
    names = options.denoiser_names()
    shared = f"{names[0]}/{VERSION}"
    service = options.controlnet_instances_group()
    for index, (name, cfg_device) in enumerate(zip(names, options.cfg_parallel_devices)):
        model = _fresh_model_dir(repo, name)
        if index == 0:
            unet_dir = model / VERSION / UNET_DIR
            unet_dir.mkdir()
            pipe.unet.save_config(unet_dir)
            encoder, decoder = split_unet(pipe.unet)
            for half, file in ((encoder, ENCODER_FILE), (decoder, DECODER_FILE)):
                state = {k: v.detach().contiguous() for k, v in half.state_dict().items()}
                save_file(state, str(unet_dir / file))
            pipe.scheduler.save_pretrained(model / VERSION / "scheduler")
            (model / VERSION / VAE_SCALE_FACTOR_FILE).write_text(json.dumps({"vae_scale_factor": vae_scale_factor}))
            if options.fp8:
                from backends.core.runtime.fp8 import CALIBRATION_FILE, write_calibration

                write_calibration(pipe, unet_dir / CALIBRATION_FILE, default_size)
        gpu = options.gpus[index] if options.device == "cuda" else None
        config = DenoiserConfig(
            limits=limits, runtime=options.runtime_config(vae_scale_factor, default_size), max_running=options.max_running,
            max_queue=options.max_queue, max_batch_rows=options.max_batch_rows, lora_loaders=options.lora_loaders,
            lora_bound_steps=options.lora_bound_steps,
            controlnet_model="controlnet" if options.adapters else None, controlnet_mode=options.controlnet_mode,
            controlnet_row_split=options.controlnet_row_split,
            controlnet_instances=service.count * max(1, len(service.gpus)),
            template_cache_mib=tuple(int(g * 1024) for g in options.template_cache_gib),
            edit_share_ratio=options.edit_share_ratio, cfg_parallel_device=cfg_device)
        params = {**engine_params, "denoiser": config.to_json()}
        if options.adapters:
            params["adapters"] = store
        if index:
            params["artifacts"] = shared
        (model / "config.pbtxt").write_text(python_model(
            name, "easel_denoiser", contract.DENOISER, options.instances(gpu), params, decoupled=True))

    model = _fresh_model_dir(repo, "vae_decoder")
    pipe.vae.save_pretrained(model / VERSION / "vae", safe_serialization=True)
    (model / "config.pbtxt").write_text(python_model(
        "vae_decoder", "easel_vae_decoder", contract.VAE_DECODER, options.stage_instances(),
        # On a fast runtime the VAE runs as a CUDA graph with plugins' GroupNorm+SiLU, whatever the
        # UNet's flags: on an H200 that took SDXL's fp32 decode at 1024 px from 116 to 68 ms, pixels
        # within 1 of eager's (bench/micro/vae_micro.py). Its attention product in bf16 takes it to 58 ms,
        # pixels as close to fp32's (62.9 dB); the fused ops' NHWC kernels and folded convolution
        # biases to 45 ms (the decoder then runs NHWC from its attention on, so channels_last
        # weights and input change nothing: 44.9 ms).
        {**engine_params, **checks, "graphs": _flag(options.resolved_runtime != "eager"),
         "fused_kernels": _flag(options.resolved_runtime != "eager"),
         "attention_dtype": options.resolved_vae_attention,
         **({"vae_dtype": options.vae_dtype} if options.vae_dtype else {})}))

    # An edit's template and mask through the VAE's encoder, beside each VAE decoder (whose copy of
    # the VAE it loads); the masked template only for a UNet that reads it.
    model = _fresh_model_dir(repo, "vae_encoder")
    (model / "config.pbtxt").write_text(python_model(
        "vae_encoder", "easel_vae_encoder", contract.VAE_ENCODER, options.stage_instances(),
        {**engine_params, **checks, "artifacts": f"vae_decoder/{VERSION}",
         "masked_image": _flag(pipe.unet.config.in_channels == 9)}))

    # CPU-only: validation. (The image file is encoded by the pipeline itself: backends/triton/bls_pipeline.py.)
    cpu = Instances("KIND_CPU", 1)
    model = _fresh_model_dir(repo, "preprocess")
    (model / "config.pbtxt").write_text(python_model(
        "preprocess", "easel_preprocess", contract.PREPROCESS, cpu, {"limits": limits.to_json()}))

    # The public models: the pipeline by BLS (backends/triton/bls_pipeline.py), unary and streaming. One
    # instance each runs many requests at once (a thread waits on the models for each), bounded
    # like the denoisers' own queues so that a flood is refused at once. Each has two versions:
    # version 1 serves; `easel serve` drains by switching to version 2 (triton_config.SERVING_VERSION).
    pipeline = {"denoisers": ",".join(names), "max_in_flight": str(options.max_in_flight), "routing": options.routing,
                **checks}
    for name, decl, decoupled in (("easel", contract.PUBLIC, False), ("easel_stream", contract.STREAM, True)):
        model = _fresh_model_dir(repo, name)
        (model / str(DRAINING_VERSION)).mkdir()
        (model / "config.pbtxt").write_text(python_model(
            name, "easel_pipeline", decl, cpu, pipeline, decoupled=decoupled, spare_version=True))
    if options.onnx:
        from .onnx_export import export_repository_onnx

        export_repository_onnx(model_dir, repo, denoiser=names[0], version=VERSION)

    (repo / "easel_export.json").write_text(json.dumps(
        {"source": str(model_dir), "options": dataclasses.asdict(options), "limits": dataclasses.asdict(limits)},
        indent=2))
    log.info("wrote %s", repo)
    return repo
