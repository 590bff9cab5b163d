"""PSNR and SSIM, the yardsticks for approximate methods, on images with known answers."""

import numpy as np

from clients.bench.image_metrics import psnr, ssim


def test_identical_images():
    a = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    assert psnr(a, a) == float("inf") and abs(ssim(a, a) - 1.0) < 1e-12


def test_known_psnr_and_ordering():
    a = np.full((16, 16, 3), 100, dtype=np.uint8)
    b = a + 10  # MSE 100 -> 10*log10(255^2/100) = 28.13 dB
    assert abs(psnr(a, b) - 28.1308) < 1e-3
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)
    light = np.clip(img + rng.normal(0, 5, img.shape), 0, 255).astype(np.uint8)
    heavy = np.clip(img + rng.normal(0, 40, img.shape), 0, 255).astype(np.uint8)
    assert psnr(img, light) > psnr(img, heavy) and ssim(img, light) > ssim(img, heavy) > 0
