"""config.pbtxt text for each model of the repository, from the declarations in backends.core.request.contract."""

from __future__ import annotations

from dataclasses import dataclass

from backends.core.request.contract import ModelDecl, TensorDecl


@dataclass(frozen=True)
class Instances:
    kind: str = "KIND_CPU"  # or KIND_GPU
    count: int = 1
    gpus: tuple[int, ...] = ()

    def pbtxt(self) -> str:
        gpus = f" gpus: [ {', '.join(map(str, self.gpus))} ]" if self.gpus else ""
        return f"instance_group [ {{ kind: {self.kind} count: {self.count}{gpus} }} ]"


def _tensor(t: TensorDecl) -> str:
    dtype = "STRING" if t.dtype == "BYTES" else t.dtype  # the protocol's BYTES is TYPE_STRING in configs
    optional = " optional: true" if t.optional else ""
    return f'  {{ name: "{t.name}" data_type: TYPE_{dtype} dims: [ {", ".join(map(str, t.dims))} ]{optional} }}'


def _tensors(kind: str, tensors) -> str:
    return f"{kind} [\n" + ",\n".join(_tensor(t) for t in tensors) + "\n]"


def _parameters(params: dict[str, str]) -> str:
    return "".join(
        f'parameters {{ key: "{k}" value {{ string_value: {_quote(v)} }} }}\n' for k, v in sorted(params.items()))


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def python_model(name: str, backend: str, decl: ModelDecl, instances: Instances,
                 params: dict[str, str] | None = None, decoupled: bool = False, spare_version: bool = False) -> str:
    """A model served by one of our Python-based backends (backends/<backend>/model.py).
    `spare_version`: a public model, which `easel serve` drains by a version switch (it serves
    SERVING_VERSION; the caller writes the DRAINING_VERSION folder)."""
    parts = [
        f'name: "{name}"',
        f'backend: "{backend}"',
        "max_batch_size: 0",
        _tensors("input", decl.inputs),
        _tensors("output", decl.outputs),
        instances.pbtxt(),
    ]
    if decoupled:
        parts.append("model_transaction_policy { decoupled: true }")
    if spare_version:
        parts.append(f"version_policy: {{ specific: {{ versions: [ {SERVING_VERSION} ] }} }}")
    return "\n".join(parts) + "\n" + _parameters(params or {})


# The public models' version folders: each serves SERVING_VERSION; DRAINING_VERSION (the same
# model) is what `easel serve`'s drain switches to, so that Triton keeps the serving version
# UNLOADING until its admitted requests finish while new requests still find a model, whose
# preprocess refuses them with UNAVAILABLE (clients/serve.py, TritonServer.drain).
SERVING_VERSION = 1
DRAINING_VERSION = 2


def read_parameters(config_path) -> dict[str, str]:
    """The string parameters of a config.pbtxt, parsed as Triton's own ModelConfig."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(open(config_path).read(), model_config_pb2.ModelConfig())
    return {key: value.string_value for key, value in config.parameters.items()}
