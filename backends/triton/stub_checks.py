"""What a Python backend stub checks about its own process before a model runs in it."""

from __future__ import annotations


def numpy_refusal(version: str, where: str) -> str | None:
    """Why a stub must not run with this numpy, or None. Triton 2.51's Python backend stub reads
    numpy's array structs with numpy 1's layout: under numpy 2 the tensors it builds from arrays
    come out empty or wrong, which clients see only as HTTP 500s or garbage."""
    if int(version.split(".")[0]) < 2:
        return None
    return (f"this model's stub imported numpy {version} ({where}); Triton 2.51's Python backend "
            "stub needs numpy<2: put a numpy<2 site-packages first on PYTHONPATH or on "
            "EASEL_SERVER_PYTHONPATH")
