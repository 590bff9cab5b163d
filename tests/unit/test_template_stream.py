"""engine/template_stream.StreamedActivations on the CPU (no load stream: copies made in place):
each step's outputs are read from the step's buffer, the next step's copy is issued when a step is
prepared, the two buffers alternate, and every byte copied is counted."""

from __future__ import annotations

import torch

from backends.core.engine.template_stream import StreamedActivations
from backends.core.runtime.token_subsets import TemplateActivations


def test_steps_are_copied_one_ahead_into_alternating_buffers():
    host = TemplateActivations(2, complete=True, host=True)
    for step in range(3):
        for block in range(2):
            host.outputs[(step, block)] = torch.full((2, 4, 3), float(10 * step + block))
    counted = []
    streamed = StreamedActivations(host, torch.device("cpu"), None, counted.append)
    streamed.prepare(0, last=2)
    assert counted == [2 * 2 * 4 * 3 * 4] * 2  # step 0, then step 1 ahead
    assert torch.equal(streamed.get(0, 1, 1), host.get(0, 1, 1))
    buffer_of_step_0 = streamed.get(0, 0, 0)
    streamed.prepare(1, last=2)
    assert torch.equal(streamed.get(1, 0, 0), host.get(1, 0, 0)) and len(counted) == 3
    streamed.prepare(2, last=2)  # the last: nothing further issued
    assert len(counted) == 3 and torch.equal(streamed.get(2, 1, 0), host.get(2, 1, 0))
    assert streamed.get(2, 0, 0).data_ptr() == buffer_of_step_0.data_ptr()  # step 2 took step 0's buffer
    assert streamed.complete and streamed.rows == 2
