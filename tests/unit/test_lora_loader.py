"""LoRAs loaded by loader processes and handed over through /dev/shm equal load_lora in-process,
bit for bit; a bad file or a dying loader fails its request alone, and nothing is left in /dev/shm."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from backends.core.adapters.lora import LoraLayer, LoraWeights, load_lora
from backends.core.adapters.lora_loader import LOADER_NICENESS, SEGMENT_PREFIX, SHM_DIR, LoraLoaderDied, LoraLoaderPool
from backends.core.request.params import InvalidInput

TIMEOUT = 120  # spawned workers import torch and diffusers first: slow on two busy cores


# Loaders injected into the worker processes: module-level, so spawn finds them by name.
def sleepy_loader(name, path):
    """One small layer named after the worker's pid, after a pause long enough to overlap."""
    time.sleep(1.5)
    layer = LoraLayer(torch.ones(2, 3), torch.full((4, 2), float(os.getpid())), 0.5)
    return LoraWeights(f"{name}@{os.getpid()}", {"m": layer}, 40)


def dying_loader(name, path):
    """"exit"/"kill": leave a half-written segment named as the pool names this worker's segments
    (the test passes the pool's prefix as the path), then die as a crash or the OOM killer would."""
    import signal

    if name in ("exit", "kill"):
        Path(f"{path}{os.getpid()}-partial").write_bytes(b"x" * 100)
        if name == "exit":
            os._exit(9)
        os.kill(os.getpid(), signal.SIGKILL)
    return sleepy_loader(name, path)


def view_loader(name, path):
    """Two layers on the very same memory, as a converter may return: safetensors refuses to
    save that as is."""
    shared = torch.arange(4.0).reshape(2, 2)
    return LoraWeights(name, {"m": LoraLayer(shared, shared[:], 0.25)}, 16)


def converting_loader(name, path):
    """load_lora under another name: the pool plans only for load_lora itself, so this one takes
    the converted path (the worker reads and converts the file and writes a segment)."""
    return load_lora(name, path)


def ours():
    """This process's segments in /dev/shm."""
    return {p for p in os.listdir(SHM_DIR) if p.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")}


@pytest.fixture(scope="module")
def loras(tiny_model):
    folder = tiny_model / "adapters" / "loras"
    return {p.stem: p for p in sorted(folder.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def pool():
    before = ours()
    p = LoraLoaderPool(workers=2)
    yield p
    p.shutdown()
    assert ours() == before


def test_loaded_tensors_equal_load_lora_in_process(pool, loras):
    request = [(name, path, 0.5 + i) for i, (name, path) in enumerate(loras.items())]
    stats = []
    result = pool.submit(request, on_loaded=stats.append).result(TIMEOUT)
    assert [(w.name, s) for w, s in result] == [(n, s) for n, _, s in request]
    for (weights, _), (name, path, _) in zip(result, request):
        expected = load_lora(name, path)
        assert weights.nbytes == expected.nbytes and list(weights.text_encoders) == list(expected.text_encoders)
        for component in ("unet", *expected.text_encoders):
            assert list(weights.layers(component)) == list(expected.layers(component))
            for module, layer in expected.layers(component).items():
                got = weights.layers(component)[module]
                assert got.scale == layer.scale
                for a, b in ((got.down, layer.down), (got.up, layer.up)):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert any(w.text_encoders for w, _ in result)  # the text-encoder layers come across too
    (count, seconds, nbytes), = stats
    assert count == len(loras) >= 2 and seconds > 0 and nbytes == sum(w.nbytes for w, _ in result)


def test_tensors_that_share_storage_cross_intact():
    pool = LoraLoaderPool(workers=1, load=view_loader)
    try:
        ((lora, scale),) = pool.submit([("views", "unused", 0.5)]).result(TIMEOUT)
    finally:
        pool.shutdown()
    expected = view_loader("views", "unused").unet["m"]
    assert scale == 0.5 and lora.unet["m"].scale == 0.25
    assert torch.equal(lora.unet["m"].down, expected.down) and torch.equal(lora.unet["m"].up, expected.up)


def test_a_corrupt_file_fails_clearly_and_the_pool_keeps_working(pool, loras, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(loras["papercut"].read_bytes()[:200])  # truncated
    future = pool.submit([("papercut", loras["papercut"], 1.0), ("bad", bad, 1.0)])
    with pytest.raises(InvalidInput, match=r"^loras: 'bad' cannot be read as a LoRA \(") as err:
        future.result(TIMEOUT)
    assert err.value.field == "loras"
    (weights, scale), = pool.submit([("inkwash", loras["inkwash"], 0.3)]).result(TIMEOUT)
    assert weights.name == "inkwash" and scale == 0.3


def test_a_missing_file_fails_clearly(pool, tmp_path):
    with pytest.raises(InvalidInput, match="loras: 'gone' cannot be read as a LoRA"):
        pool.submit([("gone", tmp_path / "gone.safetensors", 1.0)]).result(TIMEOUT)


def test_loras_of_one_request_load_in_parallel_on_both_workers():
    p = LoraLoaderPool(workers=2, load=sleepy_loader)
    try:
        p.submit([("warm", "-", 1.0), ("up", "-", 1.0)]).result(TIMEOUT)  # both workers imported and idle
        start = time.perf_counter()
        result = p.submit([("a", "-", 1.0), ("b", "-", 1.0)]).result(TIMEOUT)
        took = time.perf_counter() - start
        pids = {int(w.name.rsplit("@", 1)[1]) for w, _ in result}
        assert pids == set(p.pids()) and len(pids) == 2
        assert took < 2.8  # two 1.5 s loads one after the other would take 3 s
        assert torch.equal(result[0][0].unet["m"].up, torch.full((4, 2), float(result[0][0].name.split("@")[1])))
    finally:
        p.shutdown()


@pytest.mark.parametrize("how, code", [("exit", 9), ("kill", -9)])
def test_a_dying_loader_fails_its_request_alone_and_is_replaced(how, code):
    before = ours()
    p = LoraLoaderPool(workers=2, load=dying_loader)
    try:
        old = set(p.pids())
        shm = os.path.join(SHM_DIR, p.prefix)
        dying = p.submit([(how, shm, 1.0)])
        with pytest.raises(LoraLoaderDied, match=rf"^loras: the LoRA loader process died while loading '{how}' "
                                                 rf"\(exit code {code}\); try again$"):
            dying.result(TIMEOUT)
        assert ours() == before  # its half-written segment is gone
        (weights, _), = p.submit([("fine", "-", 1.0)]).result(TIMEOUT)
        assert weights.name.startswith("fine@")
        assert len(set(p.pids()) - old) == 1 and len(p.pids()) == 2  # a fresh worker in the dead one's slot
    finally:
        p.shutdown()
    assert ours() == before


def test_a_loader_killed_mid_request_fails_that_request_and_later_ones_work():
    """Both files of one request in flight on the two workers; one worker is killed."""
    before = ours()
    p = LoraLoaderPool(workers=2, load=dying_loader)
    try:
        p.submit([("warm", "-", 1.0), ("up", "-", 1.0)]).result(TIMEOUT)
        future = p.submit([("slow", "-", 1.0), ("kill", os.path.join(SHM_DIR, p.prefix), 1.0)])
        with pytest.raises(LoraLoaderDied, match="'kill'"):
            future.result(TIMEOUT)
        result = p.submit([("a", "-", 1.0), ("b", "-", 1.0)]).result(TIMEOUT)
        assert len(result) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in p.pids())
    finally:
        p.shutdown()
    assert ours() == before and not p.pids()


def test_shutdown_stops_the_workers_and_fails_queued_requests():
    before = ours()
    p = LoraLoaderPool(workers=1, load=sleepy_loader)
    pids = p.pids()
    busy = p.submit([("a", "-", 1.0)])
    queued = p.submit([("b", "-", 1.0)])
    time.sleep(0.2)
    p.shutdown()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)  # stopped and reaped
    assert busy.done() and queued.done()
    with pytest.raises(RuntimeError, match="loras: the LoRA loader is shutting down"):
        queued.result(0)
    with pytest.raises(RuntimeError, match="shut down"):
        p.submit([("c", "-", 1.0)])
    assert ours() == before



def test_a_loader_that_cannot_start_fails_requests_clearly_without_a_crash_loop(tmp_path, monkeypatch):
    """Workers whose imports fail (as they did in Triton's stub with the wrong interpreter) fail
    each request with a clear error and are not restarted in a loop while idle."""
    module = tmp_path / "vanishing_loader.py"
    module.write_text("def load(name, path):\n    raise AssertionError('never runs')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_loader

    module.unlink()  # the parent has it; the spawned workers cannot import it
    p = LoraLoaderPool(workers=1, load=vanishing_loader.load)
    try:
        for _ in range(2):
            with pytest.raises(LoraLoaderDied, match=r"^loras: the LoRA loader process could not start "
                                                     r"\(exit code 1\); the server log says why$"):
                p.submit([("a", "-", 1.0)]).result(TIMEOUT)
        dead = p.pids()
        time.sleep(2.5)  # two idle checks
        assert p.pids() == dead and not os.path.exists(f"/proc/{dead[0]}")
    finally:
        p.shutdown()


def test_wait_started_returns_once_the_workers_imported_what_loading_needs():
    pool = LoraLoaderPool(workers=2)
    try:
        assert pool.wait_started(TIMEOUT)
        start = time.perf_counter()
        assert pool.wait_started(TIMEOUT) and time.perf_counter() - start < 0.5  # already started
    finally:
        pool.shutdown()


def _niceness(stat: str) -> int:
    return int(Path(stat).read_text().rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_loaders_and_feeders_yield_the_cpu_to_the_step_loop(pool, loras):
    pool.submit([(name, path, 1.0) for name, path in loras.items()]).result(TIMEOUT)  # workers started
    here = os.getpriority(os.PRIO_PROCESS, 0)
    assert [_niceness(f"/proc/{pid}/stat") for pid in pool.pids()] == [here + LOADER_NICENESS] * 2
    feeders = [t.native_id for t in threading.enumerate() if t.name.startswith("easel-lora-feeder-")]
    assert len(feeders) >= 2
    assert all(_niceness(f"/proc/self/task/{tid}/stat") == here + LOADER_NICENESS for tid in feeders)
    assert _niceness(f"/proc/self/task/{threading.get_native_id()}/stat") == here  # the caller's thread is not


def test_a_plan_names_the_files_tensors_and_reads_them_exactly(loras, tmp_path):
    """Each demo LoRA (diffusers/PEFT and kohya layouts, with text-encoder layers) is planned from
    its header alone and read from its file into the very layers load_lora gives; a file changed
    after its plan fails clearly; one diffusers cannot read gets no plan (load_lora says why)."""
    from backends.core.adapters.lora import plan_lora, read_planned
    from backends.core.adapters.shm_tensors import read_tensors

    for name, path in loras.items():
        plan = plan_lora(name, path)
        assert plan is not None and plan.file_bytes == path.stat().st_size, name
        got, want = read_planned(plan, path, read_tensors), load_lora(name, path)
        assert got.nbytes == want.nbytes and list(got.text_encoders) == list(want.text_encoders)
        for component in ("unet", *want.text_encoders):
            assert list(got.layers(component)) == list(want.layers(component))
            for module, layer in want.layers(component).items():
                mine = got.layers(component)[module]
                assert mine.scale == layer.scale and torch.equal(mine.down, layer.down) and torch.equal(mine.up, layer.up)
    name, path = next(iter(loras.items()))
    plan = plan_lora(name, path)
    key = next(iter(plan.shapes))

    def rewritten(file):  # a tensor of another shape under the same key
        tensors = read_tensors(file)
        return {**tensors, key: tensors[key][:1]}

    with pytest.raises(InvalidInput, match="changed while it was loading"):
        read_planned(plan, path, rewritten)
    grown = tmp_path / "grown.safetensors"
    grown.write_bytes(path.read_bytes() + b"\0" * 8)  # another size than the planned file's
    with pytest.raises(InvalidInput, match="changed while it was loading"):
        read_planned(plan, grown, read_tensors)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:100])
    assert plan_lora("broken", broken) is None
    with pytest.raises(InvalidInput, match="cannot be read as a LoRA"):
        load_lora("broken", broken)


@pytest.mark.skipif(sys.platform != "linux", reason="reads the worker's /proc/<pid>/maps")
def test_a_worker_keeps_nothing_of_the_lora_it_handed_over(loras):
    """After the hand-over the worker holds neither the LoRA's tensors nor a mapping of its file:
    one that kept its last LoRA held its memory until the next load, and its file's pages could
    not be dropped from the page cache (so a benchmark's "cold" loads after the first were warm)."""
    pool = LoraLoaderPool(workers=1, load=converting_loader)
    try:
        path = loras["papercut"]
        ((lora, _),) = pool.submit([("papercut", path, 1.0)]).result(TIMEOUT)
        assert lora.unet
        (pid,) = pool.pids()
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert str(path.resolve()) not in maps and path.name not in maps
    finally:
        pool.shutdown()
