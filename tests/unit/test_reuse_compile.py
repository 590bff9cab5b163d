"""bench/micro/reuse_compile.py on the tiny UNet (CPU, aot_eager): the whole reusing step compiled,
the ResNet blocks and upsamplers on a box as opaque operators, gives the same step run eagerly on
the same static subsets (fp32, 1e-5 of the largest magnitude: the same kernels, traced)."""

from __future__ import annotations

from bench.micro.reuse_compile import compile_step


def test_the_compiled_reusing_step_with_boxes_gives_the_eager_static_step(tiny_model):
    row = compile_step(tiny_model, "cpu", 128, boxes=True, backend="aot_eager")
    assert row["box"] is not None and tuple(row["box"]) != (1.0, 1.0) and row["token_share"] < 1
    assert row["compile_s"] > 0 and row["max_rel_err"] <= 1e-5
