"""Where FP8's error comes from (backends/core/runtime/fp8.py): each product's own error and the
whole noise with every product emulated; used by bench/micro/fp8_fidelity.py and its tests."""

from __future__ import annotations

import logging

from clients.bench.common import rel_rms

log = logging.getLogger("easel.bench")


def diagnose(layers, unet, run, exact) -> dict:
    """Where FP8's error comes from, on one evaluation: each product's own error (against the
    exact product of the very input it got, so the error it adds, not the one it inherits), and
    the whole noise again with every product emulated (e4m3 values multiplied in fp32), which
    tells the quantization from the e4m3 kernel (torch._scaled_mm)."""
    names = {id(m): n for n, m in unet.named_modules()}
    own = []

    def note(m, args, y):
        x = args[0]
        want = m.exact(x.float())
        own.append((names.get(id(m), f"layers[{layers.index(m)}]"), rel_rms(y, want),
                    float(x.abs().max()) / float(m.x_amax)))

    hooks = [layer.register_forward_hook(note) for layer in layers]
    error = rel_rms(run(), exact)
    for hook in hooks:
        hook.remove()
    worst = sorted(own, key=lambda e: -e[1])[:8]

    def emulated(m, x8, out_dtype):
        y = (x8.float() * m.x_scale) @ (m.w8.float() * m.w_scale).t()
        if m.bias is not None:
            y = y + m.bias.float()
        return y.to(out_dtype)

    for layer in layers:
        layer.product = lambda x8, out_dtype, m=layer: emulated(m, x8, out_dtype)
    emulated_error = rel_rms(run(), exact)
    for layer in layers:
        del layer.product
    errors = sorted(e for _, e, _ in own)
    result = {"noise_rms_rel_error": error, "noise_rms_rel_error_emulated": emulated_error,
              "own_error_median": errors[len(errors) // 2], "own_error_max": errors[-1],
              "worst_layers": [{"layer": n, "own_error": e, "input_over_range": r} for n, e, r in worst]}
    log.info("diagnosis: noise %.4f (emulated products %.4f); each product's own error median %.4f, max %.4f; "
             "worst %s", error, emulated_error, result["own_error_median"], errors[-1],
             [(n, round(e, 4)) for n, e, _ in worst[:3]])
    return result
