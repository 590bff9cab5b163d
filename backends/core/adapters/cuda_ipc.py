"""GPU memory and events shared between the denoiser's and the ControlNet service's processes.

A ControlNet call through Triton's BLS moves its tensors the Python backend's way: the caller's
stub copies every GPU input into a buffer the server allocated (a synchronous copy, so the
step's latents had to be ready on the host's word first), and every residual is copied twice on
the way back, with a host synchronisation at each process. At SDXL size that hand-off cost more
than the ControlNet's own compute, and it sat on the step's critical path.

So on GPUs a call's tensors cross in a *mailbox* instead: one allocation of the caller's, made
once with the CUDA driver and shared by its IPC handle, which the service opens once and keeps.
The caller writes the step's inputs there on its own stream and records an interprocess event;
the service's streams wait for that event on the GPU, run the ControlNet and write the residuals
back into the mailbox, then record an event of their own that the caller's stream waits for.
Nothing on either side waits on the host for the GPU, so the BLS request (names, scale and the
mailbox's description, all small host tensors) travels while the GPU is still busy with the
previous step.

The service opens only what a description names and checks it first: the handle must open, the
tensors must lie inside the opened allocation, and their names, dtypes and shapes must be what
a call has. Memory is never freed while the process lives (the other side may still have it
open), so a caller keeps at most a few mailboxes per thread and device (see Mailboxes).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from dataclasses import dataclass

import torch

from backends.core.request.params import InvalidInput

HANDLE_BYTES = 64  # CUDA's IPC handles (CUipcMemHandle, cudaIpcEventHandle_t)
ALIGN = 256  # each tensor's offset in a mailbox
MAX_TENSORS = 64
MAX_OPEN = 64  # mailboxes a service instance keeps open (a caller has a few per thread)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_TYPESTR = {torch.float16: "<f2", torch.float32: "<f4"}
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class CudaError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]  # (CUipcMemHandle: passed by value)


_driver = None
_driver_lock = threading.Lock()


def _cuda():
    global _driver
    with _driver_lock:
        if _driver is None:
            lib = ctypes.CDLL("libcuda.so.1")
            for name, args in (("cuMemAlloc_v2", (ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)),
                               ("cuIpcGetMemHandle", (ctypes.c_char_p, ctypes.c_uint64)),
                               ("cuIpcOpenMemHandle_v2", (ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint)),
                               ("cuMemGetAddressRange_v2", (ctypes.POINTER(ctypes.c_uint64),
                                                            ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64)),
                               ("cuDeviceGet", (ctypes.POINTER(ctypes.c_int), ctypes.c_int)),
                               ("cuDevicePrimaryCtxRetain", (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)),
                               ("cuCtxPushCurrent_v2", (ctypes.c_void_p,)),
                               ("cuCtxPopCurrent_v2", (ctypes.POINTER(ctypes.c_void_p),)),
                               ("cuGetErrorName", (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)))):
                getattr(lib, name).argtypes = args
                getattr(lib, name).restype = ctypes.c_int
            _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(result, ctypes.byref(name))
        raise CudaError(f"{what}: {(name.value or b'CUDA error').decode()} ({result})")


@contextlib.contextmanager
def _primary_context(device: torch.device):
    """The device's primary context (torch's) current on this thread for driver calls: a thread
    that torch has run no kernel on has none, whatever torch.cuda.device says."""
    cuda, dev, ctx = _cuda(), ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(dev), device.index), f"finding {device}")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"the context of {device}")  # (kept: torch's)
    _check(cuda.cuCtxPushCurrent_v2(ctx), f"entering the context of {device}")
    try:
        yield
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


class _Memory:
    """`nbytes` at `pointer` on `device`, as torch tensors by __cuda_array_interface__ (no copy)."""

    def __init__(self, device: torch.device, pointer: int, nbytes: int):
        self.device, self.pointer, self.nbytes = device, pointer, nbytes

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        if offset < 0 or offset % ALIGN or offset + n * dtype.itemsize > self.nbytes:
            raise InvalidInput("mailbox", f"a tensor of {n * dtype.itemsize} bytes at {offset} does not fit "
                                          f"its {self.nbytes} bytes")
        # (bf16 has no array-interface type: viewed as 2-byte voids, then reinterpreted)
        view = _ArrayView(self.pointer + offset, shape, dtype if dtype is not torch.bfloat16 else torch.float16)
        with torch.cuda.device(self.device):
            t = torch.as_tensor(view, device=self.device)
        return t.view(dtype) if dtype is torch.bfloat16 else t


class _ArrayView:
    def __init__(self, pointer: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[dtype],
                                         "data": (pointer, False), "version": 3, "strides": None}


def allocate(device: torch.device, nbytes: int) -> tuple[_Memory, bytes]:
    """A new allocation of the caller's own, never freed, and its IPC handle."""
    with _primary_context(device):
        pointer = ctypes.c_uint64()
        _check(_cuda().cuMemAlloc_v2(ctypes.byref(pointer), nbytes), f"allocating {nbytes} bytes on {device}")
        handle = ctypes.create_string_buffer(HANDLE_BYTES)
        _check(_cuda().cuIpcGetMemHandle(handle, pointer.value), "exporting a mailbox")
    return _Memory(device, pointer.value, nbytes), handle.raw


def open_handle(device: torch.device, handle: bytes) -> _Memory:
    """Another process's allocation on `device`, mapped into ours (under that device's context, so
    that torch sees its tensors on the device they live on)."""
    if len(handle) != HANDLE_BYTES:
        raise InvalidInput("mailbox", f"a memory handle has {HANDLE_BYTES} bytes, not {len(handle)}")
    with _primary_context(device):
        pointer, base, size = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
        raw = _Handle.from_buffer_copy(handle)
        try:
            _check(_cuda().cuIpcOpenMemHandle_v2(ctypes.byref(pointer), raw, _LAZY_PEER_ACCESS), "opening a mailbox")
        except CudaError as exc:
            raise InvalidInput("mailbox", str(exc)) from None
        _check(_cuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer.value), "sizing a mailbox")
    # (never closed: a mailbox stays open while the process lives, and MAX_OPEN bounds them)
    return _Memory(device, base.value, size.value)


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def layout(slots: list[Slot]) -> tuple[list[int], int]:
    """Each slot's offset, aligned, and the bytes they take together."""
    offsets, end = [], 0
    for s in slots:
        offsets.append(end)
        n = s.dtype.itemsize
        for d in s.shape:
            n *= d
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


@dataclass(frozen=True)
class Description:
    """What a call's BLS request says of its mailbox: where the memory is, what lies in it, and
    the event its inputs are ready after."""

    device: int
    memory: bytes
    inputs_ready: bytes
    slots: tuple[Slot, ...]

    def encode(self) -> bytes:
        dtype_names = {v: k for k, v in DTYPES.items()}
        return json.dumps({"device": self.device, "memory": self.memory.hex(), "inputs_ready": self.inputs_ready.hex(),
                           "slots": [[s.name, list(s.shape), dtype_names[s.dtype]] for s in self.slots]}).encode()

    @classmethod
    def decode(cls, data: bytes, devices: int) -> "Description":
        """A description from a request, or InvalidInput naming what is wrong with it."""
        try:
            d = json.loads(data)
            device, memory, ready = d["device"], bytes.fromhex(d["memory"]), bytes.fromhex(d["inputs_ready"])
            slots = tuple(Slot(str(name), tuple(int(x) for x in shape), DTYPES[dtype]) for name, shape, dtype in d["slots"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidInput("mailbox", f"is not a mailbox description ({type(exc).__name__})") from None
        if not isinstance(device, int) or not 0 <= device < devices:
            raise InvalidInput("mailbox", f"device {device!r} is not one of this host's {devices} GPUs")
        if len(memory) != HANDLE_BYTES or len(ready) != HANDLE_BYTES:
            raise InvalidInput("mailbox", f"handles have {HANDLE_BYTES} bytes")
        if not 0 < len(slots) <= MAX_TENSORS or any(x < 0 for s in slots for x in s.shape):
            raise InvalidInput("mailbox", f"names 1 to {MAX_TENSORS} tensors of sizes 0 or more")
        return cls(device, memory, ready, slots)


class Mailboxes:
    """The caller's side: one mailbox per thread and device, grown (never freed) when a call needs
    more room, with the event that says its inputs are written."""

    def __init__(self):
        self._local = threading.local()

    def get(self, device: torch.device, nbytes: int):
        boxes = getattr(self._local, "boxes", None)
        if boxes is None:
            boxes = self._local.boxes = {}
        box = boxes.get(device)
        if box is None or box[0].nbytes < nbytes:
            size = max(nbytes, 2 * box[0].nbytes if box else 0)
            memory, handle = allocate(device, size)
            event = box[2] if box else torch.cuda.Event(interprocess=True)  # (on the current device: ours)
            box = boxes[device] = (memory, handle, event)
        return box


class OpenedMailboxes:
    """The service's side: mailboxes and events of callers, opened once and kept (bounded)."""

    def __init__(self, limit: int = MAX_OPEN):
        self.limit = limit
        self._memory: dict[tuple[int, bytes], _Memory] = {}
        self._events: dict[tuple[int, bytes], torch.cuda.Event] = {}
        self._lock = threading.Lock()

    def memory(self, device: torch.device, handle: bytes) -> _Memory:
        with self._lock:
            key = (device.index, handle)
            memory = self._memory.get(key)
            if memory is None:
                if len(self._memory) >= self.limit:
                    raise InvalidInput("mailbox", f"this instance has {self.limit} mailboxes open already")
                memory = self._memory[key] = open_handle(device, handle)
            return memory

    def event(self, device: torch.device, handle: bytes) -> torch.cuda.Event:
        with self._lock:
            key = (device.index, handle)
            event = self._events.get(key)
            if event is None:
                if len(self._events) >= self.limit:
                    raise InvalidInput("mailbox", f"this instance has {self.limit} events open already")
                if len(handle) != HANDLE_BYTES:
                    raise InvalidInput("mailbox", f"an event handle has {HANDLE_BYTES} bytes, not {len(handle)}")
                try:
                    event = torch.cuda.Event.from_ipc_handle(device, handle)
                except RuntimeError as exc:
                    raise InvalidInput("mailbox", f"its event does not open ({exc})") from None
                self._events[key] = event
            return event
