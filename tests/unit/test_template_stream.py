"""engine/template_stream.StreamedActivations on the CPU (no load stream: copies made in place):
each step's outputs are read from the step's buffer, the next step's copy is issued when a step is
prepared, the two buffers alternate, and every byte copied is counted."""

from __future__ import annotations

import torch

from backends.core.engine import host_block
from backends.core.engine.template_stream import StreamedActivations
from backends.core.runtime.token_subsets import TemplateActivations


def host_recording(rows: int, blocks: int, tokens: int, width: int, steps: int = 3):
    """A host recording whose outputs are 10 * step + block, in one host block as the template
    cache keeps it, read through StreamedActivations; the list its copies' bytes are counted into."""
    outputs = {(step, block): torch.full((rows, tokens, width), float(10 * step + block))
               for step in range(steps) for block in range(blocks)}
    block, views = host_block.pack(outputs, pin=False)
    host = TemplateActivations(rows, views, complete=True, host=True, block=block)
    counted = []
    return host, StreamedActivations(host, torch.device("cpu"), None, counted.append), counted


def test_steps_are_copied_one_ahead_into_alternating_buffers():
    host, reader, counted = host_recording(rows=2, blocks=2, tokens=4, width=3)
    reader.prepare(0, last=2)
    assert counted == [2 * 2 * 4 * 3 * 4] * 2  # step 0, then step 1 ahead
    assert torch.equal(reader.get(0, 1, 1), host.get(0, 1, 1))
    buffer_of_step_0 = reader.get(0, 0, 0)
    reader.prepare(1, last=2)
    assert torch.equal(reader.get(1, 0, 0), host.get(1, 0, 0)) and len(counted) == 3
    reader.prepare(2, last=2)  # the last: nothing further issued
    assert len(counted) == 3 and torch.equal(reader.get(2, 1, 0), host.get(2, 1, 0))
    assert reader.get(2, 0, 0).data_ptr() == buffer_of_step_0.data_ptr()  # step 2 took step 0's buffer
    assert reader.complete and reader.rows == 2


def test_only_the_planned_blocks_are_copied_and_a_step_reads_what_was_copied_for_it():
    host, reader, counted = host_recording(rows=1, blocks=3, tokens=2, width=2)
    block_bytes = 2 * 2 * 4
    # step 0 copied now (`first`), step 1 ahead with another plan
    assert reader.prepare(0, last=2, first=frozenset({2}), ahead=frozenset({0, 1})) == frozenset({2})
    assert counted == [block_bytes, 2 * block_bytes]
    assert torch.equal(reader.get(0, 2, 0), host.get(0, 2, 0))
    # step 1 reads what was copied a step ago, whatever the plan says now; step 2 gets every block
    assert reader.prepare(1, last=2, first=frozenset({2}), ahead=frozenset({0, 1, 2})) == frozenset({0, 1})
    assert torch.equal(reader.get(1, 1, 0), host.get(1, 1, 0))
    assert reader.prepare(2, last=2) is None and counted[-1] == 3 * block_bytes
    assert all(torch.equal(reader.get(2, b, 0), host.get(2, b, 0)) for b in range(3))


def test_a_recording_in_one_host_block_streams_each_whole_step_in_one_copy():
    """The template cache's host tier packs a recording into one block (engine/host_block.py), a
    step's outputs one range of it: a step copying every block copies that range into views of one
    device range laid out alike; a planned subset copies its blocks into those views."""
    source, _, _ = host_recording(rows=2, blocks=3, tokens=5, width=3)
    outputs = dict(source.outputs)
    outputs[(0, 1)] = outputs[(0, 1)].half()  # a dtype of another size: offsets stay aligned
    block, views = host_block.pack(outputs, pin=False)
    assert all(torch.equal(views[k], t) for k, t in outputs.items())
    assert all((v.data_ptr() - block.data_ptr()) % host_block.ALIGN == 0 for v in views.values())
    host = TemplateActivations(2, views, complete=True, host=True, block=block)
    assert host.nbytes == block.numel() >= sum(t.numel() * t.element_size() for t in outputs.values())
    counted = []
    reader = StreamedActivations(host, torch.device("cpu"), None, counted.append)
    reader.prepare(0, last=2, first=frozenset({1}), ahead=None)  # step 0: one block; step 1: all, flat
    assert torch.equal(reader.get(0, 1, 1), host.get(0, 1, 1))
    start, end = host_block.span(block, [views[(1, b)] for b in range(3)])
    assert torch.equal(reader._buffers[1].flat, block[start:end])
    reader.prepare(1, last=2)
    assert all(torch.equal(reader.get(1, b, r), host.get(1, b, r)) for b in range(3) for r in range(2))
    reader.prepare(2, last=2)  # step 0's parity: its layout differs (a half block), so its buffers are made again
    assert all(torch.equal(reader.get(2, b, r), host.get(2, b, r)) for b in range(3) for r in range(2))
    assert counted[0] == 2 * 5 * 3 * 2 and len(counted) == 3
