"""The mailbox description a ControlNet call carries (backends/core/adapters/cuda_ipc.py): what a
caller writes decodes to the same thing, and whatever else arrives is refused naming `mailbox`
before anything is opened. The GPU side: tests/gpu/test_cuda_ipc.py."""

from __future__ import annotations

import json

import pytest
import torch

from backends.core.adapters.cuda_ipc import ALIGN, HANDLE_BYTES, Description, Slot, layout
from backends.core.request.params import InvalidInput


def _description(**change) -> bytes:
    d = Description(1, bytes(range(HANDLE_BYTES)), bytes(HANDLE_BYTES),
                    (Slot("sample", (2, 4, 8, 8), torch.float16), Slot("timestep", (2,), torch.float32)))
    data = json.loads(d.encode())
    data.update(change)
    return json.dumps(data).encode()


def test_a_description_round_trips():
    slots = (Slot("sample", (2, 4, 128, 128), torch.bfloat16), Slot("mid", (2, 1280, 32, 32), torch.float16))
    d = Description(0, b"\x01" * HANDLE_BYTES, b"\x02" * HANDLE_BYTES, slots)
    assert Description.decode(d.encode(), devices=1) == d


def test_slots_are_aligned_and_packed():
    slots = [Slot("a", (3,), torch.float16), Slot("b", (2, 100), torch.float32), Slot("c", (0,), torch.float16)]
    offsets, nbytes = layout(slots)
    assert offsets == [0, ALIGN, ALIGN + 1024]
    assert nbytes == ALIGN + 1024


@pytest.mark.parametrize("data, says", [
    (b"not json", "is not a mailbox description"),
    (_description(device=3), "device 3 is not one of this host's 2 GPUs"),
    (_description(device="0"), "device '0'"),
    (_description(memory="00" * 10), f"handles have {HANDLE_BYTES} bytes"),
    (_description(memory="zz"), "is not a mailbox description"),
    (_description(slots=[["sample", [2, 4], "int64"]]), "is not a mailbox description"),
    (_description(slots=[["sample", [2, -4], "float16"]]), "sizes 0 or more"),
    (_description(slots=[]), "1 to 64 tensors"),
    (_description(slots=[["x", [1], "float16"]] * 65), "1 to 64 tensors"),
])
def test_bad_descriptions_are_refused_naming_the_mailbox(data, says):
    with pytest.raises(InvalidInput) as err:
        Description.decode(data, devices=2)
    assert err.value.field == "mailbox" and says in str(err.value)
