"""What the command lines need of the cache's contract before they import torch or zarr: codec names, zstd levels,
whether a location is local, and byte counts in words."""

from __future__ import annotations

from typing import Literal, get_args

HiddenCodecName = Literal["bf16", "fp8", "int8", "int4"]  # bf16 lossless, or a lossy codec (``hidden_codecs``)
ScaleDtype = Literal["float16", "float32"]  # of the lossy codecs' scales
TopkDtype = Literal["float32", "float16", "bfloat16"]  # of the stored top-k log-probs
HIDDEN_CODECS, SCALE_DTYPES, TOPK_DTYPES = get_args(HiddenCodecName), get_args(ScaleDtype), get_args(TopkDtype)

# the zstd levels a cache can use: blosc clevel c = (level + 1) // 2 runs zstd at level 2c - 1 (c in 1..8), so an
# even level would silently become another one
ZSTD_LEVELS = tuple(range(1, 16, 2))


def is_local(path) -> bool:
    """Whether a cache location is a local path rather than an fsspec URL (``s3://``, ``file://``, ...)."""
    return "://" not in str(path)


def size_text(n: float | None) -> str:
    """Bytes in binary units, three significant figures or so ('unknown' for None)."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
