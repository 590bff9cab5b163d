"""The boxes' Triton kernels on a GPU (easel::resnet_box and easel::upsample_box on CUDA) against
their torch form run on the same GPU: the small cases of tests/unit/box_cases.py in fp32 without
TF32 (within 1e-5 of the largest magnitude), and SDXL's shapes at 1024 px in fp16 channels_last
(a 20% mask's box; within 1e-2: the torch form rounds to fp16 between passes that the kernels
keep in fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_fast_runtime import no_tf32  # noqa: F401  (fixture)
from tests.unit.box_cases import errors

pytestmark = pytest.mark.gpu

# 320 -> 320 at 128^2 and 640 -> 1280 (a shortcut convolution) at 32^2, each row's mask a centered
# box of about 45% of the side (a 20% mask) or a little off it, the static box half the side widened
# by 2; SDXL's 32 groups
SDXL = ((320, 320, 128, 128, ((35, 93, 35, 93), (40, 90, 32, 94)), (66, 66)),
        (640, 1280, 32, 32, ((9, 23, 9, 23), (10, 22, 9, 23)), (18, 18)))


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")


def test_the_box_kernels_give_the_torch_forms_outputs_in_fp32(no_tf32):  # noqa: F811
    for r in errors("cuda", torch.float32):
        assert r["changed"] and r["same_layout"], r
        assert r["rel_err"] <= 1e-5, r


def test_the_box_kernels_give_the_torch_forms_outputs_at_sdxl_shapes_in_fp16():
    for r in errors("cuda", torch.float16, SDXL, groups=32):
        assert r["changed"] and r["same_layout"], r
        assert r["rel_err"] <= 1e-2, r
