"""The ResNet blocks' and upsamplers' box kernels (plugins/resnet_box_kernel.py, what easel::resnet_box
and easel::upsample_box run on CUDA) through Triton's interpreter on the CPU, against the torch
form (conv_subsets.resnet_box_body, upsample_box_body) on random blocks, fp32: within 1e-5 of the
largest magnitude (the same math; the statistics' sums run in another order), in either memory
layout and with an NCHW input beside channels_last weights, with boxes at the grid's edges and both
kinds of shortcut."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed here (its interpreter runs the kernels on CPU)")
def test_the_box_kernels_in_the_interpreter_give_the_torch_forms_outputs():
    code = ("import json, torch; from tests.unit.box_cases import errors; "
            "print(json.dumps(errors('cpu', torch.float32)))")
    env = {**os.environ, "TRITON_INTERPRET": "1",  # (read when triton is first imported: a fresh interpreter)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 12
    for r in results:
        assert r["changed"] and r["same_layout"], r
        assert r["rel_err"] <= 1e-5, r
