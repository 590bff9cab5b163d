"""The denoiser: typed config, builder, step loop, step scheduler (who runs), denoiser (one step), samplers."""
