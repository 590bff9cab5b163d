"""The fast torch runtime: CUDA graphs of the two UNet halves per bucket, optionally compiled.

A bucket is (latent h, w, row count, text tokens). Each holds static input buffers, one captured
encoder graph and up to two captured decoder graphs (without and with ControlNet residuals; the
ControlNet join sits between the halves, so the halves are separate graphs). The decoder graph
reads the encoder graph's static outputs directly, so nothing is copied between the halves.
A batch of n rows runs in the smallest bucket of >= n rows: the spare rows compute on whatever
their buffers hold (finite values of earlier steps) and are dropped.

Launch cost is what graphs remove: the eager UNet launches ~2,000 kernels from Python per step,
which on the H200 host made the step loop CPU-bound (eager 60-84 ms against 44 ms as one graph).

What runs eager instead (through the eager runtime over the very same modules and weights):
- batches that mix LoRA sets (unmerged low-rank terms are forward hooks, which graphs do not see);
- more rows than the largest bucket;
- a shape without a bucket when misses are not captured (`compiled`: capturing means compiling);
- template edits' steps that record, or mix roles (runtime/token_subsets.py). Steps whose rows all
  reuse a recording run as graphs, one pair per row bucket, token share (`GRAPH_SHARES`) and, with
  `conv_subsets`, box sides of the ResNet blocks (conv_subsets.BOX_SIDES); their buckets' static
  token indices and recorded outputs are filled before each replay (`StaticSubsets.fill`). Under
  `graphs`, and under `compiled` where a load plan leaves some blocks whole (a plan per batch would
  mean a compile per plan), they are graphs of the eager modules, captured at first use (no
  compile). Under `compiled` with every block from the recording they are graphs of the compiled
  halves where that compile is warm (`warmup_template_edits`, or misses capture): their row and
  token counts and box sides are dynamic, so one compile per latent size serves every bucket;
  elsewhere, graphs of the eager modules. On an H200 the eager modules' reusing step (1024 px, 2
  rows, 20% mask, ResNets whole) took 32.4 ms against the compiled exact step's 31.4: eager
  GroupNorm, layout copies and unfused element-wise work on the whole ResNets outweighed the
  transformer work saved.
LoRA merges write into the weights' own memory, so captured graphs see them (tested on the GPU).
All graphs of a runtime share one memory pool, captured on one side stream (freed memory is
reused only on the stream that freed it: cuda_graphs._side_stream): they never run concurrently,
and the static buffers stay referenced, so the pool never hands them out twice. Reusing buckets
are many (row buckets x shares x boxes): those of one size and row count share their encoder's
outputs, and at most `subset_graph_limit` keep their graphs (past it the least recently used lets
go of its own, and the pool gives that memory to the next capture).

With `packed_attention` (the default) the halves take the text's cross-attention keys and values
(runtime/packed_attention.py) in place of the text: one buffer per row count, recomputed only
when the batch's `text_key` changes (a request joins or leaves, a LoRA merge) or on `refit`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import torch

from backends.core.runtime.base import EncoderOut, Residuals, RuntimeCaps, StepBatch, check_batch, refit_in_place
from backends.core.runtime.compile_cache import use_compile_cache
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.conv_subsets import BOX_SIDES, graph_box
from backends.core.runtime.cuda_graphs import capture
from backends.core.runtime.packed_attention import pack_attention
from backends.core.runtime.token_subsets import GRAPH_SHARES, RecordedBuffers, StaticSubsets, graph_share
from backends.core.runtime.torch_eager import EagerUNetRuntime

log = logging.getLogger(__name__)
WARMUP_RUNS = 2  # before a capture: cuDNN/cuBLAS pick their algorithms, compile finishes, allocations settle


class _Bucket:
    """Static buffers and captured graphs of one (h, w, rows, tokens)."""

    def __init__(self, template: StepBatch, rows: int, channels_last: bool, text: torch.Tensor):
        """`text`: what the halves take for the text, which the runtime fills (FastUNetRuntime._text_rows)."""
        def like(t, memory_format=torch.contiguous_format):
            return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device).contiguous(
                memory_format=memory_format)

        self.rows = rows
        self.sample = like(template.sample, torch.channels_last if channels_last else torch.contiguous_format)
        self.timestep = like(template.timestep)
        self.text = text
        self.pooled = like(template.pooled)
        self.time_ids = like(template.time_ids)
        self.encoder: torch.cuda.CUDAGraph | None = None
        self.enc_out: tuple | None = None  # (emb, mid, skips), written by each replay
        self.decoders: dict[bool, tuple] = {}  # with residuals? -> (graph, noise, residual buffers)
        self.subsets: StaticSubsets | None = None  # a reusing step's bucket: the token subsets its graphs read
        self.eager_halves = False  # its graphs are of the eager modules (see FastUNetRuntime._halves)

    def load(self, batch: StepBatch) -> None:
        n = batch.rows
        for buf, src in ((self.sample, batch.sample), (self.timestep, batch.timestep), (self.pooled, batch.pooled),
                         (self.time_ids, batch.time_ids)):
            buf[:n].copy_(src, non_blocking=True)


class FastUNetRuntime:
    def __init__(self, eager: EagerUNetRuntime, config: RuntimeConfig, cache_root: Path | None = None,
                 fp8_calibration: Path | None = None):
        """`fp8_calibration`: the data runtime/fp8.py calibrates on, when config.fp8 names parts."""
        if config.kind not in ("graphs", "compiled"):
            raise ValueError(f"runtime.kind: {config.kind!r} is not a fast runtime")
        device = next(eager.weights_module.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"runtime.kind={config.kind!r} needs a CUDA device (this denoiser is on {device})")
        self.eager = eager
        eager.conv_subsets = config.conv_subsets  # (before the blocks' classes are installed, below)
        self.config = config
        self.device = device
        self.weights_module = eager.weights_module
        self.weight_copies = eager.weight_copies
        self.streams = ()
        self.side_devices = eager.side_devices
        # Token subsets (template edits): graphs for reusing steps, else the eager fallback.
        self.caps = RuntimeCaps(name=config.kind, graphs=True, compiled=config.kind == "compiled", token_subsets=True)
        self.stats = eager.stats  # one account: the eager runtime counts the steps it runs for us
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets: dict[tuple, _Bucket] = {}
        self._recorded: dict[tuple, RecordedBuffers] = {}  # (h, w, rows) -> what reusing buckets share
        self._enc_out: dict[tuple, tuple] = {}  # (h, w, rows) -> the reusing encoders' outputs
        self._warm_edits: set[tuple] = set()  # _size()s whose reusing buckets' compile was warmed up
        self._reusing: OrderedDict[tuple, None] = OrderedDict()  # reusing buckets' keys, least recently used first
        if config.fused_kernels:
            from plugins import use_fused_kernels

            log.info("fused kernels: %s", use_fused_kernels(self.weights_module))
        if config.uses_channels_last:
            self.weights_module.to(memory_format=torch.channels_last)
        # After any .to(): the packed weights are views that a move would copy apart.
        self.text_projections = pack_attention(self.weights_module) if config.packed_attention else None
        self.fp8_layers: list = []
        if config.fp8:
            self._use_fp8(fp8_calibration)
        # (rows, text tokens) -> the packed projections buckets of that many rows read, shared by
        # every latent size, and (the batch's text_key, weights version) they hold.
        self._text: dict[tuple[int, int], torch.Tensor] = {}
        self._text_key: dict[tuple[int, int], tuple] = {}
        self._weights_version = 0
        self.enc_fn, self.dec_fn = eager.encoder, eager.decoder
        # The blocks' token-subset classes now, before any compile: swapped in later (at the first
        # template edit) they fail the compiled halves' guards, and the next capture recompiles them.
        eager.subset_context()
        # Reusing graphs run the ResNet blocks (and upsamplers) on boxes: there are some to run so
        self.boxes = bool(config.conv_subsets and self.subsets.box_keys)
        if config.kind == "compiled":
            self._compile(cache_root)

    def _use_fp8(self, calibration: Path | None) -> None:
        from backends.core.adapters.lora import ModelLayers
        from backends.core.runtime.fp8 import calibrate_from_file, use_fp8

        self.fp8_layers = use_fp8(self.weights_module, self.config.fp8)
        for layer in self.fp8_layers:  # before anything compiles or captures them
            layer.fast_accum = self.config.fp8_fast_accum
        # The eager runtime's index of layers must hold the FP8 modules now in the tree: a batch
        # that mixes LoRAs hooks its low-rank terms onto them.
        self.eager.layers = ModelLayers(self.weights_module)
        calibrate_from_file(self.fp8_layers, self.weights_module, self.eager.encoder, self.eager.decoder, calibration)

    def _compile(self, cache_root: Path | None) -> None:
        cache = Path(self.config.compile_cache)
        if not cache.is_absolute() and cache_root is not None:
            cache = cache_root / cache
        use_compile_cache(cache)
        # dynamic=None: the row count is marked dynamic at capture (cuda_graphs.capture); latent sizes specialize.
        self.enc_fn = torch.compile(self.eager.encoder)
        self.dec_fn = torch.compile(self.eager.decoder)
        log.info("compiling the UNet halves (inductor cache %s)", cache)

    @property
    def subsets(self):
        """The transformer blocks' token-subset context (its eager fallback's), once it has one."""
        return self.eager.subsets

    # --- the contract ---

    @torch.inference_mode()
    def encode(self, batch: StepBatch) -> EncoderOut:
        check_batch(self.caps, batch)
        bucket = self._bucket(batch)
        if bucket is None:
            return self.eager.encode(batch)
        self._load(batch, bucket)
        bucket.encoder.replay()
        self.stats.graph_steps += 1
        n = batch.rows
        emb, mid, skips = bucket.enc_out
        return EncoderOut(emb[:n], mid[:n], tuple(s[:n] for s in skips), meta={"bucket": bucket})

    @torch.inference_mode()
    def decode(self, batch: StepBatch, enc: EncoderOut, residuals: Residuals | None) -> torch.Tensor:
        bucket = enc.meta.get("bucket")
        with_res = residuals is not None
        if bucket is None or (with_res not in bucket.decoders and not self._capture_decoder(bucket, with_res)):
            return self.eager.decode(batch, enc, residuals)
        graph, noise, buffers = bucket.decoders[with_res]
        n = batch.rows
        if with_res:
            down, mid = residuals
            for buf, src in zip(buffers[0], down):
                buf[:n].copy_(src, non_blocking=True)
            buffers[1][:n].copy_(mid, non_blocking=True)
        graph.replay()
        return noise[:n].clone()  # the buffer is overwritten by the next replay

    def row_sides(self, rows_per_request) -> None:
        return None  # one place

    def refit(self, weights: Mapping[str, torch.Tensor]) -> None:
        refit_in_place(self.weights_module, weights)
        self._weights_version += 1  # the text projections were made with the old weights
        self.weights_written()

    def weights_written(self) -> None:
        for layer in self.fp8_layers:  # the e4m3 copies of the fp16 weights just written
            layer.requantize()

    def text_input(self, batch: StepBatch) -> torch.Tensor:
        """What the halves take for the batch's text: its packed projections, or the text itself."""
        return batch.text if self.text_projections is None else self.text_projections.project(batch.text)

    def _load(self, batch: StepBatch, bucket: _Bucket) -> None:
        """The batch into the bucket's static inputs; its text as the halves take it."""
        bucket.load(batch)
        if self.text_projections is None:
            bucket.text[:batch.rows].copy_(batch.text, non_blocking=True)
            return
        where = (bucket.rows, batch.text.shape[1])
        key = (batch.text_key, self._weights_version)
        if batch.text_key is None or self._text_key.get(where) != key:
            self.text_projections.project(batch.text, out=bucket.text[:batch.rows])
            self._text_key[where] = key

    # --- buckets ---

    def bucket_rows(self, rows: int) -> int | None:
        return next((r for r in self.config.row_buckets if r >= rows), None)

    @torch.inference_mode()
    def warmup(self, template: StepBatch, sizes, with_residuals: bool = False) -> float:
        """Capture (and compile) the encoder and decoder graphs of every row bucket at `sizes`
        (latent h, w), from a template batch of one row, and with `warmup_template_edits` a
        reusing step's. Returns the seconds it took."""
        start = time.perf_counter()
        edits = self.config.warmup_template_edits and self.config.subset_graphs
        for h, w in sizes:
            for rows in self.config.row_buckets:
                bucket = self._capture(_resized(template, rows, h, w), rows)
                self._capture_decoder(bucket, False, force=True)
                if with_residuals:
                    self._capture_decoder(bucket, True, force=True)
            if edits:  # every row bucket and share (compiled: the first compiles, dynamic in both, the rest capture)
                for rows in self.config.row_buckets:
                    batch = _resized(template, rows, h, w)
                    self._warm_edits.add(self._size(self._key(batch, rows)))
                    for share in GRAPH_SHARES:
                        box = _square(share) if self.boxes else None
                        self._capture_subsets(batch, rows, share, None, box)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.stats.warmup_s += seconds
        return seconds

    def _key(self, batch: StepBatch, rows: int) -> tuple:
        return (*batch.latent_shape, rows, batch.text.shape[1], batch.sample.dtype)

    @staticmethod
    def _size(key: tuple) -> tuple:
        """A bucket key less its row count: what a compile of the halves specializes on."""
        h, w, _, *rest = key
        return (h, w, *rest)

    def _bucket(self, batch: StepBatch) -> _Bucket | None:
        if batch.lora_segments:
            return None
        if batch.tokens is not None:
            return self._subset_bucket(batch)
        rows = self.bucket_rows(batch.rows)
        if rows is None:
            return None
        bucket = self.buckets.get(self._key(batch, rows))
        if bucket is None:
            if not self.config.miss_captures:
                shape = batch.latent_shape
                self.stats.misses[shape] = self.stats.misses.get(shape, 0) + 1
                return None
            bucket = self._capture(batch, rows)
        return bucket

    def _capture(self, batch: StepBatch, rows: int, key: tuple | None = None,
                 subsets: StaticSubsets | None = None, eager_halves: bool = False) -> _Bucket:
        """A bucket of `rows` rows and its encoder graph, kept under `key` (default: _key's);
        `subsets`: a reusing step's, whose graphs are of the eager halves with `eager_halves`."""
        start = time.perf_counter()
        bucket = _Bucket(batch, rows, self.config.uses_channels_last, self._text_rows(batch, rows))
        bucket.subsets, bucket.eager_halves = subsets, eager_halves
        self._load(batch, bucket)
        args = (bucket.sample, bucket.timestep, bucket.text, bucket.pooled, bucket.time_ids)
        bucket.encoder, bucket.enc_out = self._capture_half(bucket, 0, args)
        self.buckets[key or self._key(batch, rows)] = bucket
        self._captured(start, "encoder" if subsets is None else
                       f"encoder (token share {subsets.share:g}, ResNet box {subsets.box})", rows)
        return bucket

    def _halves(self, bucket: _Bucket) -> tuple:
        """(encoder, decoder, compiled) that a bucket's graphs capture: the runtime's own, or the
        eager halves (either way a reusing step's blocks serve its static token subsets)."""
        if bucket.eager_halves:
            return self.eager.encoder, self.eager.decoder, False
        return self.enc_fn, self.dec_fn, self.caps.compiled

    def _capture_half(self, bucket: _Bucket, half: int, args: tuple) -> tuple:
        """(graph, static outputs) of `bucket`'s encoder (`half` 0) or decoder (1) on `args`, under
        its token layout. A compiled reusing half first runs eager: the static subsets' buffers are
        made there, so that the compile reads them rather than makes them. A reusing encoder writes
        into the outputs its size and row count's reusing buckets share (`_shared_encoder`)."""
        *halves, compiled = self._halves(bucket)
        fn = halves[half]
        if half == 0 and bucket.subsets is not None:
            fn = self._shared_encoder(fn, (*bucket.sample.shape[2:], bucket.rows))
        with self._layout(bucket):
            if compiled and bucket.subsets is not None:
                (self.eager.encoder, self.eager.decoder)[half](*args)
            return capture(fn, args, self.pool, compiled, WARMUP_RUNS)

    def _shared_encoder(self, encoder, where: tuple):
        """`encoder`, its outputs copied into the buffers of `where` (h, w, rows; as `_recorded`):
        reusing buckets are many and never run at once, and their encoder outputs (53 MB a row at
        1024 px for SDXL) are the most of what each would keep. The buffers are made at the first
        run, a capture's warm-up (outside the graph); the copy costs a pass over them per step."""
        def run(*args):
            out = encoder(*args)
            shared = self._enc_out.get(where)
            if shared is None:
                emb, mid, skips = out
                shared = self._enc_out[where] = (torch.empty_like(emb), torch.empty_like(mid),
                                                 tuple(torch.empty_like(s) for s in skips))
            for buffer, value in zip((shared[0], shared[1], *shared[2]), (out[0], out[1], *out[2])):
                buffer.copy_(value)
            return shared
        return run

    def _layout(self, bucket: _Bucket):
        """While capturing a reusing step's bucket: its static token subsets seen by the blocks."""
        return nullcontext() if bucket.subsets is None else self.eager.token_layout(bucket.subsets)

    def _subset_bucket(self, batch: StepBatch) -> _Bucket | None:
        """A reusing step's bucket (captured at its first use: eager modules, no compile), filled
        with the step's indices and recorded outputs; None: the step runs eager."""
        share = graph_share(batch.tokens) if self.config.subset_graphs else None
        rows = self.bucket_rows(batch.rows)
        if share is None or rows is None:
            return None
        box = graph_box(batch.tokens, *batch.latent_shape, self.subsets.box_keys) if self.boxes else None
        key = (*self._key(batch, rows), share, box, batch.tokens.cached)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self._capture_subsets(batch, rows, share, batch.tokens.cached, box)
        self._reusing.move_to_end(key)
        bucket.subsets.fill(batch.tokens)
        return bucket

    def _capture_subsets(self, batch: StepBatch, rows: int, share: float, cached: frozenset[int] | None,
                         box: tuple[float, float] | None) -> _Bucket:
        """A reusing step's bucket of `rows` rows at token share `share` under the load plan
        `cached`, its ResNet blocks on boxes of `box`'s sides (None: whole). Its graphs are of the
        compiled halves where the runtime compiles, every block reads the recording, and that
        compile is warm at its size (or misses may capture: a compile is minutes); else of the eager
        modules (a plan per batch would compile per plan). The warm compile serves boxes where the
        runtime runs the ResNet blocks on them, and no box elsewhere: a step without one under
        conv_subsets (a recording made without the ResNet blocks') would compile again."""
        size = self._key(batch, rows)
        warm = self._size(size) in self._warm_edits and (box is not None) == self.boxes
        eager_halves = not (self.caps.compiled and cached is None and (self.config.miss_captures or warm))
        buffers = self._recorded.setdefault((*batch.latent_shape, rows), RecordedBuffers())
        subsets = StaticSubsets(rows, share, cached, self.eager.subset_context(), buffers, box)
        key = (*size, share, box, cached)
        bucket = self._capture(batch, rows, key, subsets, eager_halves)
        # The decoder's too, now: its blocks' buffers are made before its capture, and the step's
        # fill must reach them.
        self._capture_decoder(bucket, False)
        self._reusing[key] = None
        self._make_room()
        return bucket

    def _make_room(self) -> None:
        """Let the least recently used reusing buckets go, never the newest, until subset_graph_limit
        holds them: their graphs and outputs return to the shared pool, where the next capture takes
        them. A bucket still read by a step in flight (EncoderOut.meta) stays alive until that step
        ends."""
        while len(self._reusing) > self.config.subset_graph_limit:
            key, _ = self._reusing.popitem(last=False)
            self.buckets.pop(key)
            self.stats.released += 1
            log.info("released a reusing bucket's graphs (%s rows, token share %g) for room", key[2], key[-3])

    def _text_rows(self, batch: StepBatch, rows: int) -> torch.Tensor:
        """A bucket's text buffer: without packing its own; with packing the packed-projection
        buffer of buckets of `rows` rows, which latent sizes share: graphs never run concurrently,
        and it is 77 x 166,400 fp16 a row for SDXL (25.6 MB), so a buffer per bucket would
        multiply that by the warmed sizes."""
        if self.text_projections is None:
            return torch.zeros((rows, *batch.text.shape[1:]), dtype=batch.text.dtype, device=batch.text.device)
        where = (rows, batch.text.shape[1])
        if where not in self._text:
            self._text[where] = torch.zeros((*where, self.text_projections.width), dtype=batch.text.dtype,
                                            device=batch.text.device)
        return self._text[where]

    def _capture_decoder(self, bucket: _Bucket, with_res: bool, force: bool = False) -> bool:
        if with_res in bucket.decoders:
            return True
        if not (force or self.config.miss_captures or bucket.subsets is not None):
            return False
        start = time.perf_counter()
        emb, mid, skips = bucket.enc_out
        buffers = ([torch.zeros_like(s) for s in skips], torch.zeros_like(mid)) if with_res else None
        args = (emb, mid, skips, bucket.text, *(buffers or (None, None)))
        graph, noise = self._capture_half(bucket, 1, args)
        bucket.decoders[with_res] = (graph, noise, buffers)
        self._captured(start, "decoder (with residuals)" if with_res else "decoder", bucket.rows)
        return True

    def _captured(self, start: float, what: str, rows: int) -> None:
        seconds = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_s += seconds
        log.info("captured the %s graph for %s rows in %.2f s (device memory reserved: %.2f GiB)", what, rows,
                 seconds, torch.cuda.memory_reserved(self.device) / 2**30)


def _square(share: float) -> tuple[float, float]:
    """The box sides that a square mask of token share `share` needs (what warmup captures: other
    boxes are captured at first use)."""
    side = next(f for f in BOX_SIDES if f * f >= share)
    return side, side


def _resized(template: StepBatch, rows: int, h: int, w: int) -> StepBatch:
    def rep(t):
        return t[:1].expand(rows, *t.shape[1:]).contiguous()

    sample = torch.randn((rows, template.sample.shape[1], h, w), device=template.sample.device,
                         dtype=template.sample.dtype)
    return template.map_rows(rep, sample=sample)
