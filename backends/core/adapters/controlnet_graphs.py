"""Resident ControlNets as CUDA graphs: one graph per ControlNet and call shape (latent size, rows).

Eager, a ControlNet call launches its kernels one by one from Python, so on a fast GPU it is bound
by the host, and it is the half of a step that has to keep up with the UNet's graphed encoder half
it runs beside. Graphs remove the launches, as they do for the UNet (backends/core/runtime).

Each graph is captured with conditioning scale 1 (x * 1.0 is x, exactly) and the call's own scale
is applied after the replay: the same product diffusers' ControlNetModel computes, and it also
copies the residuals out of the graph's static outputs, which the next replay overwrites. A
ControlNet's graphs are dropped when the cache evicts it (their captured pointers name its
weights). All graphs share one memory pool: a service instance runs one call at a time.

`compiled`: the graphs replay torch.compile'd code. One compiled forward serves every ControlNet:
dynamo lifts a module's parameters to graph inputs (inline_inbuilt_nn_modules, on by default), so
ControlNets of one architecture share the code compiled for the first of them, and a newly loaded
one costs a capture, not a compile. A new call shape compiles once (minutes at SDXL size: the
first request of that shape waits for it; a restart loads it from the compile cache).
"""

from __future__ import annotations

import weakref

import torch

from backends.core.adapters.controlnet import ControlCall, Residuals, run_controlnet
from backends.core.runtime.cuda_graphs import GraphSet


WARMUP_RUNS = 2  # before a capture, as for the UNet: compile, then cuDNN/cuBLAS settle on the compiled code


class ControlNetGraphs:
    def __init__(self, compiled: bool = False, backend: str = "inductor"):
        self.compiled = compiled
        self.forward = torch.compile(_forward, backend=backend) if compiled else _forward
        self._graphs: dict[int, GraphSet] = {}  # id(model) -> its graphs, one per call shape
        self._pool = None
        self.captures = 0
        self.replays = 0

    @torch.inference_mode()
    def run(self, model, call: ControlCall) -> Residuals:
        if not call.sample.is_cuda:
            return run_controlnet(model, call)
        inputs = (call.sample, call.timestep, call.embeds, call.image, call.pooled, call.time_ids)
        graphs = self._graphs.get(id(model))
        if graphs is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graphs = self._graphs[id(model)] = GraphSet(self._pool, self.compiled,
                                                        WARMUP_RUNS if self.compiled else 1)
            weakref.finalize(model, self._graphs.pop, id(model), None)  # evicted: its graphs go too
        before = len(graphs)
        down, mid = graphs(tuple((tuple(t.shape), t.dtype) for t in inputs),
                           lambda *args: self.forward(model, *args), *inputs)
        self.captures += len(graphs) - before
        self.replays += 1
        return [d * call.scale for d in down], mid * call.scale

    def graphs_of(self, model) -> int:
        return len(self._graphs.get(id(model), ()))


def _forward(model, sample, timestep, embeds, image, pooled, time_ids):
    down, mid = model(sample, timestep, encoder_hidden_states=embeds, controlnet_cond=image, conditioning_scale=1.0,
                      added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)
    return list(down), mid
