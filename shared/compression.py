"""The compression settings a cache can be written with, in a module that imports nothing heavy,
so that the command lines can check them before they start torch, zarr or their workers."""

from __future__ import annotations

ZSTD_LEVELS = tuple(range(1, 16, 2))
"""The zstd levels a cache can use: it stores blosc clevel c = (level + 1) // 2, and blosc runs zstd at
level 2c - 1 for c in 1..8, so an even level would silently become another one."""
