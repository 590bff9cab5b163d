"""Triton adapter of the public models `easel` (unary) and `easel_stream` (decoupled: a response
per denoising step, then the image): both run the pipeline by BLS (backends/bls_pipeline.py),
which answers each request from a thread of its own, so `execute` returns at once."""

import os
import site
import sys

# The stub's interpreter ignores PYTHONPATH: add its folders (with their .pth files) ahead of
# the interpreter's own site-packages, as PYTHONPATH would, so the deployment's numpy wins.
_own = list(sys.path)
for _p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    if _p:
        site.addsitedir(_p)
sys.path[:] = [p for p in sys.path if p not in _own] + _own

from backends.bls_pipeline import BlsPipeline  # noqa: E402
from backends.triton_adapter import holds_execute_lock, setup_stub  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        setup_stub()
        self.pipeline = BlsPipeline(args)

    @holds_execute_lock
    def execute(self, requests):
        for request in requests:
            self.pipeline.start(request)
        return None

    def finalize(self):
        self.pipeline.close()
