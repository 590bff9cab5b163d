"""Which way a step applies its requests' LoRAs: merged into the weights in place when the whole
batch shares one LoRA set (a refit: the weights of the set stay merged across steps and batches
until another set comes), else with the weights at base and each request's low-rank terms added
on its rows by the runtime (a batch that mixes LoRAs)."""

from __future__ import annotations

from backends.core.adapters.lora import LoraMerger, LoraSet, lora_key
from backends.core.runtime.base import LoraSegment, UNetRuntime


class LoraPolicy:
    def __init__(self, runtime: UNetRuntime):
        self.runtime = runtime
        self.merger = LoraMerger(runtime.weight_copies)
        self.merged: tuple = ()  # lora_key of the set merged now; () for the base weights

    def check(self, loras: LoraSet) -> None:
        """InvalidInput naming the layer of a LoRA that does not fit the UNet."""
        for lora, _ in loras:
            self.merger.layers.check(lora)

    def segments(self, states) -> tuple[LoraSegment, ...]:
        """Merge the batch's LoRA set when all its requests share one (restoring the base weights
        for none), else leave the weights at base and return each request's rows and LoRAs for
        the runtime to add unmerged."""
        keys = {lora_key(s.job.loras) for s in states}
        if len(keys) == 1:
            (key,) = keys
            if key != self.merged:
                self.merger.merge(list(states[0].job.loras))  # an empty set restores the base
                self.runtime.weights_written()
                self.merged = key
            return ()
        if self.merged:
            self.merger.restore()
            self.runtime.weights_written()
            self.merged = ()
        segments, row = [], 0
        for s in states:
            if s.job.loras:
                segments.append(LoraSegment(slice(row, row + s.rows), s.job.loras))
            row += s.rows
        return tuple(segments)
