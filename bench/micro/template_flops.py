"""Decides how far a reusing template edit can go while the convolutions run on every token: the
UNet's FLOPs by part at a size, counted on meta tensors (no weights, no device), and from them the
ideal speed-up of an edit per mask ratio (FLOP-bound, every kernel at the same efficiency).

A reusing edit (backends/core/runtime/token_subsets.py) computes, in each transformer block, K and
V on every token and the rest of the block (Q, attention, the output projection, cross-attention,
the feed-forward) on its masked tokens; everything outside the blocks (convolutions, GroupNorms,
the transformer models' projections, the embeddings) on every token. So, per row:

    reusing(m) = outside + sum over blocks of (kv + m * (block - kv))

against `outside + blocks` exactly. The report gives that ratio per mask ratio; the ratio with the
ResNet blocks shrunk to the mask's share, and with the upsamplers too (what `--conv-subsets` does,
on the mask's box: its halo is not counted); and the ratio if the whole outside shrank (a bound).

A batch of edits with different masks (`batch_speedups`): eight edits with InstGenIE's mask ratios
(clients/bench/edits.trace_ratios, as `easel bench --edit`'s throughput) run to their end through
the step batcher (engine/step_batcher.py), each step costing its rows at its largest mask (a
reusing step pads every row to it, boxes too), with and without `max_share_ratio`'s grouping;
against exact, and against every edit at its own mask (the bound of packing each row's work).

    python3 -m bench.micro.template_flops --work /tmp/easel-tf --out tf.json --size 1024   # SDXL shapes
"""

from __future__ import annotations

import logging

from clients.bench.common import bench_parser, start_logging, write_json
from export.profile_template import RATIOS

log = logging.getLogger("bench.micro.template_flops")

TEXT_TOKENS = 77


def count(size: int, variant: str = "sdxl") -> dict:
    """FLOPs of one UNet row at `size` px (a forward, batch 1): in total, outside the transformer
    blocks, in the ResNet blocks (most of the outside), and per transformer block its token count,
    its FLOPs and those of its self-attention K and V."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.upsampling import Upsample2D
    from torch.utils.flop_counter import FlopCounterMode

    from export.tiny import unet_kwargs

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_kwargs(variant)).eval()
        cfg = unet.config
        latent = size // 8
        sample = torch.empty(1, cfg.in_channels, latent, latent)
        text = torch.empty(1, TEXT_TOKENS, cfg.cross_attention_dim)
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        added = {"text_embeds": torch.empty(1, pooled), "time_ids": torch.empty(1, 6)}
        names = [name for name, m in unet.named_modules() if type(m) is BasicTransformerBlock]
        resnets = [name for name, m in unet.named_modules() if type(m) is ResnetBlock2D]
        upsamplers = [name for name, m in unet.named_modules() if type(m) is Upsample2D]
        blocks = {}

        def note(name):
            def hook(module, args):
                tokens, width = args[0].shape[1:]
                # K and V: 2 * tokens * width * inner FLOPs each
                blocks[name] = {"tokens": tokens, "kv": 2 * 2 * tokens * width * module.attn1.to_k.out_features}
            return hook

        for name in names:
            unet.get_submodule(name).register_forward_pre_hook(note(name))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            unet(sample, torch.tensor(999.0), text, added_cond_kwargs=added)
    by_module = counter.get_flop_counts()
    for name, block in blocks.items():
        block["flops"] = sum(by_module[f"UNet2DConditionModel.{name}"].values())
    total = sum(by_module["Global"].values())
    def of(names):
        return sum(sum(by_module[f"UNet2DConditionModel.{name}"].values()) for name in names)

    return {"size": size, "total": total, "outside": total - sum(b["flops"] for b in blocks.values()),
            "resnets": of(resnets), "upsamplers": of(upsamplers), "blocks": list(blocks.values())}


def token_shares(size: int, ratio: float, levels: int = 3) -> dict[int, float]:
    """Per token count of a level, the share of tokens a reusing edit computes for the benchmark's
    centered mask of `ratio` (runtime/token_subsets.computed_tokens: a token partly masked is
    computed, so coarser levels compute more than the ratio)."""
    import torch
    import torch.nn.functional as F

    from backends.core.runtime.token_subsets import computed_tokens
    from export.profile_template import centered_mask

    latent = size // 8
    mask = torch.from_numpy(centered_mask(size, ratio)).float().div(255).reshape(1, 1, size, size)
    latent_mask = F.adaptive_max_pool2d(mask, (latent, latent))
    return {tokens: indices.numel() / tokens for tokens, indices in computed_tokens(latent_mask, levels).items()}


def speedups(flops: dict, size: int, ratio: float) -> dict:
    """The ideal speed-up of a reusing edit with the benchmark's mask of `ratio` against exact:
    with the convolutions whole, with the ResNet blocks shrunk to the mask's share, with the
    upsamplers too (their halo not counted: what --conv-subsets does), and with everything outside
    the transformer blocks shrunk (a bound)."""
    shares = token_shares(size, ratio)
    in_blocks = sum(b["kv"] + shares[b["tokens"]] * (b["flops"] - b["kv"]) for b in flops["blocks"])
    outside, resnets, upsamplers = flops["outside"], flops["resnets"], flops["upsamplers"]
    return {"mask_ratio": ratio, "token_shares": {str(k): v for k, v in shares.items()},
            "reusing_flops": outside + in_blocks, "speedup": flops["total"] / (outside + in_blocks),
            "speedup_resnets_shrunk": flops["total"] / (outside - (1 - ratio) * resnets + in_blocks),
            "speedup_convs_shrunk": flops["total"] / (outside - (1 - ratio) * (resnets + upsamplers) + in_blocks),
            "speedup_outside_shrunk": flops["total"] / (ratio * outside + in_blocks)}


def row_flops(flops: dict, share: float) -> float:
    """One reusing row's FLOPs at a token share `share` on every grid, the ResNet blocks and
    upsamplers on the same share (--conv-subsets; halos not counted)."""
    convs = flops["resnets"] + flops["upsamplers"]
    return flops["outside"] - (1 - share) * convs + sum(b["kv"] + share * (b["flops"] - b["kv"]) for b in flops["blocks"])


def batch_speedups(flops: dict, edits: int = 8, draws: int = 200, share_ratios=(None, 2.0)) -> dict:
    """Ideal speed-ups over exact of `edits` reusing edits batched by the step batcher, per
    `max_share_ratio` (None: one step of every edit), and with each edit at its own mask (packed),
    means over `draws` draws of their mask ratios."""
    from backends.core.engine.step_batcher import BatcherConfig, SeqState, StepBatcher, StepOutput
    from clients.bench.edits import trace_ratios

    steps, rows = 10, 2
    exact = edits * steps * rows * flops["total"]
    totals = {str(r): [] for r in share_ratios} | {"packed": []}
    step_counts = {str(r): [] for r in share_ratios}
    for seed in range(draws):
        shares = trace_ratios(edits, seed)
        totals["packed"].append(sum(steps * rows * row_flops(flops, s) for s in shares))
        for ratio in share_ratios:
            batcher = StepBatcher(BatcherConfig(max_running=edits, max_batch_rows=rows * edits, max_share_ratio=ratio))
            for i, s in enumerate(shares):
                batcher.add(SeqState(str(i), steps, (128, 128), rows, float(i), template="reused", token_share=s))
            total = plans = 0
            while batcher.has_work():
                plan = batcher.schedule()
                widest = max(shares[int(rid)] for rid in plan.request_ids)
                total += rows * len(plan.request_ids) * row_flops(flops, widest)
                plans += 1
                batcher.update(plan, StepOutput())
            totals[str(ratio)].append(total)
            step_counts[str(ratio)].append(plans / steps)
    return {"edits": edits, "draws": draws,
            "speedup": {k: exact / (sum(v) / len(v)) for k, v in totals.items()},
            "steps_per_round": {k: sum(v) / len(v) for k, v in step_counts.items()}}


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=1)
    p.add_argument("--variant", default="sdxl", help="export/tiny.py's UNet variant (sdxl: SDXL base's shapes)")
    args = p.parse_args()
    start_logging()
    flops = count(args.size, args.variant)
    blocks = sum(b["flops"] for b in flops["blocks"])
    kv = sum(b["kv"] for b in flops["blocks"])
    log.info("%s UNet at %d px, one row: %.2f TFLOP; transformer blocks %.1f%% (%d blocks, tokens %s), of which "
             "self-attention K and V %.1f%% of the total; outside the blocks %.1f%%", args.variant, args.size,
             flops["total"] / 1e12, 100 * blocks / flops["total"], len(flops["blocks"]),
             sorted({b["tokens"] for b in flops["blocks"]}), 100 * kv / flops["total"],
             100 * flops["outside"] / flops["total"])
    log.info("ResNet blocks: %.1f%% of the total; upsamplers %.1f%%", 100 * flops["resnets"] / flops["total"],
             100 * flops["upsamplers"] / flops["total"])
    rows = [speedups(flops, args.size, r) for r in RATIOS]
    for row in rows:
        log.info("mask %.2f (tokens computed %s): ideal speed-up %.2fx with convolutions whole, %.2fx with the "
                 "ResNet blocks shrunk, %.2fx with the upsamplers too, %.2fx with everything outside the transformer "
                 "blocks shrunk", row["mask_ratio"], ", ".join(f"{v:.0%}" for v in row["token_shares"].values()),
                 row["speedup"], row["speedup_resnets_shrunk"], row["speedup_convs_shrunk"],
                 row["speedup_outside_shrunk"])
    batch = batch_speedups(flops)
    log.info("eight edits with InstGenIE's mask ratios, batched: ideal speed-up %s; steps a round %s",
             ", ".join(f"{k} {v:.2f}x" for k, v in batch["speedup"].items()),
             ", ".join(f"{k} {v:.2f}" for k, v in batch["steps_per_round"].items()))
    write_json(args.out, {"variant": args.variant, "flops": flops, "ratios": rows, "batch": batch})


if __name__ == "__main__":
    main()
