"""A step of a template recording as export/profile_template.recorded_layout gives it (what
bench/micro/host_copy.py copies), from a meta-device SDXL UNet: what a recording keeps per step,
the size the server logged for it, and the block it packs into."""

from __future__ import annotations

import torch

from backends.core.engine import host_block
from export.profile_template import layout_bytes, recorded_layout
from export.tiny import unet_kwargs


def test_a_step_of_an_sdxl_recording_is_what_the_server_keeps():
    blocks = recorded_layout(unet_kwargs("sdxl"), 1024, rows=2, convs=False)
    assert len(blocks) == 70 and layout_bytes(blocks) == 2 * 209_715_200  # 210 MB a row (README)
    with_convs = recorded_layout(unet_kwargs("sdxl"), 1024, rows=2)
    # An H200 server logged this recording's 50 steps (--conv-subsets, guidance) as 34.1 GiB.
    assert round(50 * layout_bytes(with_convs) / 2**30, 1) == 34.1
    fp32 = [shape for shape, dtype in with_convs if dtype == torch.float32]  # norm2's statistics and sums
    grids = [shape for shape, dtype in with_convs if dtype == torch.float16 and len(shape) == 4]
    assert len(fp32) == 2 * 17 and all(shape[:2] == (2, 2) for shape in fp32)  # the 17 plain ResNet blocks
    assert len(grids) == 17 + 2  # their outputs and the two upsamplers'


def test_a_step_packs_into_one_block_within_its_alignment():
    layout = recorded_layout(unet_kwargs("default"), 64, rows=2)
    outputs = {(0, i): torch.randn(shape).to(dtype) for i, (shape, dtype) in enumerate(layout)}
    block, views = host_block.pack(outputs, pin=False)
    assert layout_bytes(layout) <= block.numel() < layout_bytes(layout) + host_block.ALIGN * len(layout)
    assert all(torch.equal(views[k], t) for k, t in outputs.items())
