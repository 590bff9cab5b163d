"""[H, W, 3] uint8 RGB -> PNG bytes, deflated in parallel strips (pigz's method).

PNG's pixel data is one zlib stream, which zlib (and so PIL) deflates on one core: at 1024x1024
that is 0.1-0.2 s on the critical path of every request. Deflate blocks need not depend on each
other, so each strip of rows is deflated on its own (threads: zlib drops the GIL) and ended with a
sync flush, which byte-aligns it; the strips concatenated are one valid deflate stream, and the
zlib trailer's Adler-32 is combined from the strips' own. Each strip starts with an empty
dictionary, which costs a few bytes per strip, not a measurable ratio.

Deflate is ISA-L's (`isal`), not zlib's: at level 1 it took a 1024x1024 image's 3 MiB of
filtered rows in 9.0 ms against zlib's 36.7 ms on one core of the 2-core dev CPU, and wrote
1697 KiB against 1872 (a photo-like test image; both release the GIL). Its levels are 0-3.

Every row uses PNG's `Up` filter (the byte above subtracted): one vectorized subtraction, and on
the images we measured it compressed as well as PIL's per-row choice at level 1. The strip size is
fixed, not the thread count, so the bytes do not depend on the machine.
"""

from __future__ import annotations

import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from isal import isal_zlib

# Raw bytes a strip holds, about; one task per strip. With ISA-L on the H200 host (16 cores; a
# 1024x1024 random-weight image, 3 MiB raw, 2.5 MiB out; bench/micro/vae_micro.py, in one process):
# 256 KiB strips 4.9 / 3.7 / 3.5 / 4.0 ms on 2 / 4 / 8 / 16 threads, 64 KiB 6.8 / 5.5 / 6.5 / 8.8,
# 16 KiB 18-28: ISA-L deflates a strip so fast that smaller tasks cost more to hand out than they
# save. (With zlib it was the other way: 64 KiB on 16 threads, 18.3 ms.)
STRIP_BYTES = 256 * 1024
MAX_THREADS = 8
LEVELS = range(isal_zlib.ISAL_BEST_SPEED, isal_zlib.ISAL_BEST_COMPRESSION + 1)
_UP = 2  # PNG filter type
_ADLER_BASE = 65521
_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(min(MAX_THREADS, os.cpu_count() or 1), thread_name_prefix="png")
        return _pool


def adler32_combine(first: int, second: int, second_len: int) -> int:
    """Adler-32 of X+Y from Adler-32(X), Adler-32(Y) and len(Y): A = 1 + sum of bytes and B = sum
    of the running A's, so A_xy = A_x + A_y - 1 and B_xy = B_x + B_y + len(Y) * (A_x - 1)."""
    a1, b1 = first & 0xFFFF, first >> 16
    a2, b2 = second & 0xFFFF, second >> 16
    a = (a1 + a2 - 1) % _ADLER_BASE
    b = (b1 + b2 + second_len * (a1 - 1)) % _ADLER_BASE
    return (b << 16) | a


def _filtered_rows(pixels: np.ndarray, start: int, stop: int) -> bytes:
    """Rows [start, stop) as PNG scanlines: the filter byte, then the row minus the row above
    (uint8 arithmetic wraps, as PNG's modulo 256 wants); the image's first row has zeros above."""
    rows = pixels[start:stop].reshape(stop - start, -1)
    out = np.empty((stop - start, rows.shape[1] + 1), np.uint8)
    out[:, 0] = _UP
    above = pixels[start - 1].reshape(1, -1) if start > 0 else np.zeros((1, rows.shape[1]), np.uint8)
    np.subtract(rows[:1], above, out=out[:1, 1:])
    np.subtract(rows[1:], rows[:-1], out=out[1:, 1:])
    return out.tobytes()


def _deflate_strip(pixels: np.ndarray, start: int, stop: int, level: int, last: bool) -> tuple[bytes, int, int]:
    raw = _filtered_rows(pixels, start, stop)
    deflater = isal_zlib.compressobj(level, isal_zlib.DEFLATED, -15)  # raw deflate: no header, no trailer
    data = deflater.compress(raw) + deflater.flush(isal_zlib.Z_FINISH if last else isal_zlib.Z_SYNC_FLUSH)
    return data, isal_zlib.adler32(raw), len(raw)


def _chunk(kind: bytes, *parts: bytes) -> list[bytes]:
    """A chunk whose data is `parts` concatenated, as pieces to join: the image's data is not
    copied into a chunk of its own first (each copy of a 1024 px image's 3 MiB costs a millisecond)."""
    crc = isal_zlib.crc32(kind)
    for part in parts:
        crc = isal_zlib.crc32(part, crc)
    return [struct.pack(">I", sum(map(len, parts))), kind, *parts, struct.pack(">I", crc)]


def encode_png(pixels: np.ndarray, level: int, strip_bytes: int = STRIP_BYTES,
               executor: ThreadPoolExecutor | None = None) -> bytes:
    """RGB uint8 [H, W, 3] -> a PNG file (8-bit truecolour, no interlace), deflated at `level`.
    `strip_bytes` and `executor` (default: the module's pool) are for measuring other settings."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels: expected [H, W, 3] uint8, got {list(pixels.shape)} {pixels.dtype}")
    if level not in LEVELS:
        raise ValueError(f"level: {level} is not one of ISA-L's deflate levels {list(LEVELS)}")
    pixels = np.ascontiguousarray(pixels)
    height, width = pixels.shape[:2]
    rows_per_strip = max(1, strip_bytes // (width * 3 + 1))
    bounds = [(r, min(r + rows_per_strip, height)) for r in range(0, height, rows_per_strip)]
    jobs = [(pixels, start, stop, level, stop == height) for start, stop in bounds]
    if len(jobs) == 1:
        strips = [_deflate_strip(*jobs[0])]
    else:
        strips = list((executor or _executor()).map(lambda job: _deflate_strip(*job), jobs))
    checksum = 1  # Adler-32 of nothing
    for _, adler, length in strips:
        checksum = adler32_combine(checksum, adler, length)
    # zlib header: deflate, 32 KiB window, "fastest" level hint; its check bits make it a multiple of 31.
    stream = [b"\x78\x01", *(data for data, _, _ in strips), struct.pack(">I", checksum)]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join([_SIGNATURE, *_chunk(b"IHDR", header), *_chunk(b"IDAT", *stream), *_chunk(b"IEND")])
