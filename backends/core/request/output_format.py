"""The image formats a request may ask for, and their quality settings (encoding: backends/core/stages/image_files.py)."""

FORMATS = ("png", "jpeg", "webp")
DEFAULT_FORMAT = "png"
MIME_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# Formats that take a `quality`, with its default; PNG is lossless and takes none.
DEFAULT_QUALITY = {"jpeg": 90, "webp": 90}
MIN_QUALITY, MAX_QUALITY = 1, 100


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"output_format: unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")


def check_quality(fmt: str, quality: int | None) -> None:
    """`quality` is for the lossy formats only, in [MIN_QUALITY, MAX_QUALITY]; None is the default."""
    if quality is None:
        return
    if fmt not in DEFAULT_QUALITY:
        raise ValueError(f"quality: only for {' and '.join(DEFAULT_QUALITY)}, not {fmt}")
    if not MIN_QUALITY <= quality <= MAX_QUALITY:
        raise ValueError(f"quality: {quality} is outside [{MIN_QUALITY}, {MAX_QUALITY}]")
