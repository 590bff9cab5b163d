"""How long torch.compile takes on a template edit's reusing step: the UNet halves on static token
subsets (runtime/token_subsets.StaticSubsets, as the `compiled` runtime's reusing graphs run them),
with the ResNet blocks and upsamplers on the mask's box (`boxes`, RuntimeConfig.conv_subsets) and
without (`whole`), rows and token counts dynamic as the runtime marks them. Each variant is one
compile from a cold cache and its first call (the seconds a server's warm-up spends on it), and the
compiled step's largest deviation from the same static step run eagerly.

    python3 -m bench.micro.reuse_compile --work /tmp/easel-rc --out rc.json                # tiny UNet, CPU
    python3 -m bench.micro.reuse_compile --work /tmp/easel-rc --out rc.json --random-sdxl --device cuda --size 1024
"""

from __future__ import annotations

import logging
import time

from clients.bench.common import bench_parser, random_sdxl, start_logging, write_json

log = logging.getLogger("bench.micro.reuse_compile")

VARIANTS = ("boxes", "whole")


def compile_step(model, device: str, size: int, boxes: bool, backend: str, rows: int = 2) -> dict:
    """One variant: record a step, then compile its reusing form (a centered mask of a fifth of the
    latent) and time the first call."""
    import torch
    from diffusers import UNet2DConditionModel

    from backends.core.runtime.conv_subsets import graph_box, masked_boxes
    from backends.core.runtime.token_subsets import (RECORD, REUSE, RecordedBuffers, StaticSubsets,
                                                     TemplateActivations, TokenLayout, TokenRow, computed_tokens,
                                                     graph_share)
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.unet_split import split_unet

    dtype = torch.float16 if device == "cuda" else torch.float32
    unet = UNet2DConditionModel.from_pretrained(model / "unet").to(device, dtype).eval()
    runtime = EagerUNetRuntime(unet, *split_unet(unet), conv_subsets=boxes)
    cfg, side = unet.config, size // 8
    levels = len(cfg.block_out_channels)
    g = torch.Generator(device).manual_seed(0)

    def inputs() -> tuple:
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        return (torch.randn(rows, cfg.in_channels, side, side, generator=g, device=device, dtype=dtype),
                torch.full((rows,), 501.0, device=device),
                torch.randn(rows, 77, cfg.cross_attention_dim, generator=g, device=device, dtype=dtype),
                torch.randn(rows, pooled, generator=g, device=device, dtype=dtype),
                torch.tensor([[size, size, 0, 0, size, size]], device=device, dtype=dtype).expand(rows, -1).clone())

    def step(layout, args, encoder, decoder, fill=None):
        with torch.inference_mode(), runtime.token_layout(layout):
            if fill is not None:
                layout.fill(fill)
            emb, mid, skips = encoder(*args)
            return decoder(emb, mid, skips, args[2])

    template = TemplateActivations(rows)
    args = inputs()
    step(TokenLayout(tuple(TokenRow(RECORD, template, 0, r) for r in range(rows))), args, runtime.encoder,
         runtime.decoder)
    mask = torch.zeros(1, 1, side, side)
    lo, hi = int(side * 0.28), int(side * 0.72)  # a fifth of the latent
    mask[..., lo:hi, lo:hi] = 1
    computed, boxes_of = computed_tokens(mask, levels), masked_boxes(mask, levels)
    layout = TokenLayout(tuple(TokenRow(REUSE, template, 0, r, computed, boxes_of) for r in range(rows)))
    box = graph_box(layout, side, side, runtime.subsets.box_keys) if boxes else None
    static = StaticSubsets(rows, graph_share(layout), None, runtime.subsets, RecordedBuffers(), box)
    step(static, args, runtime.encoder, runtime.decoder)  # the buffers, made eager (as the runtime does)
    want = step(static, args, runtime.encoder, runtime.decoder, fill=layout)
    torch._dynamo.reset()  # a cold start, whatever ran before
    for t in args:  # as cuda_graphs.capture marks a compiled capture's inputs
        torch._dynamo.maybe_mark_dynamic(t, 0)
    encoder, decoder = (torch.compile(f, backend=backend) for f in (runtime.encoder, runtime.decoder))
    start = time.perf_counter()
    got = step(static, args, encoder, decoder)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"compile_s": seconds, "box": box, "token_share": static.share,
            "max_rel_err": float((got.float() - want.float()).abs().max() / want.float().abs().max())}


def main() -> None:
    p = bench_parser(__doc__, size=128, steps=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--random-sdxl", action="store_true",
                   help="SDXL base's shapes, random fp16 weights (else the tiny UNet)")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend (inductor, aot_eager)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = p.parse_args()
    start_logging()
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False  # every variant compiles from nothing
    if args.random_sdxl:
        model = random_sdxl(args.work, args.device)
    else:
        from export.tiny import write_tiny_pipeline

        model = args.work / "tiny"
        if not (model / "model_index.json").exists():
            write_tiny_pipeline(model, seed=0)
    report = {"model": "sdxl-random" if args.random_sdxl else "tiny", "device": args.device, "size": args.size,
              "backend": args.backend, "variants": {}}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
        row = report["variants"][name] = compile_step(model, args.device, args.size, name == "boxes", args.backend)
        log.info("%s: compile and first call %.1f s (box %s, token share %.3g), compiled against eager %.2e",
                 name, row["compile_s"], row["box"], row["token_share"], row["max_rel_err"])
    write_json(args.out, report)


if __name__ == "__main__":
    main()
