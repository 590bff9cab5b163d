"""Tensors handed from one process to another as one file in shared memory (/dev/shm), and LoRA
files read straight onto the GPU.

The file is in the safetensors layout (an 8-byte little-endian header length, a JSON header
of dtype, shape and byte offsets, then the data), written and read here without the library:
`safetensors.save_file` serializes everything into memory before writing it (two copies of
hundreds of MiB), and its readers give one host tensor per key, where a GPU wants one copy of
the whole data section. Tensors are written largest element size first, so every tensor's
offset is a multiple of its element size and the reader can view them in one buffer. A LoRA file
is in the same layout, so the reader also reads one whole (backends/core/adapters/lora_loader.py).

Reading for a GPU goes through two small pinned chunks (`Staging`): the file is read into one
while the other is being copied to the device. Pinned memory is what lets the copy run
asynchronously at full speed; bounded chunks keep it small however big the LoRA. A reader keeps
its `Staging` and reads on one stream of its own: pinning memory and allocating device memory
take the driver's locks, and on the H200 host doing them per load stalled the denoiser's step
loop (launching kernels from another thread) by 100-700 ms.
"""

from __future__ import annotations

import json
import os
import struct

import torch

# safetensors' dtype names
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
CHUNK_BYTES = 32 << 20
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write CPU tensors to `path`; returns the bytes of tensor data."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset = {}, 0
    for key in order:
        tensor = tensors[key]
        if tensor.dtype not in NAMES:
            raise TypeError(f"{key}: dtype {tensor.dtype} cannot be handed over")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as in safetensors
    with open(path, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for key in order:
            tensor = tensors[key].detach().contiguous()
            if tensor.numel():
                _write_all(f, memoryview(tensor.view(-1).view(torch.uint8).numpy()))
    return offset


class Staging:
    """Two pinned host chunks for reading files onto a GPU, allocated once."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunks = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]


def read_tensors(path: str, device: torch.device | str = "cpu", staging: Staging | None = None
                 ) -> dict[str, torch.Tensor]:
    """The tensors of a file written by `write_tensors`, as views of one buffer on `device`.
    For a CUDA device the copy runs on the current stream, through `staging` (or chunks pinned
    for this call), and is complete when this returns."""
    device = torch.device(device)
    with open(path, "rb", buffering=0) as f:
        (length,) = struct.unpack("<Q", _read_exactly(f, 8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a header of {length} bytes, over the {MAX_HEADER_BYTES} safetensors allows")
        header = json.loads(_read_exactly(f, length))
        size = os.fstat(f.fileno()).st_size - 8 - length
        header.pop("__metadata__", None)
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if end > size:
            raise EOFError(f"{path}: ends {end - size} bytes early")
        if device.type == "cuda":
            data = torch.empty(size, dtype=torch.uint8, device=device)
            _read_to_device(f, data, staging or Staging(min(CHUNK_BYTES, max(size, 1))))
        else:  # read, not mapped: a file truncated later (one of the adapter store's) cannot fault us
            data = torch.empty(size, dtype=torch.uint8)
            _read_into(f, data)
    # One typed view of the buffer per dtype, sliced per tensor: fewer torch ops a tensor. Beside a
    # Python-busy thread, each op of the loader's feeder thread can wait for the GIL, and over a
    # LoRA's 1,400 tensors that dominated the read (bench/micro/lora_read_contention.py: 36 s, 13 s now).
    tensors, typed = {}, {}
    for key, entry in header.items():
        start, end = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        width = dtype.itemsize
        if start % width:  # a writer that did not align it (ours and safetensors' do)
            tensors[key] = data[start:end].clone().view(dtype).view(entry["shape"])
            continue
        if dtype not in typed:
            typed[dtype] = data[:data.numel() - data.numel() % width].view(dtype)
        tensors[key] = typed[dtype][start // width:end // width].view(entry["shape"])
    return tensors


def _read_to_device(f, data: torch.Tensor, staging: Staging) -> None:
    chunks, step = staging.chunks, staging.chunks[0].numel()
    copied = [None, None]  # the event after each chunk's last copy: it may be refilled once that is done
    stream = torch.cuda.current_stream(data.device)
    for index, start in enumerate(range(0, data.numel(), step)):
        slot = index % 2
        if copied[slot] is not None:
            copied[slot].synchronize()
        n = min(step, data.numel() - start)
        _read_into(f, chunks[slot][:n])
        data[start:start + n].copy_(chunks[slot][:n], non_blocking=True)
        copied[slot] = torch.cuda.Event()
        copied[slot].record(stream)
    stream.synchronize()


def _read_into(f, buffer: torch.Tensor) -> None:
    view, done = memoryview(buffer.numpy()), 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise EOFError(f"{f.name}: ends {len(view) - done} bytes early")
        done += n


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError(f"{f.name}: ends {n - len(data)} bytes early")
    return data


def _write_all(f, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += f.write(view[done:])
