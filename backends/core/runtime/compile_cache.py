"""Where torch.compile keeps what it builds, so that a restart loads it instead of compiling again."""

from __future__ import annotations

import os
from pathlib import Path


def use_compile_cache(folder: Path) -> None:
    """Point inductor (and the Triton kernels it writes) at `folder` for this process. They read
    the folder at compile time, so a restart finds every graph compiled before. Set, not defaulted:
    inductor writes its default into the environment the first time it looks."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    import torch._inductor.config as inductor
    from torch._dynamo import config as dynamo

    inductor.fx_graph_cache = True
    for knob in ("cache_size_limit", "recompile_limit"):  # one recompile per latent size at most
        if hasattr(dynamo, knob):
            setattr(dynamo, knob, 256)
