"""The tensors each Triton model of the repository takes and returns, declared once.

Export writes every config.pbtxt from these declarations and the Triton adapters read their
inputs by these names, so a rename happens here or nowhere. Text embeddings and latents cross
model boundaries as FP32 whatever the engines' dtype: converting fp16/bf16 to fp32 and back is
exact, and it keeps the wire format independent of the deployment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorDecl:
    name: str
    dtype: str  # Triton data type without the TYPE_ prefix: FP32, INT32, INT64, BYTES, UINT8
    dims: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class ModelDecl:
    inputs: tuple[TensorDecl, ...]
    outputs: tuple[TensorDecl, ...]

    def input(self, name: str) -> TensorDecl:
        return next(t for t in self.inputs if t.name == name)


def _t(name, dtype, *dims, optional=False):
    return TensorDecl(name, dtype, tuple(dims), optional)


PARAMS = _t("params", "BYTES", 1)  # GenerateParams as JSON, carrying stage timings along

# The public model `easel`: what HTTP/gRPC clients and perf_analyzer send.
PUBLIC = ModelDecl(
    inputs=(
        # Optional for Triton so that a missing prompt reaches preprocess, which names it in its
        # error, rather than Triton refusing the request with a message of its own.
        _t("prompt", "BYTES", 1, optional=True),
        _t("negative_prompt", "BYTES", 1, optional=True),
        _t("width", "INT32", 1, optional=True),
        _t("height", "INT32", 1, optional=True),
        _t("steps", "INT32", 1, optional=True),
        _t("guidance_scale", "FP32", 1, optional=True),
        _t("seed", "INT64", 1, optional=True),
        _t("scheduler", "BYTES", 1, optional=True),
        # ControlNets: one name, image (PNG/JPEG) and optional scale/window per ControlNet.
        _t("controlnets", "BYTES", -1, optional=True),
        _t("control_images", "BYTES", -1, optional=True),
        _t("control_scales", "FP32", -1, optional=True),
        _t("control_guidance_start", "FP32", -1, optional=True),
        _t("control_guidance_end", "FP32", -1, optional=True),
        # LoRAs: names from the adapter store, with optional scales (default 1.0).
        _t("loras", "BYTES", -1, optional=True),
        _t("lora_scales", "FP32", -1, optional=True),
        # The returned image's encoding: png (default), jpeg or webp, and quality for the last two.
        _t("output_format", "BYTES", 1, optional=True),
        _t("quality", "INT32", 1, optional=True),
        # An edit (inpainting): the template (PNG/JPEG), its mask (0 keeps, 255 repaints) and how
        # far the template is noised (request/edit_inputs.py).
        _t("image", "BYTES", 1, optional=True),
        _t("mask_image", "BYTES", 1, optional=True),
        _t("strength", "FP32", 1, optional=True),
        # An edit's template name: its first edit records activations that later ones reuse for
        # their unmasked tokens (approximate; where the runtime cannot, the edit is exact).
        _t("template", "BYTES", 1, optional=True),
    ),
    outputs=(_t("image", "BYTES", 1), _t("info", "BYTES", 1)),
)

EMBEDS = (_t("prompt_embeds", "FP32", -1, -1, -1), _t("pooled_embeds", "FP32", -1, -1))
LATENTS = _t("latents", "FP32", 1, -1, -1, -1)
# Validated control images (encoded as the client sent them), possibly none: always present, so
# that every denoising job carries the tensor.
CONTROL_IMAGES = _t("control_images", "BYTES", -1)
PIXELS = _t("pixels", "UINT8", -1, -1, 3)

PREPROCESS = ModelDecl(inputs=PUBLIC.inputs, outputs=(PARAMS, CONTROL_IMAGES))
TEXT_ENCODER = ModelDecl(inputs=(PARAMS,), outputs=(PARAMS, *EMBEDS))
# An edit's template and mask, encoded by the VAE (backends/core/stages/vae_encoding.py): the latent
# distributions of the template and of the template with its masked region blanked (mean and std,
# before the VAE's scaling factor; zeros for a UNet of 4 input channels, which only draws that
# sample), the mask at latent size (1: repaint), and that factor.
EDIT = (_t("image_mean", "FP32", 1, -1, -1, -1), _t("image_std", "FP32", 1, -1, -1, -1),
        _t("masked_mean", "FP32", 1, -1, -1, -1), _t("masked_std", "FP32", 1, -1, -1, -1),
        _t("mask", "FP32", 1, 1, -1, -1), _t("scaling_factor", "FP32", 1))
VAE_ENCODER = ModelDecl(inputs=(PARAMS, _t("image", "BYTES", 1), _t("mask_image", "BYTES", 1)),
                        outputs=(PARAMS, *EDIT))

# A denoiser's request: the job (the tensors it needs, optional for Triton only so that a cancel
# request may come alone; the denoiser names a missing one itself), and optionally
# - `cancel_key`, a key of the caller's: a later request that carries only `cancel` with that key
#   stops the request at the next step boundary (Triton 2.51 cannot cancel a BLS request; the
#   public models send it, backends/triton/bls_pipeline.py says why). The denoiser answers such a request
#   first with an empty response once admitted: a BLS caller's exec returns only at a first
#   response, and from then on a cancel finds the request. Its failure then comes as the final
#   response's `error` (the marked message, triton/adapter.MARKS): Triton 2.51 never hands a BLS
#   caller an error response that follows another response of the same request (measured: the
#   caller's iterator waits forever);
# - the EDIT tensors, all of them for an edit (params.strength set), none otherwise;
# - `preview_every`: one empty response per step before the final one (easel_stream); every
#   `preview_every` steps (0: never) the latents go first into the file of the request's
#   `cancel_key`, if its caller made one (backends/core/serving/preview_board.py). Without it, only the final
#   one. No step response carries a tensor: Triton 2.51 loads a BLS response's tensors without
#   the GIL, racing the caller's Python (preview_board says more), so the caller counts them.
DENOISE_JOB = (PARAMS, *EMBEDS, CONTROL_IMAGES)
PREVIEW_EVERY = _t("preview_every", "INT32", 1, optional=True)
DENOISER = ModelDecl(
    inputs=(*(TensorDecl(t.name, t.dtype, t.dims, optional=True) for t in (*DENOISE_JOB, *EDIT)),
            _t("cancel_key", "BYTES", 1, optional=True), PREVIEW_EVERY, _t("cancel", "BYTES", 1, optional=True)),
    outputs=(PARAMS, LATENTS, _t("error", "BYTES", 1)),
)
VAE_DECODER = ModelDecl(inputs=(PARAMS, LATENTS), outputs=(PARAMS, PIXELS))

# The public model `easel_stream` (decoupled, gRPC streaming): `easel`'s inputs, and `preview_every`
# (0 or absent: no previews). One response per denoising step carries `step`, `steps`, `elapsed_s`
# (since the request arrived) and, every `preview_every` steps, `preview` (a PNG at the latent
# grid's size, backends/core/stages/preview.py); the final response carries `image` and `info`.
STREAM = ModelDecl(
    inputs=(*PUBLIC.inputs, PREVIEW_EVERY),
    outputs=(*PUBLIC.outputs, _t("step", "INT32", 1), _t("steps", "INT32", 1), _t("elapsed_s", "FP32", 1),
             _t("preview", "BYTES", 1)),
)



WIRE_DTYPES = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16"}

# Internal models (everything but the public `easel` and `easel_stream`) take calls that carry the
# server's per-start secret as this request parameter; the server's environment holds it
# (backends/triton/adapter.check_caller).
INTERNAL_KEY_ENV = "EASEL_INTERNAL_KEY"
# A file whose path easel serve puts in the server's environment and creates when it starts
# draining: from then on `preprocess` refuses every request with UNAVAILABLE.
DRAIN_FLAG_ENV = "EASEL_DRAIN_FLAG"
INTERNAL_KEY_PARAMETER = "easel_internal_key"


def controlnet_decl(num_skips: int, dtype: str = "FP32") -> ModelDecl:
    """The ControlNet service: one ControlNet (by name) on one request's rows at one step.

    `dtype` is the engines' (FP16 on GPUs): per step these tensors are large (hundreds of MB in
    fp32 at 1024 px), so they cross in the engines' precision, on the device where they live.
    `session` names one ControlNet of one request: the constants (image, embeddings, time ids)
    sent with it are kept by the instance, and a later call of the session may leave them out
    (backends/core/adapters/control_sessions.py). Without a session every call carries them.
    On GPUs `sample` and `timestep` stay in the caller's mailbox and the residuals go back there:
    `mailbox` describes it and `mailbox_event` is the answer (backends/core/adapters/cuda_ipc.py)."""
    step = (_t("sample", dtype, -1, -1, -1, -1, optional=True), _t("timestep", "FP32", -1, optional=True))
    constants = (_t("prompt_embeds", dtype, -1, -1, -1, optional=True), _t("pooled_embeds", dtype, -1, -1, optional=True),
                 _t("time_ids", dtype, -1, -1, optional=True), _t("image", dtype, -1, 3, -1, -1, optional=True))
    return ModelDecl(
        inputs=(_t("name", "BYTES", 1), _t("scale", "FP32", 1), *step, *constants,
                _t("session", "BYTES", 1, optional=True), _t("mailbox", "BYTES", 1, optional=True)),
        outputs=(*(_t(f"down_{i}", dtype, -1, -1, -1, -1) for i in range(num_skips)),
                 _t("mid", dtype, -1, -1, -1, -1), _t("mailbox_event", "UINT8", 64)),
    )
