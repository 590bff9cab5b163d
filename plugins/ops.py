"""The fused kernels as torch custom ops: easel::group_norm_silu and easel::geglu.

Registered as custom ops (not plain Python functions) so that torch.compile sees one opaque
node with a fake (shape-only) implementation instead of tracing into Triton launches, and so
CUDA-graph capture records the launches like any other kernel.

Dispatch: CUDA tensors run the Triton kernels; every other device runs the unfused torch
reference, so models patched with these ops still run on CPU. With TRITON_INTERPRET=1 in the
environment CPU tensors run the Triton kernels too, through Triton's interpreter: that is how
the kernels are tested on machines without a GPU. Outputs are always contiguous, whatever
the input's layout, so the fake and real implementations agree on strides. Inference only:
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
        else:
            from plugins import geglu_kernel as mod
    except ImportError as e:
        raise RuntimeError(f"easel::{name} on a GPU needs the `triton` package ({e})") from e
    return mod


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_group_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int) -> None:
    torch._check(x.dim() >= 3, lambda: f"group_norm_silu wants [N, C, *spatial], got shape {tuple(x.shape)}")
    C = x.shape[1]
    torch._check(num_groups > 0 and C % num_groups == 0,
                 lambda: f"group_norm_silu: {C} channels do not split into {num_groups} groups")
    torch._check(weight.shape == (C,) and bias.shape == (C,),
                 lambda: f"group_norm_silu: weight/bias must be [{C}], got {tuple(weight.shape)}, {tuple(bias.shape)}")


@torch.library.custom_op("easel::group_norm_silu", mutates_args=())
def group_norm_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int,
                    eps: float) -> torch.Tensor:
    """silu(group_norm(x, num_groups, weight, bias, eps)) for x [N, C, *spatial]."""
    _check_group_norm(x, weight, bias, num_groups)
    if _interpreting():
        return _kernels("group_norm_silu").group_norm_silu_triton(x, weight, bias, num_groups, eps)
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps)).contiguous()


@group_norm_silu.register_kernel("cuda")
def _group_norm_silu_cuda(x, weight, bias, num_groups, eps):
    _check_group_norm(x, weight, bias, num_groups)
    return _kernels("group_norm_silu").group_norm_silu_triton(x, weight, bias, num_groups, eps)


@group_norm_silu.register_fake
def _group_norm_silu_fake(x, weight, bias, num_groups, eps):
    _check_group_norm(x, weight, bias, num_groups)
    return x.new_empty(x.shape)


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
