"""PSNR and SSIM between two uint8 RGB images: how far an approximate method lands from exact."""

from __future__ import annotations

import numpy as np


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray, window: int = 7) -> float:
    """Mean SSIM over channels with a uniform window (Wang et al. 2004 constants)."""
    from numpy.lib.stride_tricks import sliding_window_view

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    scores = []
    for ch in range(a.shape[-1]):
        x = sliding_window_view(a[..., ch].astype(np.float64), (window, window))
        y = sliding_window_view(b[..., ch].astype(np.float64), (window, window))
        mx, my = x.mean(axis=(-1, -2)), y.mean(axis=(-1, -2))
        vx, vy = x.var(axis=(-1, -2)), y.var(axis=(-1, -2))
        cov = ((x - mx[..., None, None]) * (y - my[..., None, None])).mean(axis=(-1, -2))
        s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
        scores.append(s.mean())
    return float(np.mean(scores))
