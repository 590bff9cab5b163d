"""Decides whether easel serve's gRPC front process is cheap enough to stand in front of every request.

What `easel serve`'s gRPC front (clients/grpc_front.py) costs a request: the same requests to
tritonserver's own gRPC port and through the front, alternated, on the tiny model at 1024 px
(the image is the largest message; one step, so that the hop is not lost in the denoising), with
and without a 1024 px control image in the request.

    python3 -m bench.micro.grpc_front_cost --work /tmp/easel-front --out /tmp/grpc_front_cost.json
"""

from __future__ import annotations

import io
import logging
import statistics
import time

import numpy as np

from clients.bench.common import bench_parser, start_logging, write_json

log = logging.getLogger("bench.micro.grpc_front_cost")


def control_png(size: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def main(argv=None) -> int:
    p = bench_parser(__doc__, size=1024, steps=1)
    p.add_argument("--runs", type=int, default=15, help="requests per route and kind, alternated")
    args = p.parse_args(argv)
    start_logging()
    from clients.client import EaselClient
    from clients.grpc_front import GrpcFront
    from clients.serve import TritonServer
    from export.repository import ExportOptions, export_repository
    from export.tiny import write_tiny_pipeline
    from export.tiny_adapters import write_tiny_adapter_store

    model = args.work / "tiny"
    if not (model / "model_index.json").exists():
        write_tiny_pipeline(model, seed=0)
        write_tiny_adapter_store(model)
    repo = export_repository(model, args.work / "repo", ExportOptions(max_size=args.size,
                                                                      adapters=str(model / "adapters")))
    kinds = {"text": {}, "controlnet": {"controlnets": ("canny",), "control_images": (control_png(args.size),)}}
    times: dict[str, dict[str, list[float]]] = {k: {"direct": [], "front": []} for k in kinds}
    sizes = {}
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=600) as server:
        front = GrpcFront(server.url_grpc, 0, host="127.0.0.1").start()
        try:
            clients = {"direct": EaselClient(server.url_grpc, protocol="grpc"),
                       "front": EaselClient(f"localhost:{front.port}", protocol="grpc")}
            for kind, extra in kinds.items():
                request = dict(width=args.size, height=args.size, steps=args.steps, seed=1, **extra)
                for c in clients.values():  # warm-up: the size's first request
                    c.generate("a lighthouse", **request)
                for i in range(args.runs):
                    order = ("direct", "front") if i % 2 == 0 else ("front", "direct")
                    for route in order:
                        start = time.perf_counter()
                        result = clients[route].generate("a lighthouse", **request)
                        times[kind][route].append(time.perf_counter() - start)
                sizes[kind] = {"image_bytes": len(result.png),
                               "request_bytes": sum(len(i) for i in extra.get("control_images", ()))}
        finally:
            front.stop(grace_s=0)
    report = {"size": args.size, "steps": args.steps, "runs": args.runs, "sizes": sizes, "seconds": times}
    for kind, routes in times.items():
        paired = [f - d for d, f in zip(routes["direct"], routes["front"])]
        report[f"{kind}_front_cost_ms"] = {"median": 1000 * statistics.median(paired),
                                           "min": 1000 * min(paired), "max": 1000 * max(paired)}
        log.info("%s at %d px: direct p50 %.1f ms, front p50 %.1f ms, front - direct (paired) median %.2f ms "
                 "(%.2f to %.2f); image %d bytes, request images %d bytes", kind, args.size,
                 1000 * statistics.median(routes["direct"]), 1000 * statistics.median(routes["front"]),
                 *(report[f"{kind}_front_cost_ms"][k] for k in ("median", "min", "max")),
                 sizes[kind]["image_bytes"], sizes[kind]["request_bytes"])
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
