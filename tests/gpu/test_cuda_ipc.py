"""A mailbox between two processes (backends/core/adapters/cuda_ipc.py), as between the denoiser
and a ControlNet service instance on another GPU: the caller writes latents on its stream and
records its event without any host wait; the other process opens the mailbox and the event,
waits on the GPU, writes a result back and records its own event, which the caller's stream
waits on. The result is exact (a copy and a doubling), and a slot that does not fit the mailbox
is refused. Needs a GPU (two for the cross-GPU case); skipped elsewhere."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from backends.core.adapters.cuda_ipc import Description, Mailboxes, OpenedMailboxes, Slot, layout
from backends.core.request.params import InvalidInput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SERVICE = textwrap.dedent('''
    import sys, torch
    from backends.core.adapters.cuda_ipc import Description, OpenedMailboxes, layout
    own = torch.device(sys.argv[1])
    torch.cuda.set_device(0)  # as a Triton stub's thread, whatever its instance's GPU
    d = Description.decode(sys.stdin.buffer.readline().strip(), torch.cuda.device_count())
    caller = torch.device("cuda", d.device)
    opened = OpenedMailboxes()
    memory = opened.memory(caller, d.memory)
    offsets, _ = layout(list(d.slots))
    sample, out = (memory.tensor(o, s.shape, s.dtype) for o, s in zip(offsets, d.slots))
    theirs = torch.cuda.current_stream(caller)
    theirs.wait_event(opened.event(caller, d.inputs_ready))
    torch.cuda.current_stream(own).wait_event(theirs.record_event())  # (not the IPC event: see model.py)
    out.copy_(sample.to(own) * 2)
    written = torch.cuda.Event(interprocess=True)
    written.record(torch.cuda.current_stream(caller))
    print(bytes(written.ipc_handle()).hex(), flush=True)
    sys.stdin.readline()  # (the event lives until the caller has waited on it)
''')


@pytest.mark.parametrize("service_gpu", [0, 1])
def test_a_call_through_a_mailbox(service_gpu):
    if service_gpu >= torch.cuda.device_count():
        pytest.skip("needs two GPUs")
    caller = torch.device("cuda:0")
    slots = [Slot("sample", (2, 4, 64, 64), torch.float16), Slot("out", (2, 4, 64, 64), torch.float16)]
    offsets, nbytes = layout(slots)
    memory, handle, inputs_ready = Mailboxes().get(caller, nbytes)
    sample, out = (memory.tensor(o, s.shape, s.dtype) for o, s in zip(offsets, slots))
    stream = torch.cuda.Stream(caller)
    want = torch.randn(2, 4, 64, 64, device=caller, dtype=torch.float16)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the latents are written well after the other side waits
        sample.copy_(want)
        inputs_ready.record(stream)
    description = Description(0, handle, bytes(inputs_ready.ipc_handle()), tuple(slots))
    # (-X faulthandler: a crash in the driver prints where it happened)
    service = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", SERVICE, f"cuda:{service_gpu}"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        service.stdin.write(description.encode() + b"\n")
        service.stdin.flush()
        line = service.stdout.readline()
        assert line.strip(), f"the service process ended (exit {service.wait(timeout=60)}) before answering"
        written = bytes.fromhex(line.decode().strip())
        stream.wait_event(OpenedMailboxes().event(caller, written))
        with torch.cuda.stream(stream):
            got = out.clone()
        stream.synchronize()
    finally:
        service.communicate(b"\n", timeout=60)
    assert service.returncode == 0
    assert torch.equal(got, want * 2)


def test_a_slot_outside_the_mailbox_is_refused():
    memory, _, _ = Mailboxes().get(torch.device("cuda:0"), 4096)
    with pytest.raises(InvalidInput, match="does not fit"):
        memory.tensor(2048, (2048,), torch.float16)
    with pytest.raises(InvalidInput, match="does not fit"):
        memory.tensor(100, (4,), torch.float16)  # (unaligned)


def test_a_thread_that_never_ran_a_kernel_gets_a_mailbox():
    """As the denoiser's loop thread on its first ControlNet call: torch has made no context
    current on it, so the driver calls must make the device's own current themselves."""
    import threading

    got = {}

    def first_call():
        try:
            got["box"] = Mailboxes().get(torch.device("cuda:0"), 4096)
        except Exception as exc:  # (reported below, in the test's thread)
            got["error"] = exc

    thread = threading.Thread(target=first_call)
    thread.start()
    thread.join()
    assert "error" not in got, got.get("error")
    assert got["box"][0].nbytes == 4096
