"""Triton adapter of the public models `easel` (unary) and `easel_stream` (decoupled: a response
per denoising step, then the image): both run the pipeline by BLS (backends/triton/bls_pipeline.py),
which answers each request from a thread of its own, so `execute` returns at once."""

import easel_bootstrap  # noqa: F401  (first: backends/triton/bootstrap.py, copied beside this file)

from backends.triton.bls_pipeline import BlsPipeline
from backends.triton.adapter import holds_execute_lock, setup_stub


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
