"""Decides how ControlNet residuals cross between models (BLS tensors or a CUDA IPC mailbox) and the size of Triton's CUDA pool.

What a BLS call costs when it moves ControlNet-sized GPU tensors between two Python models.

A `residual_source` model returns `parts` fp16 CUDA tensors of `mib` MiB in all (a ControlNet's
residuals at 1024 px and CFG are ~100 MiB in 11 tensors); a `driver` model calls it by BLS
with a GPU input of `in_mib` and times each call (exec + taking the outputs as torch tensors on
the GPU) against the source's own time. Variants: number of output tensors, the BLS request's
preferred output memory, Triton's CUDA memory pool size (one server per pool size).

    python3 bench/micro/bls_transport.py --out $OUT/bls_transport.json     (on a GPU machine)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("bench.micro.bls_transport")

PREAMBLE = '''
import os, site, sys
_own = list(sys.path)
for _p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    if _p:
        site.addsitedir(_p)
sys.path[:] = [p for p in sys.path if p not in _own] + _own
import asyncio, json, threading, time
import numpy as np
import torch
import triton_python_backend_utils as pb_utils
'''

SOURCE = PREAMBLE + '''
class TritonPythonModel:
    def initialize(self, args):
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device("cuda", int(args["model_instance_device_id"])) if gpu else torch.device("cpu")
        self.sync = (lambda: torch.cuda.synchronize(self.device)) if gpu else (lambda: None)

    def execute(self, requests):
        responses = []
        for request in requests:
            start = time.perf_counter()
            x = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "x").to_dlpack())
            x_on_gpu = x.is_cuda
            parts = int(pb_utils.get_input_tensor_by_name(request, "parts").as_numpy()[0])
            numel = int(pb_utils.get_input_tensor_by_name(request, "numel").as_numpy()[0])
            hold = float(pb_utils.get_input_tensor_by_name(request, "hold_s").as_numpy()[0])
            if hold:
                time.sleep(hold)  # stands for a ControlNet's compute
            outs = [torch.empty(numel // parts, device=self.device, dtype=torch.float16).fill_(float(x[0]))
                    for _ in range(parts)]
            self.sync()
            seconds = time.perf_counter() - start
            tensors = [pb_utils.Tensor.from_dlpack(f"out_{i}", torch.utils.dlpack.to_dlpack(o))
                       for i, o in enumerate(outs)]
            tensors.append(pb_utils.Tensor("seconds", np.array([seconds], dtype=np.float64)))
            tensors.append(pb_utils.Tensor("x_on_gpu", np.array([x_on_gpu], dtype=np.bool_)))
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
'''

DRIVER = PREAMBLE + '''

async def _await(bls):
    return await bls.async_exec()


class _Spinner:
    """A Python thread counting while a call runs: near zero if the call holds the GIL."""

    def __enter__(self):
        self.count, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._spin)
        self.thread.start()
        self.start = time.perf_counter()
        return self

    def _spin(self):
        while not self.stop.is_set():
            self.count += 1

    def __exit__(self, *exc):
        self.rate = self.count / (time.perf_counter() - self.start)
        self.stop.set()
        self.thread.join()


def _host(tensor):
    return torch.from_dlpack(tensor.to_dlpack()).cpu().numpy()

class TritonPythonModel:
    def initialize(self, args):
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device("cuda", int(args["model_instance_device_id"])) if gpu else torch.device("cpu")
        self.sync = (lambda: torch.cuda.synchronize(self.device)) if gpu else (lambda: None)
        self.side = torch.cuda.Stream(self.device) if gpu else None
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def execute(self, requests):
        responses = []
        for request in requests:
            cfg = json.loads(pb_utils.get_input_tensor_by_name(request, "config").as_numpy()[0])
            x = torch.ones(cfg["in_mib"] * 2**19, device=self.device, dtype=torch.float16)
            numel = cfg["mib"] * 2**19 // cfg["parts"] * cfg["parts"]
            kwargs = {}
            if cfg["preferred"] == "gpu" and self.device.type == "cuda":
                kwargs["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU,
                                                                      self.device.index)
            rows = []
            for _ in range(cfg["calls"]):
                self.sync()
                start = time.perf_counter()
                if cfg.get("busy_stream"):  # ~30 ms of GPU work queued before the call, on one stream
                    stream = self.side if cfg["busy_stream"] == "side" else torch.cuda.default_stream(self.device)
                    with torch.cuda.stream(stream):
                        a = torch.ones(8192, 8192, device=self.device, dtype=torch.float16)
                        for _ in range(cfg["busy_matmuls"]):
                            a = a @ a
                inputs = [pb_utils.Tensor.from_dlpack("x", torch.utils.dlpack.to_dlpack(x)),
                          pb_utils.Tensor("parts", np.array([cfg["parts"]], dtype=np.int32)),
                          pb_utils.Tensor("numel", np.array([numel], dtype=np.int64)),
                          pb_utils.Tensor("hold_s", np.array([cfg["hold_s"]], dtype=np.float64))]
                names = [f"out_{i}" for i in range(cfg["parts"])] + ["seconds", "x_on_gpu"]
                bls = pb_utils.InferenceRequest(model_name="residual_source", inputs=inputs,
                                                requested_output_names=names, **kwargs)
                sys.setswitchinterval(cfg.get("switch_s", 0.005))
                with _Spinner() as spin:
                    if cfg["mode"] == "async":
                        response = asyncio.run_coroutine_threadsafe(_await(bls), self.loop).result()
                    else:
                        response = bls.exec()
                sys.setswitchinterval(0.005)
                if response.has_error():
                    raise RuntimeError(response.error().message())
                sent = time.perf_counter()
                outs = {t.name(): t for t in response.output_tensors()}
                on_cpu = sum(outs[f"out_{i}"].is_cpu() for i in range(cfg["parts"]))
                torch_outs = [torch.from_dlpack(outs[f"out_{i}"].to_dlpack()).to(self.device)
                              for i in range(cfg["parts"])]
                self.sync()
                done = time.perf_counter()
                rows.append({"call_s": done - start, "exec_s": sent - start,
                             "source_s": float(_host(outs["seconds"])[0]), "outputs_on_cpu": int(on_cpu),
                             "input_on_gpu": bool(_host(outs["x_on_gpu"])[0]), "spins_per_s": spin.rate})
                del torch_outs, outs, response
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("timings", np.array([json.dumps(rows).encode()], dtype=np.object_))]))
        return responses
'''


def _config(name: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]], kind: str, gpu: int) -> str:
    def block(kind, items):
        body = ",\n".join(f'  {{ name: "{n}" data_type: TYPE_{t} dims: [ -1 ] }}' for n, t in items)
        return f"{kind} [\n{body}\n]\n"
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n' + block("input", inputs)
            + block("output", outputs) + f'instance_group [ {{ kind: KIND_{kind} count: 1{f" gpus: [ {gpu} ]" if kind == "GPU" else ""} }} ]\n'
            + 'parameters: { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: { string_value: "no" } }\n')


def write_repository(repo: Path, max_parts: int, kind: str, source_gpu: int) -> None:
    models = {
        "residual_source": (SOURCE, [("x", "FP16"), ("parts", "INT32"), ("numel", "INT64"), ("hold_s", "FP64")],
                            [(f"out_{i}", "FP16") for i in range(max_parts)]
                            + [("seconds", "FP64"), ("x_on_gpu", "BOOL")]),
        "driver": (DRIVER, [("config", "STRING")], [("timings", "STRING")]),
    }
    for name, (code, inputs, outputs) in models.items():
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "1" / "model.py").write_text(code)
        (repo / name / "config.pbtxt").write_text(_config(name, inputs, outputs, kind, source_gpu if name == "residual_source" else 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mib", type=int, default=100)
    p.add_argument("--in-mib", type=int, default=14)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--pools-mib", type=int, nargs="+", default=[64, 4096])
    p.add_argument("--cpu", action="store_true", help="smoke test without a GPU")
    p.add_argument("--source-gpu", type=int, default=0, help="the source's GPU (the driver is on GPU 0)")
    p.add_argument("--busy-matmuls", type=int, default=40, help="8192^2 fp16 matmuls queued before a call")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import tritonclient.grpc as grpc

    from clients.serve import TritonServer

    report = {"source_gpu": args.source_gpu, "mib": args.mib, "in_mib": args.in_mib, "calls": args.calls, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_repository(repo, 11, "CPU" if args.cpu else "GPU", args.source_gpu)
        for pool in args.pools_mib:
            with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=300,
                              extra_args=() if args.cpu else tuple(
                                  f"--cuda-memory-pool-byte-size={g}:{pool * 2**20}" for g in {0, args.source_gpu})) as server:
                client = grpc.InferenceServerClient(server.url_grpc)
                variants = [dict(parts=parts, preferred=preferred, mode="exec", hold_s=0.0)
                            for parts in (11, 1) for preferred in ("default", "gpu")]
                # Does a thread waiting in a BLS call let the others run? (source holds 30 ms)
                variants += [dict(parts=1, preferred="default", mode=mode, hold_s=0.03) for mode in ("exec", "async")]
                # A Python thread busy beside the call (the spinner, as the denoiser's loop launching kernels)
                # delays it by GIL hand-offs: does a shorter switch interval help?
                variants += [dict(parts=11, preferred="gpu", mode="exec", hold_s=0.0, switch_s=switch)
                             for switch in (0.001, 0.0002)]
                # Does the call wait for GPU work the caller queued on its default stream or a side stream?
                if not args.cpu:
                    variants += [dict(parts=11, preferred="default", mode="exec", hold_s=0.0, busy_stream=stream,
                                      busy_matmuls=args.busy_matmuls) for stream in ("default", "side")]
                for variant in variants:
                    cfg = dict(mib=args.mib, in_mib=args.in_mib, calls=args.calls, **variant)
                    tensor = grpc.InferInput("config", [1], "BYTES")
                    tensor.set_data_from_numpy(np.array([json.dumps(cfg).encode()], dtype=np.object_))
                    rows = json.loads(client.infer("driver", [tensor]).as_numpy("timings")[0])[2:]  # 2 warm-ups
                    med = {k: statistics.median(r[k] for r in rows)
                           for k in ("call_s", "exec_s", "source_s", "spins_per_s")}
                    run = {"pool_mib": pool, **variant, "median": med, "outputs_on_cpu": rows[-1]["outputs_on_cpu"],
                           "input_on_gpu": rows[-1]["input_on_gpu"]}
                    report["runs"].append(run)
                    log.info("pool %5d MiB %s  call %.2f ms  exec %.2f ms  source %.2f ms  spins %.0f/s  "
                             "outputs on cpu %d  input on gpu %s", pool, variant, med["call_s"] * 1e3,
                             med["exec_s"] * 1e3, med["source_s"] * 1e3, med["spins_per_s"], run["outputs_on_cpu"],
                             run["input_on_gpu"])
                client.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
