"""Which UNet runtime a denoiser uses and how it is tuned: chosen at export, typed, strict.

kinds:
- `eager`: diffusers' modules as they are (the exact reference; the default on CPU);
- `graphs`: CUDA graphs of the two halves per bucket (latent shape x row count), static buffers;
- `compiled`: the same graphs over torch.compile'd halves (default mode, never max-autotune at
  serve time), with inductor's artifacts cached on disk so a restart does not compile again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from backends.core.typed_config import strict_from_dict

RUNTIME_KINDS = ("eager", "graphs", "compiled")
# What of the transformer blocks runs as FP8 products (runtime/fp8.py); "all" names the three.
FP8_PARTS = ("attention", "feed_forward", "projections")


def check_fp8_parts(parts, field: str) -> tuple[str, ...]:
    """`parts` as a tuple, each one of FP8_PARTS; otherwise a ValueError that names `field`."""
    parts = tuple(parts)
    unknown = sorted(set(parts) - set(FP8_PARTS))
    if unknown:
        raise ValueError(f"{field}: {unknown} not among {list(FP8_PARTS)}")
    return parts


@dataclass(frozen=True)
class RuntimeConfig:
    kind: str = "eager"
    # Row counts a graph is captured for; a batch runs in the smallest bucket that holds it (the
    # spare rows compute on stale inputs and are dropped). More rows than the largest: eager.
    row_buckets: tuple[int, ...] = (2, 4, 8, 16)
    # Latent (h, w) sizes whose buckets are captured (and compiled) at load, before ready.
    warmup_sizes: tuple[tuple[int, int], ...] = ()
    # Also capture the decoder half with ControlNet residuals at load.
    warmup_residuals: bool = False
    # A shape without a bucket: capture it when first seen (graphs), or run it eager. Capturing a
    # compiled half means compiling it (minutes), so `compiled` runs misses eager by default.
    capture_on_miss: bool | None = None
    # The UNet's convolutions in channels_last; None: where it measurably pays. Measured on an
    # H200 (bench/micro/step_profile.py, 1024 px, 2 rows): compiled 33.8 -> 32.5 ms a step (inductor
    # writes its own norms for either layout, cuDNN's convolutions skip their NCHW<->NHWC copies);
    # graphs 44.7 ms against 36.6 with the fused kernels (eager GroupNorm is slow in channels_last).
    channels_last: bool | None = None
    fused_kernels: bool = False  # plugins/: fused GroupNorm+SiLU and GEGLU
    # Graphs and compiled: self-attention's Q, K, V as one product, and cross-attention's text K/V
    # computed once per batch composition instead of every step (runtime/packed_attention.py).
    packed_attention: bool = True
    # inductor's on-disk cache, relative to the model's version folder (or absolute).
    compile_cache: str = "compile_cache"
    # The transformer blocks' products in FP8 with scales calibrated at load (runtime/fp8.py), for
    # these parts of FP8_PARTS; empty: none (exact). Approximate: opt-in, measured by PSNR.
    fp8: tuple[str, ...] = ()
    # FP8 products with cuBLAS's fast accumulation (Hopper: partial sums not promoted to fp32).
    # Measured on H200s (bench/micro/fp8_probe.py, 1024 px, 2 rows): a step 27.58 -> 27.15 ms and
    # 27.80 -> 27.43 ms; the noise's error from fp16 unchanged at 3.1-3.2% (e4m3's rounding of the
    # operands dominates).
    fp8_fast_accum: bool = False
    # Template edits' reusing steps as CUDA graphs, one pair per row bucket and token share
    # (runtime/token_subsets.GRAPH_SHARES), captured when first needed (seconds): of the compiled
    # halves under `compiled` where warmup_template_edits compiled them (or misses capture), else
    # of the eager modules; off: such steps run eager.
    subset_graphs: bool = True
    # Also capture reusing steps' graphs at warmup_sizes, every row bucket and token share (a
    # fraction of a second each); under `compiled`, compile the reusing halves there first (one
    # compile per size, dynamic in rows and share: minutes for SDXL).
    warmup_template_edits: bool = False
    # At most this many reusing steps' buckets keep their graphs; past it the least recently used
    # lets go of its own (captured again when next needed). Rows x shares x box sides make many
    # buckets; each keeps a graph pair and its decoder's output (its encoder writes into outputs
    # that the buckets of its row count share).
    subset_graph_limit: int = 64
    # Template edits' reusing rows also run the ResNet blocks on their mask's box, the rest from the
    # recording (runtime/conv_subsets.py), eager and as graphs (box sides as buckets), and the
    # upsamplers too: approximate beyond the transformer blocks' reuse, opt-in until measured at
    # SDXL size. ResNet blocks that fused_kernels fused run whole (and then the upsamplers too).
    conv_subsets: bool = False

    def __post_init__(self):
        if self.kind not in RUNTIME_KINDS:
            raise ValueError(f"runtime.kind: {self.kind!r} is not one of {list(RUNTIME_KINDS)}")
        object.__setattr__(self, "row_buckets", tuple(sorted(int(r) for r in self.row_buckets)))
        object.__setattr__(self, "warmup_sizes", tuple(tuple(int(d) for d in s) for s in self.warmup_sizes))
        object.__setattr__(self, "fp8", check_fp8_parts(self.fp8, "runtime.fp8"))
        if self.fp8 and self.kind == "eager":
            raise ValueError("runtime.fp8: needs a fast runtime (graphs or compiled), not eager")
        if self.fp8_fast_accum and not self.fp8:
            raise ValueError("runtime.fp8_fast_accum: needs runtime.fp8 (parts in FP8)")
        if not isinstance(self.subset_graph_limit, int) or self.subset_graph_limit < 1:
            raise ValueError(f"runtime.subset_graph_limit: {self.subset_graph_limit!r} is not a positive whole number")
        if not self.row_buckets or self.row_buckets[0] < 1:
            raise ValueError(f"runtime.row_buckets: {self.row_buckets} needs positive row counts")
        for size in self.warmup_sizes:
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"runtime.warmup_sizes: {size} is not a latent (h, w)")

    @property
    def uses_channels_last(self) -> bool:
        return self.kind == "compiled" if self.channels_last is None else self.channels_last

    @property
    def miss_captures(self) -> bool:
        return self.kind == "graphs" if self.capture_on_miss is None else self.capture_on_miss

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RuntimeConfig":
        return strict_from_dict(cls, data, "runtime")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_kind(device: str) -> str:
    """The fast runtime on a GPU, eager on CPU."""
    return "compiled" if device.startswith("cuda") else "eager"

