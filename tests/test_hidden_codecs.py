"""Lossy hidden-state codecs: shapes and dtypes, int4 packing against a numpy packing, and
every decoded value within its mode's error bound, computed in float64 from the input, on
activations with outlier channels (a few channels 100x the rest, as real LLMs have)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.shared.hidden_codecs import EncodedHidden, HiddenCodec, decode, encode

T, L, D = 48, 3, 256
OUTLIERS = [5, 77, 130, 200]


def activations(seed: int = 0) -> torch.Tensor:
    """bf16 [T, L, D], unit normal with channels OUTLIERS x100 (and a zero row, a tiny row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, D, generator=g, dtype=torch.float64)
    x[:, :, OUTLIERS] *= 100
    x[3, 1] = 0.0
    x[4, 2] *= 1e-6
    return x.to(torch.bfloat16)


CODECS = [HiddenCodec("fp8"), HiddenCodec("int8", 64), HiddenCodec("int8", 32, "float32"),
          HiddenCodec("int4", 32), HiddenCodec("int4", 128)]


def _bound(codec: HiddenCodec, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest allowed |decoded - x| per value, in float64: half a quantisation step of the
    stored scale (fp8: half an e4m3 ulp of the scaled value, at least half the subnormal
    spacing), plus the final rounding to bf16 (8 bits of mantissa)."""
    x64 = x.double().abs()
    s = scales.double()
    if codec.mode == "fp8":
        scaled = x64 / torch.where(s == 0, torch.ones_like(s), s)
        half_ulp = torch.maximum(scaled * 2.0 ** -4, torch.full_like(scaled, 2.0 ** -10))
        quant = half_ulp * s
    else:
        quant = (s / 2).repeat_interleave(codec.group_size, dim=-1)
    return quant + (x64 + quant) * 2.0 ** -8


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.mode}-g{c.group_size}-{c.scale_dtype}")
def test_round_trip_within_the_error_bound_of_each_value(codec):
    x = activations()
    enc = encode(codec, x)
    width = D // 2 if codec.mode == "int4" else D
    groups = 1 if codec.mode == "fp8" else D // codec.group_size
    assert enc.payload.dtype == torch.uint8 and tuple(enc.payload.shape) == (T, L, width)
    assert enc.scales.dtype == getattr(torch, codec.scale_dtype) and tuple(enc.scales.shape) == (T, L, groups)
    assert enc.nbytes() == T * codec.bytes_per_token(L, D)
    out = decode(codec, enc)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    err = (out.double() - x.double()).abs()
    bound = _bound(codec, x, enc.scales)
    worst = (err - bound).max()
    assert worst <= 0, f"{codec.mode}: a value is off by {worst:.3g} more than its bound"
    assert torch.equal(out[3, 1], torch.zeros(D, dtype=torch.bfloat16))  # a zero row stays zero
    # the scales are as small as the bound allows: the group's largest value lands on the grid's edge
    qmax = {"fp8": 448, "int8": 127, "int4": 7}[codec.mode]
    amax = x.double().abs().view(T, L, groups, -1).amax(-1)
    assert torch.all(enc.scales.double() * qmax >= amax)
    spacing = 2.0 ** -24 if codec.scale_dtype == "float16" else 2.0 ** -149  # the smallest subnormal step
    assert torch.all(enc.scales.double() * qmax <= amax * (1 + 2.0 ** -9) + spacing * qmax)


def test_relative_error_per_mode_and_what_outliers_cost():
    """Relative L2 error against float64, over all values and over the ordinary channels of
    groups that hold an outlier: per-token floats (fp8) keep those, int groups lose them."""
    x = activations(1)
    x64 = x.double()
    ordinary = torch.ones(D, dtype=torch.bool)
    ordinary[OUTLIERS] = False
    errors = {}
    for codec in (HiddenCodec("fp8"), HiddenCodec("int8", 128), HiddenCodec("int4", 128), HiddenCodec("int4", 32)):
        out = decode(codec, encode(codec, x)).double()
        rel_all = ((out - x64).norm() / x64.norm()).item()
        rel_ordinary = ((out - x64)[..., ordinary].norm() / x64[..., ordinary].norm()).item()
        errors[f"{codec.mode}-{codec.group_size}"] = (rel_all, rel_ordinary)
    # fp8's error is relative to each value (3 mantissa bits); the int modes' is a step set by the group's largest
    assert errors["fp8-128"][0] < 2.0 ** -4 and errors["fp8-128"][1] < 2.0 ** -4
    assert errors["int8-128"][1] > errors["fp8-128"][1]  # ordinary channels share the outliers' step
    assert errors["int4-128"][1] > 0.5  # a step of ~100 sigma / 7 rounds ordinary channels to zero
    assert errors["int4-32"][1] < errors["int4-128"][1]  # smaller groups confine the damage


def test_int4_packing_matches_numpy():
    """Two values a byte, channel 2i low nibble, 2i + 1 high, each stored as q + 8."""
    codec = HiddenCodec("int4", 16)
    rng = np.random.default_rng(0)
    q = rng.integers(-7, 8, size=(4, 2, 32))
    q[..., 0] = 7  # every group reaches +-7 so its scale is exactly the one chosen below
    q[..., 16] = -7
    scale = 0.5  # exact in float16 and in bf16 with q
    x = torch.tensor(q * scale, dtype=torch.bfloat16)
    enc = encode(codec, x)
    nibbles = (q + 8).astype(np.uint8)
    expected = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    assert np.array_equal(enc.payload.numpy(), expected)
    assert torch.all(enc.scales == scale)
    assert torch.equal(decode(codec, enc), x)  # on the grid: exact


def test_int8_and_fp8_are_exact_on_their_grids():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (5, 2, 64), generator=g)
    q[..., 0] = 127
    x = (q * 0.25).to(torch.bfloat16)
    codec = HiddenCodec("int8", 64)
    enc = encode(codec, x)
    assert torch.equal(enc.payload.view(torch.int8).long(), q) and torch.equal(decode(codec, enc), x)
    values = torch.tensor([448.0, -448.0, 1.0, 0.015625, 2.0 ** -9, 0.0]).view(1, 1, 6)
    fp8 = HiddenCodec("fp8", scale_dtype="float32")
    assert torch.equal(decode(fp8, encode(fp8, values.to(torch.bfloat16))), values.to(torch.bfloat16))


def test_bad_input_is_refused_naming_the_problem():
    with pytest.raises(ValueError, match="not a multiple of the int8 group size 48"):
        encode(HiddenCodec("int8", 48), activations())
    with pytest.raises(ValueError, match="even for int4"):
        HiddenCodec("int4", 15)
    with pytest.raises(ValueError, match="mode 'int2'"):
        HiddenCodec("int2")
    with pytest.raises(ValueError, match=r"\[tokens, layers, D\]"):
        encode(HiddenCodec("fp8"), torch.zeros(4, 8))
    bad = activations()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode(HiddenCodec("int8"), bad)
    with pytest.raises(ValueError, match="overflow torch.float16 scales"):
        encode(HiddenCodec("int4", 32), torch.full((1, 1, 32), 1e6))
    enc = encode(HiddenCodec("int8", 64), activations())
    with pytest.raises(ValueError, match="scales have shape"):
        decode(HiddenCodec("int8", 32), enc)
    with pytest.raises(ValueError, match="payload must be uint8"):
        decode(HiddenCodec("int8", 64), EncodedHidden(enc.payload.view(torch.int8), enc.scales))
