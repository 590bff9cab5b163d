"""Decides whether FP8 products are accurate enough for SDXL's UNet.

How far FP8 (backends/core/runtime/fp8.py) moves SDXL's UNet, on any device: diffusers' own
UNet of SDXL-base size with random weights, its transformer blocks' products swapped for the FP8
ones and calibrated as the runtime does (on the text export writes), against the same UNet exact.
No runtime, graphs or compile: this measures the quantization alone (bench/micro/fp8_probe.py measures
the runtime on a GPU, speed included). On a CPU it runs in fp32 at 256 px in about 20 minutes.

Reports the noise prediction's relative RMS error at three timesteps on text from the model's own
encoders (a prompt that is not a calibration prompt), on random N(0, 1) text (nothing an encoder
makes: how FP8 fares far from its calibration) with the runtime's headroom and without, and the
denoised latents' error after a short Euler trajectory with guidance 5.

    python3 -m bench.micro.fp8_fidelity --work /tmp/easel-fp8 --out /tmp/fp8_fidelity.json
"""

from __future__ import annotations

import logging
import time

import torch

import backends.core.runtime.fp8 as fp8
from clients.bench.common import bench_parser, random_sdxl, rel_rms, start_logging, write_json
from clients.bench.fp8_diagnosis import diagnose

log = logging.getLogger("bench.micro.fp8_fidelity")
PROMPT = "a lighthouse on a cliff in a storm, dramatic clouds"


def main() -> None:
    p = bench_parser(__doc__, size=256, steps=8)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    start_logging()
    from diffusers import StableDiffusionXLPipeline

    from backends.core.runtime.unet_split import split_unet

    start = time.perf_counter()
    model = random_sdxl(args.work, args.device)
    dtype = torch.float32 if args.device == "cpu" else torch.float16
    pipe = StableDiffusionXLPipeline.from_pretrained(model, dtype=dtype).to(args.device)
    calibration = args.work / fp8.CALIBRATION_FILE
    fp8.write_calibration(pipe, calibration, args.size)
    with torch.no_grad():
        text, negative, pooled, negative_pooled = pipe.encode_prompt([PROMPT], device=args.device)
    unet, scheduler = pipe.unet, pipe.scheduler
    pipe = None  # the text encoders' memory
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(3)
    latent = args.size // 8

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    sample = rnd(2, 4, latent, latent)
    ids = torch.tensor([[args.size, args.size, 0, 0, args.size, args.size]] * 2, device=dev, dtype=dtype)
    texts = {"encoder_text": (torch.cat([negative, text]), torch.cat([negative_pooled, pooled])),
             "random_text": (rnd(2, 77, text.shape[-1]), rnd(2, pooled.shape[-1]))}
    timesteps = (999.0, 500.0, 20.0)

    @torch.no_grad()
    def eps(x, t, which):
        hidden, pool = texts[which]
        return unet(x, torch.full((2,), t, device=dev), encoder_hidden_states=hidden,
                    added_cond_kwargs={"text_embeds": pool, "time_ids": ids}).sample.float()

    @torch.no_grad()
    def trajectory():
        scheduler.set_timesteps(args.steps)
        x = torch.randn(1, 4, latent, latent, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        x = x * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            e = eps(scheduler.scale_model_input(torch.cat([x, x]), t), float(t), "encoder_text")
            x = scheduler.step((e[:1] + 5.0 * (e[1:] - e[:1])).to(dtype), t, x).prev_sample
        return x.float()

    exact = {(w, t): eps(sample, t, w) for w in texts for t in timesteps}
    exact_latents = trajectory()
    log.info("exact passes done in %.0f s", time.perf_counter() - start)
    layers = fp8.use_fp8(unet)
    encoder, decoder = split_unet(unet)
    fp8.calibrate_from_file(layers, unet, encoder, decoder, calibration)
    report = {"device": args.device, "dtype": str(dtype), "size": args.size, "fp8_linears": len(layers),
              "headroom": fp8.HEADROOM, "noise_rms_rel_error": {}}
    for headroom in (fp8.HEADROOM, 1.0):
        for layer in layers:
            layer.set_input_range(float(layer.x_amax), headroom)
        for which in texts:
            for t in timesteps:
                reach = []  # each layer's largest input against its calibrated range
                hooks = [layer.register_forward_pre_hook(
                    lambda m, a, reach=reach: reach.append(float(a[0].abs().max()) / float(m.x_amax)))
                    for layer in layers]
                error = rel_rms(eps(sample, t, which), exact[which, t])
                for hook in hooks:
                    hook.remove()
                key = f"{which}, t={t:.0f}, headroom {headroom:g}"
                report["noise_rms_rel_error"][key] = {
                    "error": error, "max_input_over_calibrated": max(reach),
                    "layers_past_the_range": sum(r > headroom for r in reach)}
                log.info("%s: noise error %.4f; inputs reach %.2fx the calibrated range, %d layers past it",
                         key, error, max(reach), report["noise_rms_rel_error"][key]["layers_past_the_range"])
        if headroom == fp8.HEADROOM:
            report[f"latents_rms_rel_error_{args.steps}_steps"] = rel_rms(trajectory(), exact_latents)
            log.info("denoised latents after %d steps: error %.4f", args.steps,
                     report[f"latents_rms_rel_error_{args.steps}_steps"])
    for layer in layers:
        layer.set_input_range(float(layer.x_amax))
    report["diagnosis_t500"] = {which: diagnose(layers, unet, lambda w=which: eps(sample, 500.0, w),
                                                exact[which, 500.0]) for which in texts}
    report["seconds"] = time.perf_counter() - start
    write_json(args.out, report)


if __name__ == "__main__":
    main()
