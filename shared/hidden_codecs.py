"""Codecs for cached hidden states: ``[tokens, layers, D]`` <-> stored bytes (+ scales).

``bf16``: the bf16 bits (lossless). ``fp8``: e4m3 with a scale per (token, layer); ``int8`` / ``int4``: symmetric
integers with a scale per ``group_size`` channels. A scale is the absolute maximum over 448, 127 or 7, rounded up so
every error stays within half a step. int4 packs channel 2i in the low nibble, 2i + 1 in the high one, as ``q + 8``.
Decoding is bitwise the same on CPU and GPU (one exact conversion, one correctly rounded multiply, one rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compression import HIDDEN_CODECS, SCALE_DTYPES

_FP8 = torch.float8_e4m3fn
_QMAX = {"fp8": float(torch.finfo(_FP8).max), "int8": 127, "int4": 7}  # fp8: 448
_SCALE_DTYPES = {name: getattr(torch, name) for name in SCALE_DTYPES}


@dataclass(frozen=True)
class HiddenCodec:
    """How hidden states are stored: losslessly as bf16, or quantised before the lossless stage."""

    mode: str = "fp8"  # 'bf16' (lossless), 'fp8', 'int8' or 'int4'
    group_size: int = 128  # channels sharing one scale in the int modes (must divide the hidden size; even for int4)
    scale_dtype: str = "float16"  # of the stored scales: 'float16' or 'float32'

    def __post_init__(self):
        if self.mode not in HIDDEN_CODECS:
            raise ValueError(f"hidden codec mode {self.mode!r}: expected one of {HIDDEN_CODECS}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"hidden codec scale_dtype {self.scale_dtype!r}: expected one of {sorted(_SCALE_DTYPES)}")
        if self.grouped and (self.group_size < 1 or (self.mode == "int4" and self.group_size % 2)):
            raise ValueError(f"hidden codec group_size {self.group_size}: must be positive"
                             + (" and even for int4 (two values per byte)" if self.mode == "int4" else ""))

    lossy = property(lambda self: self.mode != "bf16")
    grouped = property(lambda self: self.mode in ("int8", "int4"))  # whether group_size matters
    zero_byte = property(lambda self: 0x88 if self.mode == "int4" else 0)  # the payload byte that decodes to 0
    torch_scale_dtype = property(lambda self: _SCALE_DTYPES[self.scale_dtype])

    def describe(self) -> str:
        return {"bf16": "bf16 (lossless)", "fp8": f"fp8 e4m3 ({self.scale_dtype} scale per token and layer)"}.get(
            self.mode, f"{self.mode} (groups of {self.group_size}, {self.scale_dtype} scales)")

    def check_hidden_size(self, hidden_size: int) -> None:
        """Raise ValueError unless rows of ``hidden_size`` channels split into whole groups."""
        if self.grouped and hidden_size % self.group_size:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of the {self.mode} group size "
                             f"{self.group_size}; choose a group size that divides it")

    def groups(self, hidden_size: int) -> int:  # scales per (token, layer) row
        return {"bf16": 0, "fp8": 1}.get(self.mode, hidden_size // self.group_size)

    def payload_width(self, hidden_size: int) -> int:  # payload bytes per (token, layer) row
        return {"bf16": 2 * hidden_size, "int4": hidden_size // 2}.get(self.mode, hidden_size)

    def bytes_per_token(self, num_layers: int, hidden_size: int) -> int:
        """Encoded bytes of one token's hidden states (payload + scales), before the lossless stage."""
        self.check_hidden_size(hidden_size)
        scales = self.groups(hidden_size) * self.torch_scale_dtype.itemsize
        return num_layers * (self.payload_width(hidden_size) + scales)


@dataclass
class EncodedHidden:
    """One encoded array: ``payload`` uint8 ``[T, L, payload_width]``, ``scales`` ``[T, L, groups]``."""

    payload: torch.Tensor
    scales: torch.Tensor

    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()


def _scales(amax: torch.Tensor, qmax: float, dtype: torch.dtype) -> torch.Tensor:
    """amax / qmax in ``dtype``, rounded up where the cast rounded down (so |x| / scale <= qmax)."""
    exact = amax.double() / qmax
    stored = exact.to(dtype)
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    up = (stored.view(bits) + 1).view(dtype)  # the next value up: scales are >= 0 (no nextafter for half on CUDA)
    return torch.where(stored.double() < exact, up, stored)


def encode(codec: HiddenCodec, hidden: torch.Tensor, validate: bool = True) -> EncodedHidden:
    """``[T, L, D]`` float -> payload + scales. ``validate`` raises ValueError on NaN/Inf input and overflowing
    scales; it syncs with the device, so extraction skips it and checks the scales on the host (``check_scales``)."""
    if not codec.lossy:
        raise ValueError("the bf16 hidden codec is lossless: the cache stores the bf16 bits, nothing to encode")
    if hidden.dim() != 3:
        raise ValueError(f"hidden states must be [tokens, layers, D], got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden states must be floating point, got {hidden.dtype}")
    T, L, D = hidden.shape
    codec.check_hidden_size(D)
    x = hidden.float()
    if validate and not torch.isfinite(x).all():
        raise ValueError("hidden states hold NaN or Inf; a lossy codec cannot encode them")
    G, qmax = codec.groups(D), _QMAX[codec.mode]
    grouped = x.view(T, L, G, D // G)  # fp8: one group of D
    scales = _scales(grouped.abs().amax(dim=-1), qmax, codec.torch_scale_dtype)  # (T, L, G)
    scaled = grouped / torch.where(scales == 0, torch.ones_like(scales), scales).float()[..., None]
    if codec.mode == "fp8":
        q = scaled.clamp(-qmax, qmax).to(_FP8).view(T, L, D)
    else:
        q = torch.round(scaled).clamp(-qmax, qmax).to(torch.int8).view(T, L, D)
    payload = q.view(torch.uint8)
    if codec.mode == "int4":
        nibbles = (q.view(T, L, D // 2, 2) + 8).to(torch.uint8)  # 1..15
        payload = nibbles[..., 0] | (nibbles[..., 1] << 4)
    if validate:
        check_scales(codec, scales)
    return EncodedHidden(payload, scales)


def check_scales(codec: HiddenCodec, scales) -> None:
    """Raise ValueError where a scale (tensor or numpy) is not finite: NaN/Inf input, or a magnitude past its dtype."""
    finite = torch.isfinite(torch.as_tensor(scales))
    if not bool(finite.all()):
        raise ValueError(f"{int((~finite).sum())} non-finite {codec.mode} scales: the hidden states hold NaN or "
                         f"Inf, or magnitudes that overflow {codec.torch_scale_dtype} scales (use scale_dtype float32)")


def decode(codec: HiddenCodec, encoded: EncodedHidden, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """payload + scales of any leading dims -> ``[..., L, D]`` in ``dtype``, on the payload's device."""
    if not codec.lossy:
        raise ValueError("the bf16 hidden codec is lossless: nothing to decode")
    payload, scales = encoded.payload, encoded.scales
    if payload.dtype != torch.uint8 or payload.dim() < 3:
        raise ValueError(f"payload must be uint8 [..., L, bytes], got {payload.dtype} {tuple(payload.shape)}")
    *lead, L, width = payload.shape
    D = 2 * width if codec.mode == "int4" else width
    G = codec.groups(D)
    if tuple(scales.shape) != (*lead, L, G):
        raise ValueError(f"scales have shape {tuple(scales.shape)}, expected {(*lead, L, G)} "
                         f"for {codec.mode} with D {D}")
    if codec.mode == "int4":
        q = torch.stack([payload & 0x0F, payload >> 4], dim=-1).view(*lead, L, D).to(torch.int8).float() - 8
    else:
        q = payload.view(_FP8 if codec.mode == "fp8" else torch.int8).float()
    return (q.view(*lead, L, G, D // G) * scales.float()[..., None]).view(*lead, L, D).to(dtype)
