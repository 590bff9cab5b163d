"""Random ResNet blocks and upsamplers on boxes (conv_subsets' static form) for comparing the boxes'
Triton kernels (plugins/resnet_box_kernel.py) with their torch form: on the CPU through Triton's
interpreter (tests/unit/test_box_kernels_cpu.py) and on a GPU (tests/gpu/test_box_kernels.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Box = tuple[int, int, int, int]  # (top, bottom, left, right) of a row's mask on the grid

# (in channels, out channels, height, width, each row's mask box, the static box's sides): an identity
# shortcut and a convolution; boxes in the middle and at the grid's edges
SMALL = ((8, 8, 10, 12, ((1, 4, 2, 5), (6, 10, 9, 12)), (5, 6)),
         (8, 16, 10, 12, ((1, 4, 2, 5), (6, 10, 9, 12), (0, 1, 0, 2)), (5, 5)))


def tokens(boxes: tuple[Box, ...], height: int, width: int, device) -> torch.Tensor:
    """Each row's computed tokens ([rows, n], padded by repeating its last) for masks of `boxes`."""
    from backends.core.runtime.token_subsets import computed_tokens

    rows = []
    for top, bottom, left, right in boxes:
        m = torch.zeros(1, 1, height, width)
        m[..., top:bottom, left:right] = 1
        rows.append(computed_tokens(m, 1)[height * width])
    n = max(len(t) for t in rows)
    return torch.stack([torch.cat([t, t[-1:].expand(n - len(t))]) for t in rows]).to(device)


def resnet_args(c_in: int, c_out: int, height: int, width: int, boxes: tuple[Box, ...], sides: tuple[int, int],
                fmt: torch.memory_format, dtype: torch.dtype, device, groups: int = 4,
                x_fmt: torch.memory_format | None = None) -> tuple:
    """easel::resnet_box's arguments for a random block (weights in `fmt`), its recording made at
    another input; x in `x_fmt` (default `fmt`)."""
    from diffusers.models.resnet import ResnetBlock2D

    from backends.core.runtime import conv_subsets

    torch.manual_seed(0)
    block = ResnetBlock2D(in_channels=c_in, out_channels=c_out, temb_channels=12, groups=groups).eval()
    block = block.to(device, dtype).to(memory_format=fmt)
    x = torch.randn(len(boxes), c_in, height, width, dtype=dtype, device=device)
    x = x.contiguous(memory_format=x_fmt or fmt)
    temb = torch.randn(len(boxes), 12, dtype=dtype, device=device)
    with torch.inference_mode():
        recorded, stats, maps = conv_subsets.whole(block, x + 0.3 * torch.randn_like(x), temb, stats=True)
        geometry = conv_subsets.resnet_geometry(tokens(boxes, height, width, device), height, width, *sides)
        shortcut = block.conv_shortcut
        return (x, block.time_emb_proj(F.silu(temb)), geometry, recorded, stats, maps, block.norm1.weight,
                block.norm1.bias, block.conv1.weight, block.conv1.bias, block.norm2.weight, block.norm2.bias,
                block.conv2.weight, block.conv2.bias, None if shortcut is None else shortcut.weight,
                None if shortcut is None else shortcut.bias, groups, groups, block.norm1.eps, block.norm2.eps,
                float(block.output_scale_factor))


def upsample_args(channels: int, height: int, width: int, boxes: tuple[Box, ...], sides: tuple[int, int],
                  fmt: torch.memory_format, dtype: torch.dtype, device, x_fmt: torch.memory_format | None = None
                  ) -> tuple:
    """easel::upsample_box's arguments (x, geometry, recorded, weight, bias) for a random upsampler
    (weights in `fmt`, x in `x_fmt`, default `fmt`)."""
    from diffusers.models.upsampling import Upsample2D

    from backends.core.runtime import conv_subsets

    torch.manual_seed(1)
    block = Upsample2D(channels, use_conv=True).eval().to(device, dtype).to(memory_format=fmt)
    x = torch.randn(len(boxes), channels, height, width, dtype=dtype, device=device)
    x = x.contiguous(memory_format=x_fmt or fmt)
    with torch.inference_mode():
        recorded = Upsample2D.forward(block, x + 0.3 * torch.randn_like(x))
    geometry = conv_subsets.upsample_geometry(tokens(boxes, height, width, device), height, width, *sides)
    return x, geometry, recorded, block.conv.weight, block.conv.bias


def errors(device, dtype: torch.dtype, cases=SMALL, groups: int = 4) -> list[dict]:
    """For each case and layout, the Triton kernels' output against the torch form's: the largest
    difference over the largest magnitude, whether the layouts agree, and whether the box changed
    the recording at all (else the comparison would prove nothing). The layouts: NCHW, channels_last,
    and an NCHW x beside channels_last weights (SDXL's transformer models return NCHW)."""
    from backends.core.runtime import conv_subsets
    from plugins import resnet_box_kernel

    nchw, cl = torch.contiguous_format, torch.channels_last
    out = []
    for fmt, x_fmt, layout in ((nchw, nchw, "nchw"), (cl, cl, "channels_last"), (cl, nchw, "nchw x")):
        for c_in, c_out, height, width, boxes, sides in cases:
            args = resnet_args(c_in, c_out, height, width, boxes, sides, fmt, dtype, device, groups, x_fmt)
            with torch.inference_mode():
                want = conv_subsets.resnet_box_body(*args)
                got = resnet_box_kernel.resnet_box(*args)
            out.append(_compare(f"resnet {c_in}->{c_out} {layout}", got, want, args[3]))
            up_sides = (min(2 * height, 2 * sides[0] + 2), min(2 * width, 2 * sides[1] + 2))
            up = upsample_args(c_in, height, width, boxes, up_sides, fmt, dtype, device, x_fmt)
            with torch.inference_mode():
                want = conv_subsets.upsample_box_body(*up)
                got = resnet_box_kernel.upsample_box(*up)
            out.append(_compare(f"upsample {c_in} {layout}", got, want, up[2]))
    return out


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, recorded: torch.Tensor) -> dict:
    scale = want.float().abs().max()
    return {"case": name, "rel_err": float((got.float() - want.float()).abs().max() / scale),
            "same_layout": got.stride() == want.stride(), "changed": bool((want != recorded).any())}
