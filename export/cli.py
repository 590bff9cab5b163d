"""The build-time half of the `easel` command: `easel tiny` and `easel export`."""

from __future__ import annotations

import argparse
import logging
import sys

from backends.core.runtime.config import RuntimeConfig
from backends.core.serving.routing import MEASURES as ROUTING_MEASURES


def _share_ratio(text: str) -> float | None:
    """--edit-share-ratio: a number of 1 or more, or none."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--edit-share-ratio: {text!r} is not a number or 'none'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--edit-share-ratio: {value:g} is below 1")
    return value


def gib_triple(text: str) -> tuple[float, float, float]:
    """An argparse type: --template-cache-gib's DEVICE,HOST,DISK."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--template-cache-gib: {text!r} is not three numbers") from None
    if len(values) != 3 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"--template-cache-gib: {text!r} must be DEVICE,HOST,DISK GiB, each 0 or more")
    return values


def int_list(flag: str, minimum: int = 1):
    """An argparse type: a comma-separated list of integers, each `minimum` or more."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{flag}: {text!r} must list integers of {minimum} or more")
        return values
    return parse


def _fp8_parts(text: str) -> tuple[str, ...]:
    from backends.core.runtime.config import FP8_PARTS, check_fp8_parts

    named = [v.strip() for v in text.split(",") if v.strip()]
    parts = tuple(dict.fromkeys(p for v in named for p in (FP8_PARTS if v == "all" else (v,))))
    if not parts:
        raise argparse.ArgumentTypeError(f"--fp8: {text!r} names no part of {','.join(FP8_PARTS)} or all")
    try:
        return check_fp8_parts(parts, "--fp8")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or all (= {','.join(FP8_PARTS)})") from None


def _gpus(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(g) for g in text.split(",") if g.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus: {text!r} is not a comma-separated list of GPU ids") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"--gpus: {text!r} must name distinct non-negative GPU ids")
    return gpus


def _gpu_pairs(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(g) for g in pair.split(":")) for pair in text.split(",") if pair.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cfg-parallel: {text!r} is not a list of GPU pairs like 0:1,2:3") from None
    used = [g for pair in pairs for g in pair]
    if not pairs or any(len(p) != 2 for p in pairs) or min(used) < 0 or len(set(used)) != len(used):
        raise argparse.ArgumentTypeError(f"--cfg-parallel: {text!r} must pair distinct GPU ids, like 0:1,2:3")
    return pairs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="easel")
    sub = p.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny", help="write a tiny random SDXL-architecture pipeline (diffusers layout) and "
                                       "an adapter store for it")
    tiny.add_argument("dir", help="the pipeline's folder (model_index.json, unet/, vae/, text encoders, ...)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--variant", default="default",
                      help="default | alt (another configuration, for tests) | inpaint (the default with a 9-channel inpainting UNet) | sdxl (full SDXL sizes, for GPUs)")
    tiny.add_argument("--device", default="cpu", help="where to initialise the weights (cuda for --variant sdxl)")
    tiny.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    tiny.add_argument("--adapters", default=None,
                      help="where to write the adapter store: tiny ControlNets canny and depth, LoRAs papercut, "
                           "inkwash and charcoal (default: DIR/adapters)")

    exp = sub.add_parser("export", help="diffusers SDXL folder -> Triton model repository")
    exp.add_argument("--model", required=True, help="a diffusers StableDiffusionXLPipeline folder")
    exp.add_argument("--out", required=True, help="the model repository to write")
    exp.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    exp.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                     help="default: fp32 on cpu, fp16 on cuda")
    exp.add_argument("--gpus", type=_gpus, default=None, help="one denoiser per GPU id, e.g. 0,1 (default 0)")
    exp.add_argument("--cfg-parallel", type=_gpu_pairs, default=(),
                     help="latent parallelism: one denoiser per GPU pair, e.g. 0:1,2:3, each running the "
                          "conditional rows on its first GPU and the unconditional on its second (replaces --gpus)")
    exp.add_argument("--max-size", type=int, default=2048, help="largest width/height a request may ask for")
    exp.add_argument("--max-steps", type=int, default=150)
    exp.add_argument("--default-steps", type=int, default=30)
    exp.add_argument("--max-in-flight", type=int, default=56,
                     help="requests each public model (easel, easel_stream) runs at once; past it a request is "
                          "refused at once with UNAVAILABLE")
    exp.add_argument("--routing", choices=ROUTING_MEASURES, default="seconds",
                     help="what the public models route requests by among the denoisers: predicted seconds of "
                          "remaining work, learned from each denoiser's steps and aware of template edits' masks "
                          "(default), or row-steps of work (pixels x steps x rows)")
    exp.add_argument("--max-batch-rows", type=int, default=16, help="UNet batch rows per denoising step")
    exp.add_argument("--max-queue", type=int, default=48,
                     help="requests a denoiser holds waiting beyond its running set; past it a request is "
                          "refused at once with UNAVAILABLE")
    exp.add_argument("--adapters", default=None, help="adapter store: DIR/controlnets/<name>/ (diffusers ControlNets)")
    exp.add_argument("--max-controlnets", type=int, default=3, help="ControlNets a request may use")
    exp.add_argument("--max-loras", type=int, default=3, help="LoRAs a request may use")
    exp.add_argument("--lora-bound-steps", type=int, default=0,
                     help="steps a request may run while its LoRAs load (0: wait for them; exact)")
    exp.add_argument("--lora-loaders", type=int, default=2,
                     help="processes per denoiser that load LoRA files (in parallel; one that crashes is replaced)")
    exp.add_argument("--template-cache-gib", type=gib_triple, default=(8.0, 0.0, 0.0), metavar="DEVICE,HOST,DISK",
                     help="GiB per denoiser of templates' recorded activations (the `template` input) on the "
                          "device, in host memory and on disk (<denoiser>/1/template_cache/; kept across restarts) "
                          "(default: 8,0,0)")
    exp.add_argument("--edit-share-ratio", type=_share_ratio, default=2.0, metavar="R",
                     help="template edits that reuse a recording share a step only while its largest share of "
                          "computed tokens is at most R times its smallest (a step pads every row to its largest); "
                          "'none': whatever their shares (default: 2)")
    exp.add_argument("--controlnet-gpus", type=_gpus, default=None,
                     help="GPU ids of the ControlNet service (default: the denoisers' GPUs, both of each "
                          "--cfg-parallel pair)")
    exp.add_argument("--controlnet-instances", type=int, default=2,
                     help="ControlNet service instances per GPU (or on CPU): ControlNets run at once")
    exp.add_argument("--controlnet-cache-gib", type=float, default=16.0,
                     help="memory for resident ControlNets per service instance")
    exp.add_argument("--controlnet-mode", choices=("sync", "pipelined"), default="sync",
                     help="pipelined: step t uses residuals of step t-1's latents (hides ControlNet time; approximate)")
    exp.add_argument("--controlnet-row-split", action="store_true",
                     help="call a guided request's ControlNets once per row, so that two service instances "
                          "(on GPUs of their own: --controlnet-gpus) share each call (exact)")
    exp.add_argument("--onnx", action="store_true",
                     help="also export each component to ONNX (<model>/1/onnx/<component>.onnx)")
    exp.add_argument("--runtime", choices=("eager", "graphs", "compiled"), default=None,
                     help="how the UNet runs: eager, CUDA graphs per bucket, or compiled + graphs "
                          "(default: compiled on cuda, eager on cpu)")
    exp.add_argument("--row-buckets", type=int_list("--row-buckets"), default=None,
                     help="UNet row counts captured as graphs (default 2,4,8,16; a step with guidance takes 2 a "
                          "request; with --cfg-parallel 1,2,4,8, as each GPU runs half the rows)")
    exp.add_argument("--warmup-sizes", type=int_list("--warmup-sizes"), default=(),
                     help="square image sizes (px) whose graphs are captured (and compiled) before ready, e.g. 1024")
    exp.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                     help="UNet in channels_last memory format (default: with --runtime compiled, where it pays)")
    exp.add_argument("--fused-kernels", action="store_true", help="plugins/: fused GroupNorm+SiLU and GEGLU kernels")
    exp.add_argument("--conv-subsets", action="store_true",
                     help="template edits that reuse a recording also run the ResNet blocks on their mask's box "
                          "(approximate; as graphs too, a pair per box size, captured at first use)")
    exp.add_argument("--warmup-template-edits", action="store_true",
                     help="also capture template edits' reusing steps at the warm-up sizes, every row bucket and "
                          "token share (compiled: after compiling their halves, minutes); without it, compiled's "
                          "reusing steps run graphs of the eager modules")
    exp.add_argument("--subset-graph-limit", type=int, default=RuntimeConfig.subset_graph_limit,
                     help="reusing steps' buckets that keep their CUDA graphs (a pair and the decoder's output each); "
                          "past it the least recently used lets go of its own")
    exp.add_argument("--vae-attention", choices=("fp32", "fp16", "bf16"), default=None,
                     help="precision of the VAE's attention product: fp32 is diffusers' exact upcast VAE "
                          "(default: bf16 on a fast runtime, fp32 on eager)")
    exp.add_argument("--vae-dtype", choices=("fp32", "fp16", "bf16"), default=None,
                     help="the whole VAE's dtype (default: diffusers', fp32 for SDXL's upcast VAE); bf16 is "
                          "approximate and faster")
    exp.add_argument("--fp8", type=_fp8_parts, default=(),
                     help="experimental: the transformer blocks' products in FP8 with calibrated scales (approximate, faster; README): "
                          "comma-separated parts of attention,feed_forward,projections, or all (default: none)")
    exp.add_argument("--fp8-fast-accum", action="store_true",
                     help="with --fp8: cuBLAS's fast accumulation of the FP8 products (faster; README)")
    prof = sub.add_parser("profile-lora", help="measure each LoRA's bound K (steps it may join late) for a repository")
    prof.add_argument("--repo", required=True, help="a model repository exported with --adapters")
    prof.add_argument("--loras", default=None, help="comma-separated names (default: every LoRA in the store)")
    prof.add_argument("--steps", type=int, default=30)
    prof.add_argument("--size", type=int, default=None, help="default: the model's default size")
    prof.add_argument("--seeds", type=int, default=2)
    prof.add_argument("--threshold", type=float, default=0.99, help="cosine similarity of latents")
    tp = sub.add_parser("profile-template", help="measure where template edits' reuse pays, per transformer block, "
                                                 "and write it into a repository's denoisers")
    tp.add_argument("--repo", required=True, help="a model repository")
    tp.add_argument("--size", type=int, default=None, help="the edits' image size (default: the model's default size)")
    tp.add_argument("--iters", type=int, default=10, help="timed runs per block and mask ratio (median)")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    if args.command == "tiny":
        from .tiny import write_tiny_pipeline
        from .tiny_adapters import write_tiny_adapter_store

        path = write_tiny_pipeline(args.dir, seed=args.seed, variant=args.variant, device=args.device,
                                   dtype=args.dtype)
        store = write_tiny_adapter_store(path, args.adapters, seed=args.seed)
        logging.getLogger("easel").info("wrote %s and the adapter store %s", path, store)
        return 0
    if args.command == "export":
        from .repository import ExportOptions, export_repository

        if args.cfg_parallel and args.gpus:
            parser().error("export: give --gpus or --cfg-parallel, not both (the pairs name the GPUs)")
        gpus = tuple(a for a, _ in args.cfg_parallel) or args.gpus or (0,)
        options = ExportOptions(device=args.device, dtype=args.dtype, gpus=gpus, cfg_parallel=args.cfg_parallel,
                                max_size=args.max_size,
                                max_steps=args.max_steps, default_steps=args.default_steps,
                                max_in_flight=args.max_in_flight, routing=args.routing, max_batch_rows=args.max_batch_rows,
                                max_running=args.max_batch_rows, max_queue=args.max_queue, onnx=args.onnx, adapters=args.adapters,
                                max_controlnets=args.max_controlnets, max_loras=args.max_loras,
                                lora_bound_steps=args.lora_bound_steps, lora_loaders=args.lora_loaders,
                                controlnet_gpus=args.controlnet_gpus,
                                controlnet_instances=args.controlnet_instances,
                                controlnet_cache_gib=args.controlnet_cache_gib, controlnet_mode=args.controlnet_mode,
                                controlnet_row_split=args.controlnet_row_split, runtime=args.runtime, row_buckets=args.row_buckets, warmup_sizes=args.warmup_sizes,
                                channels_last=args.channels_last, fused_kernels=args.fused_kernels,
                                vae_attention=args.vae_attention, vae_dtype=args.vae_dtype, fp8=args.fp8,
                                fp8_fast_accum=args.fp8_fast_accum, template_cache_gib=args.template_cache_gib,
                                conv_subsets=args.conv_subsets, warmup_template_edits=args.warmup_template_edits,
                                subset_graph_limit=args.subset_graph_limit,
                                edit_share_ratio=args.edit_share_ratio)
        export_repository(args.model, args.out, options)
        return 0
    if args.command == "profile-lora":
        from .profile_lora import profile_loras

        names = [n for n in args.loras.split(",") if n] if args.loras else None
        bounds = profile_loras(args.repo, names, steps=args.steps, size=args.size, seeds=args.seeds,
                               threshold=args.threshold)
        logging.getLogger("easel").info("bounds: %s", bounds)
        return 0
    if args.command == "profile-template":
        from .profile_template import profile_template

        for path in profile_template(args.repo, size=args.size, iters=args.iters):
            logging.getLogger("easel").info("wrote %s", path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
