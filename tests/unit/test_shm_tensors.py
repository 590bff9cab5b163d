"""The shared-memory hand-off format of the LoRA loaders: what goes in comes out, bit for bit."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from backends.core.adapters import shm_tensors
from backends.core.adapters.shm_tensors import read_tensors, write_tensors


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    return {
        "a/up": torch.randn(7, 3, generator=g).half(),  # odd byte counts between wider tensors
        "b/down": base.t(),  # not contiguous
        "c/view": base[1:3],  # a view into another tensor's storage
        "d/bf16": torch.randn(5, generator=g).bfloat16(),
        "e/flag": torch.tensor([True, False, True]),
        "f/empty": torch.empty(0, 4),
        "g/double": torch.randn(3, generator=g, dtype=torch.float64),
    }


def test_round_trip_is_exact_and_is_safetensors(tmp_path):
    tensors = sample()
    path = str(tmp_path / "segment")
    nbytes = write_tensors(path, tensors)
    assert nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    back = read_tensors(path)
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape
        assert torch.equal(back[key], tensor), key
    # The library reads it too: the layout is safetensors', no holes, data 8-byte aligned.
    library = load_file(path)
    assert all(torch.equal(library[k], t) for k, t in tensors.items())
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    assert length % 8 == 0
    for entry in header.values():  # each tensor starts at a multiple of its element size
        assert entry["data_offsets"][0] % shm_tensors.DTYPES[entry["dtype"]].itemsize == 0


def test_truncated_segment_fails_clearly(tmp_path):
    path = tmp_path / "segment"
    write_tensors(str(path), sample())
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(EOFError, match="5 bytes early"):
        read_tensors(str(path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_read_to_gpu_in_chunks(tmp_path):
    tensors = {**sample(), "h/big": torch.randn(1000)}
    path = str(tmp_path / "segment")
    write_tensors(path, tensors)
    staging = shm_tensors.Staging(chunk_bytes=64)  # many chunks through both pinned buffers
    for _ in range(2):  # the staging chunks are reused
        back = read_tensors(path, "cuda", staging)
        for key, tensor in tensors.items():
            assert back[key].is_cuda and torch.equal(back[key].cpu(), tensor), key
    back = read_tensors(path, "cuda")  # chunks of its own
    assert all(torch.equal(back[k].cpu(), t) for k, t in tensors.items())


def test_a_file_another_writer_left_unaligned_reads_exactly(tmp_path):
    """A safetensors file from a writer that packs tensors in key order: an fp32 tensor after
    an odd number of fp16 ones starts off its alignment (LoRA files are read directly)."""
    half, single = torch.arange(3, dtype=torch.float16), torch.tensor([1.5, -2.25], dtype=torch.float32)
    header = {"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]}}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path = tmp_path / "packed.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + half.numpy().tobytes() + single.numpy().tobytes())
    back = read_tensors(str(path))
    assert torch.equal(back["a"], half) and torch.equal(back["b"], single)
    assert torch.equal(load_file(str(path))["b"], single)  # as the library reads it
