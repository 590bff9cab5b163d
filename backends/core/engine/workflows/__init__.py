"""Workflows: what differs per task (admission, per-request state, the UNet's input, what follows
the UNet). The denoiser's runner serves every workflow named here (DenoiseJob.workflow)."""

from backends.core.engine.workflows.inpaint import Inpaint
from backends.core.engine.workflows.txt2img import Txt2Img

WORKFLOWS = {Txt2Img.name: Txt2Img, Inpaint.name: Inpaint}
