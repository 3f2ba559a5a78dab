"""Lossy hidden-state codecs and reduced-precision log-probs in the cache, end to end on the CPU.

A tiny Qwen3 target whose residual stream carries outlier channels (a few embedding columns
scaled 100x, so every layer's output has channels ~100x the rest, as real LLMs do) is
extracted with each codec; every decoded value is checked against the HF model's own
``output_hidden_states`` within its mode's bound (fp8: half an e4m3 step of the value under
its row scale; int: half its group's step), the mode is recorded and a resume with another
refused, a flipped byte is found by ``verify``, training runs on a lossy cache, and decoding
in the loader or on the device gives bitwise the same batches and the same trained weights.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash.extract import runner as R
from dflash.extract.config import ExtractConfig
from dflash.shared import cache as C
from dflash.shared.cache_cli import main as cache_main

LAYERS = [0, 1, 2]
TOPK = 8
OUTLIERS = [5, 40, 41]
CODECS = {  # name -> extraction settings
    "fp8": dict(hidden_codec="fp8"),
    "int8": dict(hidden_codec="int8", hidden_group_size=16),
    "int4": dict(hidden_codec="int4", hidden_group_size=32, topk_dtype="bfloat16"),
    "fp8-f16": dict(hidden_codec="fp8", hidden_scale_dtype="float32", topk_dtype="float16"),
}


@pytest.fixture(scope="module")
def outlier_target_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny 4-layer, 64-wide Qwen3 with embedding columns OUTLIERS scaled 100x."""
    from toy_target import build_qwen3
    from transformers import AutoModelForCausalLM

    path = build_qwen3(tmp_path_factory.mktemp("outlier_target"), tiny_tokenizer, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, OUTLIERS] *= 100
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chats_sample_path):
    rows = chats_sample_path.read_text().splitlines()[:12]
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def config(out, data_path, target_dir, **overrides) -> ExtractConfig:
    settings = dict(device="cpu", layers=LAYERS, topk=TOPK, max_length=96, batch_tokens=400,
                    commit_seconds=0, chunk_tokens=64, cpu_threads=1, progress=False, dtype="float32")
    return ExtractConfig(data=str(data_path), model=str(target_dir), out=str(out), **{**settings, **overrides})


def extract_in_process(cfg: ExtractConfig) -> None:
    """One run of ``cfg`` (one shard) in this process."""
    threads = torch.get_num_threads()
    try:
        R.run(cfg)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def caches(tmp_path_factory, data_path, outlier_target_dir):
    """name -> path of a complete cache extracted with CODECS[name] (and 'bf16', the default)."""
    base = tmp_path_factory.mktemp("caches")
    out = {}
    for name, settings in {"bf16": {}, **CODECS}.items():
        out[name] = base / f"{name}.zarr"
        extract_in_process(config(out[name], data_path, outlier_target_dir, **settings))
    return out


@pytest.fixture(scope="module")
def reference(outlier_target_dir):
    """The HF model itself (fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(outlier_target_dir, dtype=torch.float32).eval()


def _bound(spec: C.CacheSpec, ref: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest allowed |decoded - ref| per value, float64: half a quantisation step under the
    stored scale (fp8: half an e4m3 spacing at |ref| / scale, subnormals' 2^-9 at least; int:
    half the group's scale), plus fp32 slack for a batched forward against a single one."""
    x = ref.double().abs()
    s = scales.double()
    if spec.hidden_codec == "fp8":
        scaled = x / torch.where(s == 0, torch.ones_like(s), s)
        exponent = torch.floor(torch.log2(scaled.clamp(min=2.0 ** -6)))  # e4m3's normal exponents start at -6
        quant = 2.0 ** (exponent - 3) / 2 * s  # half the spacing of 3 mantissa bits
    else:
        quant = (s / 2).repeat_interleave(spec.hidden_group_size, dim=-1)
    slack = 2e-6 * x.amax(dim=-1, keepdim=True) + 1e-6
    return quant + slack


def test_lossless_default_is_format_2_without_codec_fields(caches):
    """The default writes what it wrote before codecs: format 2, no encoding keys in the root
    attributes or the fingerprint, the five token arrays with their v2 dtypes, no scales."""
    import zarr

    root = zarr.open_group(str(caches["bf16"]), mode="r")
    attrs = root.attrs[C.ATTRS_KEY]
    assert attrs["format_version"] == 2 and not set(C.ENCODING_DEFAULTS) & set(attrs)
    assert "encoding" not in attrs["fingerprint"]["extraction"]
    shard = root["shards/00000"]
    assert {name for name, _ in shard.arrays()} == set(C.TOKEN_FIELDS) | {"offsets", "source_index", "batches"}
    assert {f: str(shard[f].dtype) for f in C.TOKEN_FIELDS} == attrs["stored_dtypes"] == {
        "input_ids": "int32", "loss_mask": "bool", "hidden": "uint16", "topk_ids": "int32", "topk_logprobs": "float32"}
    assert C.CacheSpec.from_dict(attrs).hidden_codec == "bf16"


@pytest.mark.parametrize("name", list(CODECS))
def test_decoded_values_within_their_bound_of_hf_hidden_states(caches, reference, name):
    reader = C.CacheReader(str(caches[name]))
    spec = reader.spec
    settings = CODECS[name]
    assert spec.format_version == 3 and spec.hidden_codec == settings["hidden_codec"]
    assert spec.topk_dtype == settings.get("topk_dtype", "float32")
    assert spec.fingerprint["extraction"]["encoding"] == spec.encoding()
    codec = spec.codec
    D = spec.hidden_size
    outlier_share = []
    for i in range(len(reader)):
        raw = reader.read_raw(i, spec.token_fields)
        assert raw["hidden"].dtype == np.uint8 and raw["hidden"].shape[2] == codec.payload_width(D)
        assert raw["hidden_scale"].shape[2] == codec.groups(D)
        decoded = C.decode_hidden(spec, raw, torch.float32)  # (T, L, D)
        sample = reader.read(i)
        assert torch.equal(sample["hidden"], decoded.bfloat16())  # the reader's bf16 is this, rounded once
        with torch.no_grad():
            out = reference(sample["input_ids"][None], output_hidden_states=True)
        scales = torch.from_numpy(raw["hidden_scale"])
        for slot, layer in enumerate(LAYERS):
            ref = out.hidden_states[layer + 1][0]  # (T, D)
            err = (decoded[:, slot].double() - ref.double()).abs()
            excess = (err - _bound(spec, ref, scales[:, slot])).max().item()
            assert excess <= 0, f"{name} layer {layer}: a value is {excess:.3g} past its bound"
            ordinary = torch.ones(D, dtype=torch.bool)
            ordinary[OUTLIERS] = False
            outlier_share.append(ref[:, OUTLIERS].abs().mean() / ref[:, ordinary].abs().mean())
        # top-k log-probs at their stored precision, read back as float32
        lp = torch.log_softmax(out.logits[0].float(), -1).gather(1, sample["topk_ids"])
        assert sample["topk_logprobs"].dtype == torch.float32
        tol = {"float32": 1e-5, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[spec.topk_dtype]
        torch.testing.assert_close(sample["topk_logprobs"], lp, rtol=tol, atol=1e-5)
    assert min(outlier_share) > 50  # the outlier channels really are ~100x the others


def test_resume_with_another_codec_is_refused_naming_both(caches, data_path, outlier_target_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dflash.extract.cli", "--data", data_path, "--model",
                           outlier_target_dir, "--out", caches["int8"], "--device", "cpu", "--dtype", "float32",
                           "--layers", "0,1,2", "--topk", str(TOPK), "--max-length", "96", "--batch-tokens", "400",
                           "--chunk-tokens", "64", "--no-progress", "--hidden-codec", "fp8"],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "hidden_codec: cache has 'int8', run has 'fp8'  [--hidden-codec]" in proc.stderr, proc.stderr[-2000:]
    # the same run with the cache's settings resumes it (nothing left to do)
    cfg = config(caches["int8"], data_path, outlier_target_dir, **CODECS["int8"])
    extract_in_process(cfg)
    with pytest.raises(R.ExtractFailed, match="hidden_group_size: cache has 16, run has 32"):
        extract_in_process(config(caches["int8"], data_path, outlier_target_dir, hidden_codec="int8",
                                  hidden_group_size=32))
    with pytest.raises(R.ExtractFailed, match="not a multiple of the int8 group size 48"):
        extract_in_process(config(tmp_path / "x.zarr", data_path, outlier_target_dir, hidden_codec="int8",
                                  hidden_group_size=48))


@pytest.mark.parametrize("array", ["hidden", "hidden_scale"])
def test_verify_finds_a_flipped_byte_in_a_lossy_chunk(caches, tmp_path, array):
    import shutil

    path = tmp_path / "c.zarr"
    shutil.copytree(caches["int4"], path)
    clean = json.loads(CliRunner().invoke(cache_main, ["verify", str(path), "--json", "--no-progress"]).output)
    assert clean["ok"], clean["problems"]
    f = path / "shards" / "00000" / array / "c" / "1" / "0" / "0"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    result = CliRunner().invoke(cache_main, ["verify", str(path), "--json", "--no-progress"])
    d = json.loads(result.output)
    assert result.exit_code == 1 and [(p["array"], p["check"]) for p in d["problems"]] == [(array, "undecodable")]
    assert d["problems"][0]["tokens"] == [64, 128]


def test_info_shows_codec_and_bytes_per_token(caches):
    for name in ("bf16", "int4"):
        result = CliRunner().invoke(cache_main, ["info", str(caches[name]), "--json"])
        d = json.loads(result.output)
        L, D = len(LAYERS), d["hidden_size"]
        per_token = d["bytes_per_token"]
        assert per_token["hidden_raw_bf16"] == L * D * 2
        expected = L * D * 2 if name == "bf16" else L * (D // 2 + (D // 32) * 2)  # int4 nibbles + float16 scales
        assert per_token["hidden_encoded"] == expected and d["encoding"]["hidden_codec"] == name
        assert per_token["hidden_on_disk"] * d["tokens"] == pytest.approx(d["committed_bytes_on_disk"]["hidden"])
        text = CliRunner().invoke(cache_main, ["info", str(caches[name])]).output
        assert f"codec      hidden {C.CacheReader(str(caches[name])).spec.codec.describe()}" in text
        assert f"raw bf16 {L * D * 2:,}, encoded {expected:,}" in text


@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_loader_and_device_decoding_give_bitwise_the_same_batch(caches, name):
    from dflash.train.data import AnchorDataset, Collate, EncodedContext
    from dflash.train.step import to_device

    reader = C.CacheReader(str(caches[name]))
    keys = [(0, 3), (0, 0), (0, -1), (0, 7)]  # a weightless filler included
    batches = {}
    for on_device in (False, True):
        ds = AnchorDataset(reader, [0, 2], 96, 8, seed=0, decode_on_device=on_device)
        batch = Collate([64, 96])([ds[k] for k in keys])
        assert isinstance(batch["context_hidden"], EncodedContext) == on_device
        batches[on_device] = to_device(batch, torch.device("cpu"))
    a, b = batches[False], batches[True]
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert torch.equal(a["context_hidden"].view(torch.int16), b["context_hidden"].view(torch.int16))  # -0.0 too


def test_training_on_a_lossy_cache_does_not_depend_on_where_decoding_runs(caches, outlier_target_dir, tmp_path):
    from dflash.train import checkpoint
    from dflash.train.cli import main

    weights = {}
    for where, preload in (("loader", "off"), ("device", "off"), ("device", "on")):  # on: kept encoded once read
        run = tmp_path / f"{where}-{preload}"
        main(["--preset", "tiny", "--cache", str(caches["int4"]), "--target", str(outlier_target_dir),
              "--out", str(run), "--max-steps", "3", "--mask-token-id", "3", "--max-anchors", "4",
              "--eval-samples", "2", "--num-workers", "1", "--hidden-decode", where, "--preload", preload])
        weights[where, preload] = checkpoint.load_weights(checkpoint.resolve(run))
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert any(x.get("kind") == "eval" and np.isfinite(x["loss"]) for x in lines)
    a = weights["loader", "off"]
    for b in (weights["device", "off"], weights["device", "on"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_spec_encoding_fields_format_and_round_trip():
    lossless = C.CacheSpec(layer_ids=[1, 5], hidden_size=256, topk=4, vocab_size=100, num_target_layers=8,
                           max_length=64, truncation="right")
    assert lossless.format_version == 2 and not set(C.ENCODING_DEFAULTS) & set(lossless.to_dict())
    int4 = lossless.with_encoding(hidden_codec="int4", hidden_group_size=64, topk_dtype="bfloat16")
    assert int4.format_version == 3 and int4.token_fields == C.TOKEN_FIELDS + ("hidden_scale",)
    assert int4.chunks["hidden_scale"] == int4.chunks["hidden"] == int4.chunk_tokens
    assert C.token_array_shapes(int4, 10)["hidden"] == ((10, 2, 128), "uint8")
    assert C.token_array_shapes(int4, 10)["hidden_scale"] == ((10, 2, 4), "float16")
    assert int4.codec.bytes_per_token(int4.num_layers, int4.hidden_size) == 2 * (128 + 4 * 2)
    assert C.CacheSpec.from_dict(int4.to_dict()) == int4
    fp8 = int4.with_encoding(hidden_codec="fp8", topk_dtype="float32")
    assert fp8.hidden_group_size is None and fp8.hidden_scale_dtype == "float16"  # fields that do not apply: None
    assert lossless.with_encoding(hidden_codec="fp8", hidden_group_size=32) == fp8.with_encoding(hidden_group_size=7)
    assert fp8.with_encoding(hidden_codec="bf16").to_dict() == lossless.to_dict()
    assert [d.split(":")[0] for d in C.spec_differences(lossless, fp8)] == [
        "hidden_codec", "hidden_scale_dtype", "format_version", "chunks.hidden_scale"]
    with pytest.raises(C.CacheError, match="not a multiple of the int8 group size 96"):
        lossless.with_encoding(hidden_codec="int8", hidden_group_size=96)
    with pytest.raises(C.CacheError, match="hidden codec mode 'int2'"):
        lossless.with_encoding(hidden_codec="int2")
    with pytest.raises(C.CacheError, match="format version 4 is not supported"):
        C.CacheSpec.from_dict({**int4.to_dict(), "format_version": 4})


@pytest.mark.parametrize("name", list(CODECS))
def test_read_many_equals_read_for_every_codec(caches, name):
    """Read span by span, a lossy cache's samples equal ``read``'s bitwise, decoded on the CPU or kept encoded with
    their scales (the preloaded copy that training decodes on a GPU)."""
    from dflash.shared.cache import CacheReader

    reader = CacheReader(str(caches[name]))
    fields = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs")
    for decode in (True, False):
        for index, sample in reader.read_many(range(len(reader)), fields, decode=decode, span_tokens=50):
            expected = reader.read(index, fields, decode=decode)
            assert sample.keys() == expected.keys() and ("hidden_scale" in sample) != decode
            assert all(torch.equal(sample[k], v) for k, v in expected.items() if torch.is_tensor(v)), (index, decode)


def test_lossy_shard_resumed_mid_chunk_equals_an_unbroken_one(tmp_path):
    """A lossy shard whose writer died after a commit that left a partial chunk (and wrote one
    more batch, uncommitted) resumes to exactly the arrays of an unbroken writer, and reads
    back as the decoded encoding of what was written."""
    import zarr

    spec = C.CacheSpec(layer_ids=[0, 1], hidden_size=64, topk=3, vocab_size=50, num_target_layers=3,
                       max_length=40, truncation="right", chunk_tokens=16, hidden_codec="int4",
                       hidden_group_size=16, topk_dtype="float16")
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 30, 6)
    plan = C.ShardPlan(source_index=np.arange(6), lengths=lengths, batches=np.arange(7))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(int(lengths.sum()), 2, 64, generator=g) * torch.where(torch.arange(64) % 9 == 0, 100.0, 1.0)
    logprobs = -torch.rand(int(lengths.sum()), 3, generator=g).sort(-1).values * 5
    stored = {**{k: C.to_numpy(v) for k, v in C.encode_hidden(spec, hidden).items()},
              "topk_logprobs": C.to_numpy(C.encode_topk_logprobs(spec, logprobs)),
              "input_ids": rng.integers(0, 50, len(hidden)).astype(np.int32),
              "loss_mask": rng.random(len(hidden)) < 0.5,
              "topk_ids": rng.integers(0, 50, (len(hidden), 3)).astype(np.int32)}
    off = plan.offsets

    def write(writer, batches):
        for b in batches:
            writer.write_batch(b, **{k: v[off[b]:off[b + 1]] for k, v in stored.items()})

    paths = {name: str(tmp_path / f"{name}.zarr") for name in ("unbroken", "resumed")}
    for name, path in paths.items():
        root = C.create_or_open_cache(path, spec)
        w = C.ShardWriter(root, 0, plan, spec)
        if name == "resumed":
            write(w, range(3))
            w.commit()
            assert w.committed["tokens"] % 16  # the commit left a partial chunk
            write(w, [3])  # then the process dies
            w = C.ShardWriter(C.create_or_open_cache(path, spec), 0, plan, spec)
            assert w.next_batch == 3
        write(w, range(w.next_batch, 6))
        w.finish()
    a, b = (zarr.open_group(p, mode="r")["shards/00000"] for p in paths.values())
    for f in spec.token_fields:
        assert np.array_equal(a[f][:], b[f][:]), f
    reader = C.CacheReader(paths["resumed"])
    want = C.decode_hidden(spec, C.encode_hidden(spec, hidden))
    for i in range(6):
        s = reader.read(i)
        assert torch.equal(s["hidden"], want[off[i]:off[i + 1]])
        assert torch.equal(s["topk_logprobs"], logprobs[off[i]:off[i + 1]].half().float())


def test_codec_settings_are_refused_where_the_config_is_validated():
    """An int4 group size the codec cannot pack is refused by ``ExtractConfig.validate``, naming the flags."""
    with pytest.raises(ValueError, match=r"--hidden-codec int4, --hidden-group-size 3: .*even for int4"):
        ExtractConfig(data="d", model="m", out="o", hidden_codec="int4", hidden_group_size=3).validate()
    ExtractConfig(data="d", model="m", out="o", hidden_codec="int4", hidden_group_size=4).validate()
