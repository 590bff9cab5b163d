"""Decides that easel_stream's refusals cannot crash the server (the gRPC front, the stub's locks).

Stream stress: `easel_stream` under requests it refuses at a high rate beside normal and
cancelled streams, on the tiny CPU models, until it fails or the time is up.

Each client thread runs one kind of request in a loop, as fast as the server answers:
- `refused`: `preview_every` out of range, refused by the pipeline's `execute`;
- `refused-late`: a width that is not a multiple of 8, refused by preprocess (through BLS);
- `stream`: a normal 4-step stream with previews;
- `cancel`: a 30-step stream cancelled after its first progress response;
- `unary`, `unary-refused`: the same through the unary `easel` (a 4-step request, and one whose
  width preprocess refuses);
- `refused-header`: `refused-late` on a stream of its own opened with the header
  `triton_grpc_error: true`, which makes Triton 2.51 end a stream at its first error and, under
  this load, crash (`--front` puts `easel serve`'s gRPC front, which drops the header, between the
  clients and the server).
A run fails when a request gets anything but its kind's outcome (the server's "stub process is
not healthy", a dropped connection), when tritonserver exits, or when no thread finished a
request for `--stall` seconds. On the 2-core CPU machine (bench/results/2026-11-24-cpu/notes.md)
a refusing kind beside `stream` or `cancel` killed the Python stub of `easel_stream` ("not
healthy") after 15-230 s in 11 of 12 runs; refusing kinds alone, streams beside cancels, and the
unary kinds ran 240-300 s clean. The cause, found from core dumps: Triton 2.51's Python backend
builds a BLS response's numpy arrays without the GIL (fixed upstream by python_backend PR #394).
Since the denoiser's step responses carry no tensor (backends/core/serving/preview_board.py), refusals beside
streams ran 240 s clean in 3 of 3 runs; mixes with `cancel` still died in 3 of 4
(bench/results/2026-11-24b-cpu/notes.md). The second trigger: a response sender's
`is_cancelled()`, asked by the pipeline's watcher thread while execute ran. With no such call
overlapping an execute (backends/triton/adapter.EXECUTE_LOCK), all four kinds ran 240 s clean in
7 of 7 runs, against 3 of 9 before (bench/results/2026-11-24c-cpu/notes.md).

    python3 -m bench.micro.stream_stress --work /tmp/easel-stress --out stress.json --mix refused,cancel --seconds 240
    python3 -m bench.micro.stream_stress --work /tmp/easel-stress --out header.json --front \
        --mix refused-header,refused-header,stream --seconds 150
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

log = logging.getLogger("bench.micro.stream_stress")

KINDS = ("refused", "refused-late", "stream", "cancel", "unary", "unary-refused", "refused-header")
HEADER = {"triton_grpc_error": "true"}
SMALL = dict(seed=3, steps=4, width=64, height=64)


def refused_with_header(url: str) -> str:
    """A request preprocess refuses, alone on a stream opened with HEADER."""
    import queue

    import tritonclient.grpc as grpcclient

    from clients.client import GenerateRequest, build_inputs

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=HEADER)
        client.async_stream_infer("easel_stream", build_inputs(GenerateRequest("a cat", **{**SMALL, "width": 60}),
                                                               "grpc"))
        _, error = answers.get(timeout=60)
        return "ok" if error is not None and "width: 60 is not a multiple of 8" in str(error) else f"answered: {error}"
    except Exception as exc:  # (a dead server: no answer in time, a dropped connection)
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def one(client, kind: str, preview_every: int = 2, url: str | None = None) -> str:
    """Runs one request of `kind`; returns its outcome, "ok" where it was the expected one."""
    from clients.client import EaselError, GenerateRequest

    try:
        if kind == "refused-header":
            return refused_with_header(url)
        if kind == "refused":
            list(client.stream(GenerateRequest("a cat", **SMALL), preview_every=-1))
        elif kind == "refused-late":
            list(client.stream(GenerateRequest("a cat", **{**SMALL, "width": 60})))
        elif kind == "unary":
            client.generate("a cat", **SMALL)
            return "ok"
        elif kind == "unary-refused":
            client.generate("a cat", **{**SMALL, "width": 60})
        elif kind == "stream":
            events = list(client.stream(GenerateRequest("a cat", **SMALL), preview_every=preview_every))
            return "ok" if len(events) == SMALL["steps"] + 1 else f"{len(events)} events"
        else:
            request = GenerateRequest("a cat", seed=1, steps=30, width=128, height=128)
            with closing(client.stream(request, timeout_s=600)) as events:
                next(events)  # closing the stream after the first step cancels it
            return "ok"
    except EaselError as e:
        refused = "refused" in kind and e.status == "StatusCode.INVALID_ARGUMENT"
        return "ok" if refused else f"{e.status}: {e}"
    return "answered"  # (only the refusing kinds get here)


def stress(server, mix: list[str], seconds: float, stall_s: float, preview_every: int = 2,
           url: str | None = None) -> dict:
    """`url`: where clients connect (default: the server's gRPC port)."""
    from clients.client import EaselClient

    url = url or server.url_grpc
    done = [0] * len(mix)  # requests finished, per thread: each thread writes only its own
    failures: list[dict] = []
    stop = threading.Event()
    start = time.monotonic()

    def client_loop(index: int, kind: str) -> None:
        with EaselClient(url, protocol="grpc", timeout_s=60) as client:
            while not stop.is_set():
                outcome = one(client, kind, preview_every, url)
                if outcome != "ok":
                    failures.append({"kind": kind, "after_s": round(time.monotonic() - start, 1), "outcome": outcome})
                    stop.set()
                    return
                done[index] += 1

    threads = [threading.Thread(target=client_loop, args=(i, kind), daemon=True) for i, kind in enumerate(mix)]
    for t in threads:
        t.start()
    last, last_change = 0, time.monotonic()
    while not stop.wait(1.0):
        now, total = time.monotonic(), sum(done)
        if total != last:
            last, last_change = total, now
        if server.proc.poll() is not None:
            failures.append({"kind": "server", "after_s": round(now - start, 1),
                             "outcome": f"tritonserver exited with {server.proc.returncode}"})
            break
        if now - last_change > stall_s:
            failures.append({"kind": "all", "after_s": round(now - start, 1),
                             "outcome": f"no request finished for {stall_s:.0f} s"})
            break
        if now - start > seconds:
            break
    stop.set()
    for t in threads:
        t.join(timeout=10)
    requests: Counter = Counter()
    for kind, n in zip(mix, done):
        requests[kind] += n
    return {"mix": mix, "preview_every": preview_every, "seconds": round(time.monotonic() - start, 1),
            "requests": dict(requests),
            "failures": failures, "server_alive": server.proc.poll() is None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mix", default="refused,cancel", help=f"client threads, one kind each, of {', '.join(KINDS)}")
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--stall", type=float, default=30.0, help="seconds with no request finished that count as a hang")
    p.add_argument("--preview-every", type=int, default=2, help="`stream`'s previews (0: step responses, no previews)")
    p.add_argument("--front", action="store_true", help="clients go through easel serve's gRPC front")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    mix = [k.strip() for k in args.mix.split(",") if k.strip()]
    unknown = sorted(set(mix) - set(KINDS))
    if unknown or not mix:
        p.error(f"--mix: unknown kinds {unknown}; choose from {', '.join(KINDS)}")

    from clients.bench.common import tiny
    from clients.grpc_front import GrpcFront
    from clients.serve import TritonServer
    from export.repository import ExportOptions, export_repository

    args.work.mkdir(parents=True, exist_ok=True)
    repo = args.work / "repo"
    export_repository(tiny(args.work), repo, ExportOptions(device="cpu", max_size=256, max_steps=200))
    server = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=300).start()
    front = None
    try:
        server.wait_ready()
        if args.front:
            front = GrpcFront(server.url_grpc, 0, host="127.0.0.1").start()
        report = stress(server, mix, args.seconds, args.stall, args.preview_every,
                        url=f"localhost:{front.port}" if front else None)
        report["front"] = args.front
        report["dead_stubs"] = server.dead_stubs()
        report["server_log_tail"] = server.log_text().splitlines()[-40:]
    finally:
        if front is not None:
            front.stop(grace_s=0)
        server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log.info("%s: %s in %.0f s; failures: %s", ",".join(mix), report["requests"], report["seconds"],
             report["failures"] or "none")


if __name__ == "__main__":
    main()
