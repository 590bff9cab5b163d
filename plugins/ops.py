"""The fused kernels as torch custom ops: easel::group_norm_silu, easel::bias_residual and easel::geglu.

Registered as custom ops (not plain Python functions) so that torch.compile sees one opaque
node with a fake (shape-only) implementation instead of tracing into Triton launches, and so
CUDA-graph capture records the launches like any other kernel.

Dispatch: CUDA tensors run the Triton kernels; every other device runs the unfused torch
reference, so models patched with these ops still run on CPU. With TRITON_INTERPRET=1 in the
environment CPU tensors run the Triton kernels too, through Triton's interpreter: that is how
the kernels are tested on machines without a GPU. A 4-D channels_last input gives a channels_last
output on CUDA (NHWC kernels: no layout copies around cuDNN's NHWC convolutions); any other input
gives a contiguous one, so the fake and real implementations agree on strides. Inference only:
no autograd formula is registered.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _kernels(name: str):
    """The Triton module `name`, imported on first use so that CPU-only installs need no triton."""
    try:
        if name == "group_norm_silu":
            from plugins import groupnorm_silu_kernel as mod
        elif name == "group_norm_silu_nhwc":
            from plugins import groupnorm_silu_nhwc_kernel as mod
        elif name == "bias_residual":
            from plugins import residual_kernel as mod
        else:
            from plugins import geglu_kernel as mod
    except ImportError as e:
        raise RuntimeError(f"easel::{name} on a GPU needs the `triton` package ({e})") from e
    return mod


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def layout_of(x: torch.Tensor) -> torch.memory_format:
    """The outputs' layout: channels_last for a 4-D NHWC input (not also NCHW) that the Triton
    kernels serve (CUDA, or the interpreter), else contiguous. The CPU reference keeps to NCHW:
    what torch's own CPU GroupNorm returns, so that a patched model runs the same CPU convolutions."""
    nhwc = (x.dim() == 4 and (x.is_cuda or _interpreting()) and not x.is_contiguous()
            and x.is_contiguous(memory_format=torch.channels_last))
    return torch.channels_last if nhwc else torch.contiguous_format


def _channel_bias(bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return bias.view(1, -1, *([1] * (x.dim() - 2)))


def _check_channels(op: str, x: torch.Tensor, **vectors: torch.Tensor | None) -> None:
    torch._check(x.dim() >= 3, lambda: f"{op} wants [N, C, *spatial], got shape {tuple(x.shape)}")
    C = x.shape[1]
    for name, v in vectors.items():
        torch._check(v is None or v.shape == (C,), lambda: f"{op}: {name} must be [{C}], got {tuple(v.shape)}")


def _check_group_norm(x, weight, bias, num_groups, pre_bias) -> None:
    _check_channels("group_norm_silu", x, weight=weight, bias=bias, pre_bias=pre_bias)
    C = x.shape[1]
    torch._check(num_groups > 0 and C % num_groups == 0,
                 lambda: f"group_norm_silu: {C} channels do not split into {num_groups} groups")


@torch.library.custom_op("easel::group_norm_silu", mutates_args=())
def group_norm_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int,
                    eps: float, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(group_norm(x + pre_bias, num_groups, weight, bias, eps)) for x [N, C, *spatial];
    pre_bias [C] (optional) is a bias per channel, the convolution's that wrote x."""
    _check_group_norm(x, weight, bias, num_groups, pre_bias)
    if _interpreting():
        return _group_norm_silu_triton(x, weight, bias, num_groups, eps, pre_bias)
    if pre_bias is not None:
        x = x + _channel_bias(pre_bias, x)
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps)).contiguous(memory_format=layout_of(x))


def _group_norm_silu_triton(x, weight, bias, num_groups, eps, pre_bias):
    if layout_of(x) == torch.channels_last:
        return _kernels("group_norm_silu_nhwc").group_norm_silu_nhwc(x, weight, bias, num_groups, eps, pre_bias)
    return _kernels("group_norm_silu").group_norm_silu_triton(x, weight, bias, num_groups, eps, pre_bias)


@group_norm_silu.register_kernel("cuda")
def _group_norm_silu_cuda(x, weight, bias, num_groups, eps, pre_bias=None):
    _check_group_norm(x, weight, bias, num_groups, pre_bias)
    return _group_norm_silu_triton(x, weight, bias, num_groups, eps, pre_bias)


@group_norm_silu.register_fake
def _group_norm_silu_fake(x, weight, bias, num_groups, eps, pre_bias=None):
    _check_group_norm(x, weight, bias, num_groups, pre_bias)
    return torch.empty_like(x, memory_format=layout_of(x))


def _check_bias_residual(h, bias, residual) -> None:
    _check_channels("bias_residual", h, bias=bias)
    torch._check(residual.shape == h.shape,
                 lambda: f"bias_residual: residual {tuple(residual.shape)} is not h's {tuple(h.shape)}")


@torch.library.custom_op("easel::bias_residual", mutates_args=())
def bias_residual(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float) -> torch.Tensor:
    """(residual + (h + bias[c])) / scale for h, residual [N, C, *spatial]: a ResnetBlock2D's
    output, its second convolution's bias added here instead of in a pass of its own."""
    _check_bias_residual(h, bias, residual)
    if _interpreting():
        return _bias_residual_triton(h, bias, residual, scale)
    out = (residual + (h + _channel_bias(bias, h))) / scale
    return out.contiguous(memory_format=layout_of(h))


def _bias_residual_triton(h, bias, residual, scale):
    layout = layout_of(h)
    h, residual = h.contiguous(memory_format=layout), residual.contiguous(memory_format=layout)
    return _kernels("bias_residual").bias_residual_triton(h, bias, residual, scale, layout == torch.channels_last)


@bias_residual.register_kernel("cuda")
def _bias_residual_cuda(h, bias, residual, scale):
    _check_bias_residual(h, bias, residual)
    return _bias_residual_triton(h, bias, residual, scale)


@bias_residual.register_fake
def _bias_residual_fake(h, bias, residual, scale):
    _check_bias_residual(h, bias, residual)
    return torch.empty_like(h, memory_format=layout_of(h))


def _check_geglu(x: torch.Tensor) -> None:
    torch._check(x.dim() >= 1 and x.shape[-1] % 2 == 0,
                 lambda: f"geglu wants [..., 2*D], got shape {tuple(x.shape)}")


@torch.library.custom_op("easel::geglu", mutates_args=())
def geglu(x: torch.Tensor) -> torch.Tensor:
    """x[..., :D] * gelu(x[..., D:]) (exact erf gelu) for x [..., 2*D], as diffusers' GEGLU."""
    _check_geglu(x)
    if _interpreting():
        return _kernels("geglu").geglu_triton(x)
    hidden, gate = x.chunk(2, dim=-1)
    return (hidden * F.gelu(gate)).contiguous()


@geglu.register_kernel("cuda")
def _geglu_cuda(x):
    _check_geglu(x)
    return _kernels("geglu").geglu_triton(x)


@geglu.register_fake
def _geglu_fake(x):
    _check_geglu(x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
