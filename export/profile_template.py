"""`easel profile-template`: measures, on the deployment's device and at its image size, what each
transformer block of the UNet costs on every token and on a mask's tokens (the rest from a
template's recording), and what one row of its recording takes to load from pinned host memory
(with the runtime's conv_subsets, also a row of the recording's ResNet and upsampler parts, which
every streamed step loads); writes the result (runtime/cache_plan.BlockProfile) into every denoiser
of a repository, where reusing edits at that size then take the recording only in the blocks where
it pays.

Times per UNet row: GPU times from CUDA events on a GPU (median of `iters`), clock times on the
CPU (where loads cost nothing: the recording is where the compute is).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

import numpy as np

from backends.core.runtime.cache_plan import BlockProfile, ProfiledBlock

log = logging.getLogger(__name__)

RATIOS = (0.05, 0.1, 0.2, 0.35, 0.5)  # the profile's mask ratios (linear between them)


def centered_mask(size: int, ratio: float) -> np.ndarray:
    """A square mask of about `ratio` of a `size` image, at the center (255 repaints), in 8 px steps."""
    side = max(8, int(round(size * ratio ** 0.5 / 8)) * 8)
    mask = np.zeros((size, size), np.uint8)
    start = (size - side) // 2
    mask[start:start + side, start:start + side] = 255
    return mask


def ordered_blocks(unet) -> list[tuple[object, int]]:
    """(transformer block, its level) in the order a step runs them: down, mid, up."""
    from diffusers.models.attention import BasicTransformerBlock

    levels = len(unet.down_blocks)
    parts = [(b, i) for i, b in enumerate(unet.down_blocks)] + [(unet.mid_block, levels - 1)] + \
        [(b, levels - 1 - i) for i, b in enumerate(unet.up_blocks)]
    return [(m, level) for part, level in parts for m in part.modules() if isinstance(m, BasicTransformerBlock)]


def gpu_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    """GPU milliseconds of each of `iters` calls of `fn` (CUDA events on the current stream)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return times


def measure_blocks(unet, size: int, rows: int = 2, iters: int = 10) -> list[dict]:
    """Per block in step order: its install index, level, tokens, width, `without_ms`, `with_ms`
    per ratio, `load_ms` and `record_bytes`, for `rows` rows (the UNet's device and dtype)."""
    import torch
    from diffusers.models.attention import BasicTransformerBlock

    from backends.core.runtime.token_subsets import (REUSE, TemplateActivations, TokenLayout, TokenRow, masked_rows,
                                                     computed_tokens, install)

    param = next(unet.parameters())
    device, dtype, cuda = param.device, param.dtype, param.device.type == "cuda"
    if not any(hasattr(m, "_subset_index") for m in unet.modules()):
        install(unet)
    latent = size // 8
    g = torch.Generator(device).manual_seed(0)
    text = torch.randn(rows, 77, unet.config.cross_attention_dim, generator=g, device=device, dtype=dtype)
    stream = torch.cuda.Stream(device) if cuda else None

    def timed_ms(fn) -> float:
        if cuda:
            return statistics.median(gpu_ms(fn, iters, warmup=1))
        fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    out = []
    with torch.inference_mode():
        for block, level in ordered_blocks(unet):
            side = latent >> level
            tokens, width = side * side, block.norm1.normalized_shape[0]
            x = torch.randn(rows, tokens, width, generator=g, device=device, dtype=dtype)
            record = TemplateActivations(rows)
            for r in range(rows):
                record.put(0, block._subset_index, r, x[r])
            whole = timed_ms(lambda: BasicTransformerBlock.forward(block, x, encoder_hidden_states=text))
            entry = {"index": block._subset_index, "level": level, "tokens": tokens, "width": width,
                     "without_ms": whole, "with_ms": {}, "record_bytes": record.nbytes, "load_ms": 0.0}
            for ratio in RATIOS:
                mask = torch.from_numpy(centered_mask(latent, ratio) / 255.0).to(device)[None, None]
                computed = computed_tokens(mask, len(unet.config.block_out_channels))
                layout = TokenLayout(tuple(TokenRow(REUSE, record, 0, r, computed) for r in range(rows)))
                every = tuple(range(rows))
                entry["with_ms"][str(ratio)] = timed_ms(lambda: masked_rows(block, layout, every, x, text))
            if cuda:  # one step's recorded output of the block, pinned host -> device on a load stream
                entry["load_ms"] = load_ms(rows * tokens * width * x.element_size(), device, stream, iters)
            out.append(entry)
    return out


def load_ms(nbytes: int, device, stream, iters: int) -> float:
    """GPU ms of a copy of `nbytes` from pinned host memory to `device` on the load stream `stream`
    (median of `iters`)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(host, device=device)

    def load():
        with torch.cuda.stream(stream):
            target.copy_(host, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(stream)
    return statistics.median(gpu_ms(load, iters, warmup=1))


def recorded_layout(config, size: int, rows: int = 1, blocks: bool = True, convs: bool = True,
                    dtype=None) -> list[tuple[tuple, object]]:
    """(shape, dtype) of each output a template recording keeps per step for `rows` rows, in the
    order a step makes them, from a meta-device UNet of `config` (no weights, no device): with
    `blocks` each transformer block's [rows, L, C]; with `convs` (runtime/conv_subsets.py) each
    plain ResNet block's output, norm2's statistics [rows, 2, groups] and per-position deviation
    sums [rows, 2, groups, h, w] (fp32), and each plain upsampler's output. Outputs in `dtype`
    (fp16 by default)."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention import BasicTransformerBlock

    from backends.core.runtime import conv_subsets

    dtype = dtype or torch.float16
    layout = []

    def keep(module, args, output):
        if isinstance(module, BasicTransformerBlock):
            layout.append(((rows, *output.shape[1:]), dtype))
        elif conv_subsets.plain(module):
            (channels, h, w), groups = output.shape[1:], module.norm2.num_groups
            layout.extend([((rows, channels, h, w), dtype), ((rows, 2, groups), torch.float32),
                           ((rows, 2, groups, h, w), torch.float32)])
        else:  # a plain upsampler
            layout.append(((rows, *output.shape[1:]), dtype))

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config).eval()
        cfg = unet.config
        for m in unet.modules():
            if (blocks and isinstance(m, BasicTransformerBlock)) or \
                    (convs and (conv_subsets.plain(m) or conv_subsets.plain_upsampler(m))):
                m.register_forward_hook(keep)
        latent = size // 8
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        with torch.no_grad():
            unet(torch.empty(1, cfg.in_channels, latent, latent), torch.tensor(999.0),
                 torch.empty(1, 77, cfg.cross_attention_dim),
                 added_cond_kwargs={"text_embeds": torch.empty(1, pooled), "time_ids": torch.empty(1, 6)})
    return layout


def layout_bytes(layout) -> int:
    """The bytes of recorded_layout's outputs."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)


def conv_record_bytes(unet, size: int) -> int:
    """One row's bytes of a step's recording outside the transformer blocks under conv_subsets
    (recorded_layout's `convs` part, in the UNet's dtype)."""
    dtype = next(unet.parameters()).dtype
    return layout_bytes(recorded_layout(unet.config, size, rows=1, blocks=False, dtype=dtype))


def as_profile(measured: list[dict], size: int, rows: int, fixed_load_ms: float = 0.0) -> BlockProfile:
    """`fixed_load_ms`: one row's loads every streamed step makes outside the blocks."""
    def per_row_s(ms: float) -> float:
        return ms / 1e3 / rows

    return BlockProfile(size, RATIOS, tuple(
        ProfiledBlock(e["index"], per_row_s(e["without_ms"]), tuple(per_row_s(e["with_ms"][str(r)]) for r in RATIOS),
                      per_row_s(e["load_ms"])) for e in measured), fixed_load_ms / 1e3)


def profile_template(repo: str | Path, size: int | None = None, iters: int = 10) -> list[Path]:
    """Measures on the first denoiser's device (its UNet) and writes the profile into every
    denoiser of `repo`; returns the files written."""
    from backends.core.engine.config import DenoiserConfig
    from backends.core.runtime.artifacts import load_unet_halves
    from backends.core.runtime.placement import Placement
    from export.triton_config import read_parameters

    repo = Path(repo)
    denoisers = sorted(p.parent for p in repo.glob("denoiser*/config.pbtxt"))
    if not denoisers:
        raise ValueError(f"{repo}: no denoiser in this repository")
    first = next(d for d in denoisers if (d / "1" / "unet").exists())
    params = read_parameters(first / "config.pbtxt")
    device = "cuda:0" if "KIND_GPU" in (first / "config.pbtxt").read_text() else "cpu"
    config = DenoiserConfig.from_json(params["denoiser"])
    size = size or config.limits.default_width
    unet, _, _ = load_unet_halves(first / "1", Placement(device, params.get("dtype", "fp32")))
    fixed_ms = 0.0  # (on a CPU loads cost nothing: the recording is where the compute is)
    if config.runtime.conv_subsets and device.startswith("cuda"):
        import torch

        nbytes = conv_record_bytes(unet, size)
        fixed_ms = load_ms(nbytes, device, torch.cuda.Stream(device), iters)
        log.info("a row of a step's ResNet and upsampler recordings: %.1f MB, %.3f ms to load", nbytes / 1e6, fixed_ms)
    measured = measure_blocks(unet, size, iters=iters)
    log.info("%s", summary(measured, rows=2))
    profile = as_profile(measured, size, rows=2, fixed_load_ms=fixed_ms)
    return [profile.write(d / "1") for d in denoisers]


def summary(measured: list[dict], rows: int) -> str:
    """One line on a step's transformer blocks for `rows` rows: their recorded outputs' bytes and
    load time (the link's rate), and their time on every token and at each profiled ratio."""
    nbytes = sum(e["record_bytes"] for e in measured)
    load = sum(e["load_ms"] for e in measured)
    rate = f", {nbytes / load / 1e6:.1f} GB/s" if load > 0 else ""
    masked = ", ".join(f"{r:g}: {sum(e['with_ms'][str(r)] for e in measured):.2f}" for r in RATIOS)
    return (f"{len(measured)} transformer blocks, {rows} rows: recorded outputs {nbytes / 1e6:.1f} MB a step, loaded in "
            f"{load:.2f} ms{rate}; whole {sum(e['without_ms'] for e in measured):.2f} ms, on a mask's tokens (ms) {masked}")
