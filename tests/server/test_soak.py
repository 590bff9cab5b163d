"""A CI-sized soak (clients/bench/soak.py): a minute of mixed requests against a server of its own, then
no memory growth past warm-up beyond a stated margin, and no shared memory left behind.

The margins: RSS is a Python heap and glibc's arenas, which settle in steps, and Triton's
regions grow to the largest tensor seen and keep that size. So the test allows 64 MiB per
process and 160 MiB over all of them, measured after warm-up, and no growth of the regions past
16 MiB. A leak of one request's tensors at 128 px (text embeddings, latents, pixels: about
0.5 MiB) would exceed the total within a few hundred requests, which a longer run
(`python3 -m clients.bench.soak --duration 600`) shows. This minute catches a leak of whole buffers or
models.
"""

from __future__ import annotations

import io

import pytest
from PIL import Image

from clients.bench.soak import SoakConfig, run_soak
from clients import procs
from export.tiny_adapters import TINY_CONTROLNETS, TINY_LORAS
from tests.server.conftest import OPTIONS, start_server

PER_PROCESS_MIB = 64
TOTAL_MIB = 160
SHM_MIB = 16


@pytest.fixture(scope="module")
def soaked(tiny_model, tmp_path_factory):
    server = start_server(tiny_model, tmp_path_factory.mktemp("soak") / "repo")
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 40, 200)).save(buf, format="PNG")
    config = SoakConfig(duration_s=60, concurrency=4, sizes=(64, 128), steps=(2, 4),
                        controlnets=TINY_CONTROLNETS, loras=tuple(TINY_LORAS), max_size=OPTIONS.max_size,
                        deadline_steps=min(OPTIONS.max_steps, 50), deadline_s=0.5, interval_s=1.0)
    try:
        server.wait_ready()
        report = run_soak(server, config, buf.getvalue())
        ready_after = server.is_ready()
    finally:
        prefix = server.region_prefix
        server.stop()
    report.leftover_regions = sorted(p.name for p in procs.SHM_DIR.glob(f"{prefix}*"))
    return report, ready_after


def test_every_request_had_its_kinds_outcome(soaked):
    report, ready_after = soaked
    assert not report.unexpected, report.unexpected[:10]
    kinds = {key.split(":")[0] for key in report.outcomes}
    assert "ok" in kinds and "deadline" in kinds and any(k.startswith("bad_") for k in kinds), report.outcomes
    assert report.outcomes["ok:ok"] >= 10, report.outcomes
    assert ready_after


def test_memory_stays_flat_after_warm_up(soaked):
    report, _ = soaked
    growth = report.growth_mib
    assert len(report.samples) >= 20, len(report.samples)
    per_process = {k: v for k, v in growth.items() if k not in ("shm", "gpu", "rss_total")}
    assert per_process and max(per_process.values()) <= PER_PROCESS_MIB, growth
    assert growth["rss_total"] <= TOTAL_MIB, growth
    assert growth["shm"] <= SHM_MIB, growth


def test_no_shared_memory_left_after_stop(soaked):
    report, _ = soaked
    assert report.leftover_regions == []
