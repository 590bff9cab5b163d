"""runtime/conv_subsets.py on a random diffusers ResNet block: its output computed on a box equals
the whole block's there (at the grid's corners and edges too, where the cut is zero-padded as the
convolutions pad), and outside the box is the recording; boxes of masks per token grid."""

from __future__ import annotations

import pytest
import torch

from backends.core.runtime.conv_subsets import _deviation_sums, _stats, corrected, masked_boxes, plain, region, \
    whole, widened


@pytest.mark.parametrize("channels", [(8, 8), (8, 16)], ids=["same-width", "1x1-shortcut"])
@pytest.mark.parametrize("box", [(0, 3, 0, 4), (4, 7, 5, 9), (7, 10, 9, 12), (0, 10, 0, 12), (2, 3, 11, 12)],
                         ids=["corner", "inside", "far-corner", "all", "edge"])
def test_a_box_computed_alone_equals_the_whole_block_there(channels, box):
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    block = ResnetBlock2D(in_channels=channels[0], out_channels=channels[1], temb_channels=12, groups=4).eval()
    assert plain(block)
    x, temb = torch.randn(3, channels[0], 10, 12), torch.randn(3, 12)
    with torch.no_grad():
        want = block(x, temb)
        got, stats, maps = whole(block, x, temb, stats=True)
        assert torch.equal(got, want)  # diffusers' forward, op for op
        recorded = torch.full_like(want, 7.0)
        y = region(block, x, temb, box, recorded, stats, maps)
    top, bottom, left, right = box
    inside = torch.zeros_like(want, dtype=torch.bool)
    inside[..., top:bottom, left:right] = True
    # (norm1's statistics from var_mean, not GroupNorm's kernel: float rounding apart)
    torch.testing.assert_close(y[inside], want[inside], rtol=0, atol=1e-5)
    assert torch.equal(y[~inside], recorded[~inside])


def test_each_row_keeps_its_own_box_of_the_shared_one():
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(1)
    block = ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=12, groups=4).eval()
    x, temb = torch.randn(2, 8, 10, 12), torch.randn(2, 12)
    with torch.no_grad():
        want, stats, maps = whole(block, x, temb, stats=True)
        recorded = torch.zeros_like(want)
        own = [(1, 4, 1, 5), (5, 9, 6, 11)]
        y = region(block, x, temb, widened(own, 10, 12), recorded, stats, maps, own)
        alone = [region(block, x[k:k + 1], temb[k:k + 1], b, recorded[k:k + 1], stats[k:k + 1], maps[k:k + 1])
                 for k, b in enumerate(own)]
    for k in range(2):
        torch.testing.assert_close(y[k:k + 1], alone[k], rtol=0, atol=1e-5)


def test_boxes_cover_the_masked_tokens_of_each_grid():
    mask = torch.zeros(1, 1, 16, 16)
    mask[..., 3:6, 9:14] = 1.0
    boxes = masked_boxes(mask, levels=3)
    assert boxes == {256: (3, 6, 9, 14), 64: (1, 3, 4, 7), 16: (0, 2, 2, 4)}  # a token partly masked counts
    assert masked_boxes(torch.zeros(1, 1, 8, 8), levels=1) == {64: None}
    assert widened([(0, 2, 3, 4), (5, 6, 10, 12)], 8, 12) == (0, 7, 2, 12)  # MARGIN 1, kept on the grid


def test_norm2_statistics_take_the_windows_values_in_place_of_the_recordings():
    """The recorded h's statistics and per-position sums, with a window of h replaced: the
    statistics of the h that results, exactly (up to fp32 rounding)."""
    torch.manual_seed(2)
    recorded = torch.randn(2, 8, 6, 7) * 3 + 1
    stats = _stats(recorded, groups=4)
    maps = _deviation_sums(recorded, stats[:, 0], groups=4)
    window = (1, 4, 2, 6)
    new = recorded.clone()
    new[..., 1:4, 2:6] = torch.randn(2, 8, 3, 4) * 5 - 2
    got = corrected(stats, maps, new[..., 1:4, 2:6], window, positions=2 * 6 * 7)
    torch.testing.assert_close(got, _stats(new, groups=4), rtol=1e-5, atol=1e-5)
