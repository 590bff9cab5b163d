"""Fused GPU kernels (Triton language) as torch custom ops, and the patch that puts them in a
diffusers UNet or VAE.

    import plugins
    y = plugins.group_norm_silu(x, weight, bias, num_groups, eps)  # torch.ops.easel.group_norm_silu
    y = plugins.bias_residual(h, conv_bias, residual, scale)        # torch.ops.easel.bias_residual
    y = plugins.geglu(projected)                                     # torch.ops.easel.geglu
    counts = plugins.use_fused_kernels(unet)                         # in place

Importing this package registers the ops and needs only torch; triton is imported on the
first CUDA call and diffusers on first use of `use_fused_kernels`.
"""

from __future__ import annotations

from plugins.ops import bias_residual, geglu, group_norm_silu

__all__ = ["bias_residual", "geglu", "group_norm_silu", "use_fused_kernels"]


def __getattr__(name: str):
    # Lazy so that `import plugins` (done by whoever just needs the ops) does not import diffusers.
    if name == "use_fused_kernels":
        from plugins.patch import use_fused_kernels

        return use_fused_kernels
    raise AttributeError(f"module 'plugins' has no attribute {name!r}")
