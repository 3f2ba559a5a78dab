"""``dflash-cache convert`` on a real extraction of the tiny Qwen3 target: the converted cache
against the source read back field by field, its plan, checksums, resume after ``kill -9``
(against an unbroken conversion, file by file), refusals; ``stats`` against a float64
recomputation; ``info``."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

from dflash.extract import runner as R
from dflash.extract.config import ExtractConfig
from dflash.extract.data import load_source
from dflash.extract.chat import load_tokenizer
from dflash.shared import cache as C
from dflash.shared.cache_cli import main
from dflash.shared.convert import fingerprint_digest

LAYERS = [0, 1, 2]
EXTRACT = dict(device="cpu", shards=2, cpu_threads=1, dtype="float32", layers=LAYERS, topk=16, max_length=96,
               batch_tokens=400, chunk_tokens=32, commit_seconds=0, progress=False)
"""A small two-shard extraction; its hidden chunks (32 tokens) are crossed by samples and batches."""
META_FIELDS = ("offsets", "source_index", "batches")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def cli_process(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dflash.shared.cache_cli", *map(str, args)], capture_output=True,
                          text=True, **kw)


def extraction_spec(cfg: ExtractConfig) -> C.CacheSpec:
    """The spec an extraction run with ``cfg`` writes (the runner's own)."""
    from transformers import AutoConfig

    return R.build_spec(cfg, load_tokenizer(cfg), AutoConfig.from_pretrained(cfg.model), load_source(cfg.data),
                        num_shards=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory, chats_sample_path, tiny_target_dir):
    """A format-1 cache (every array chunked at 32 tokens) of two shards, extracted as a run
    does (the runner's set-up, each shard, here in this process): its root is created in format 1,
    and the runner hands the shards that layout to write in."""
    out = tmp_path_factory.mktemp("source") / "src.zarr"
    cfg = ExtractConfig(data=str(chats_sample_path), model=str(tiny_target_dir), out=str(out), **EXTRACT)
    C.create_or_open_cache(str(out), dataclasses.replace(extraction_spec(cfg), format_version=1, chunks={}))
    spec = C.CacheSpec.from_dict(R.prepare_root(cfg, extraction_spec(cfg)).attrs[C.ATTRS_KEY])
    assert spec.format_version == 1 and spec.fingerprint == extraction_spec(cfg).fingerprint
    threads = torch.get_num_threads()
    try:
        R.run(cfg)  # both shards in turn
    finally:
        torch.set_num_threads(threads)
    reader = C.CacheReader(str(out))
    assert reader.complete and reader.spec.format_version == 1 and len(reader.shards) == 2
    return out


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """``source`` converted losslessly to the current format at zstd level 3, in one run."""
    out = tmp_path_factory.mktemp("converted") / "dst.zarr"
    result = cli("convert", source, out, "--compression-level", "3", "--no-progress", "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


LOSSY = {  # name -> convert flags
    "fp8": ["--hidden-codec", "fp8"],
    "int8": ["--hidden-codec", "int8", "--hidden-group-size", "16", "--topk-dtype", "float16"],
    "int4": ["--hidden-codec", "int4", "--hidden-group-size", "32", "--topk-dtype", "bfloat16"],
}


@pytest.fixture(scope="module")
def lossy(source, tmp_path_factory):
    """``source`` converted with each lossy setting of ``LOSSY``."""
    out = {}
    for name, flags in LOSSY.items():
        out[name] = tmp_path_factory.mktemp(name) / "dst.zarr"
        result = cli("convert", source, out[name], *flags, "--no-progress")
        assert result.exit_code == 0, result.output
    return out


def shard_arrays(path, shard):
    g = C.open_root(str(path))[C.shard_name(shard)]
    spec = C.CacheSpec.from_dict(C.open_root(str(path)).attrs[C.ATTRS_KEY])
    return {f: np.asarray(g[f][:]) for f in spec.token_fields + META_FIELDS}, g.attrs.asdict()


def store_contents(path: Path) -> dict[str, object]:
    """Every file of a store but the lock files: metadata parsed (key order is not content), each
    chunk as the values it decodes to. (A chunk rewritten at a resume goes through zarr's own codec
    pipeline, whose blosc encodes the same values into other bytes than the zarrs pipeline's.)"""
    out = {}
    root = zarr.open_group(str(path), mode="r")
    for f in sorted(path.rglob("*")):
        rel = str(f.relative_to(path))
        if not f.is_file() or rel.startswith(C.LOCKS_GROUP):
            continue
        if f.name == "zarr.json":
            out[rel] = json.loads(f.read_text())
        else:  # shards/NNNNN/ARRAY/c/i/...: the chunk's rows
            shard, array, _, first = rel.split("/")[1:5]
            a = root[f"shards/{shard}/{array}"]
            rows = a.chunks[0]
            out[rel] = np.asarray(a[int(first) * rows:(int(first) + 1) * rows]).tobytes()
    return out


# ----------------------------------------------------------------------------- lossless


def test_lossless_conversion_reads_back_bitwise_with_the_sources_plan(source, converted):
    out, summary = converted
    src, dst = C.CacheReader(str(source)), C.CacheReader(str(out))
    assert dst.complete and summary["tokens_converted"] == src.num_tokens == dst.num_tokens
    assert dst.spec.format_version == C.FORMAT_VERSION and dst.spec.compression_level == 3
    assert dst.spec.chunks == C.default_chunks(dst.spec) and dst.spec.chunk_tokens == src.spec.chunk_tokens == 32
    for shard in (0, 1):  # every stored array, the plan's included, equal; the shard's record equal
        a, a_attrs = shard_arrays(source, shard)
        b, b_attrs = shard_arrays(out, shard)
        for f in a:
            assert a[f].dtype == b[f].dtype and np.array_equal(a[f], b[f]), (shard, f)
        assert a_attrs == b_attrs
        group = C.open_root(str(out))[C.shard_name(shard)]
        assert {f: group[f].chunks[0] for f in C.TOKEN_FIELDS} == {
            f: min(dst.spec.chunks[f], group[f].shape[0]) for f in C.TOKEN_FIELDS}
        assert group["hidden"].compressors[0].clevel == 2  # zstd level 3 is blosc clevel 2
    bits = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # noqa: E731
    for i in range(len(src)):  # and read back through the reader, as training reads it
        x, y = src.read(i), dst.read(i)
        assert x.keys() == y.keys() and x["source_index"] == y["source_index"]
        for f in C.TOKEN_FIELDS:
            assert x[f].dtype == y[f].dtype and torch.equal(bits(x[f]), bits(y[f])), (i, f)


def test_the_fingerprint_is_the_sources_with_the_new_settings(source, converted):
    out, _ = converted
    src, dst = C.CacheReader(str(source)).spec, C.CacheReader(str(out)).spec
    expected = json.loads(json.dumps(src.fingerprint))
    expected["extraction"]["compression_level"] = 3
    assert dst.fingerprint == expected
    record = dst.info["converted_from"]
    assert record["path"] == str(source.resolve()) and record["fingerprint_digest"] == fingerprint_digest(src.fingerprint)
    assert record["format_version"] == 1 and record["compression_level"] == 1 and record["previous"] is None
    assert dst.info["target_path"] == src.info["target_path"]  # training's default --target still found


def test_info_says_where_a_converted_cache_came_from(source, converted, tmp_path):
    out, _ = converted
    text = cli("info", out).output
    digest = fingerprint_digest(C.CacheReader(str(source)).spec.fingerprint).split(":")[1]
    line = next(l for l in text.splitlines() if l.startswith("converted"))
    assert str(source.resolve()) in line and digest[:12] in line and "format v1" in line and "zstd level 1" in line
    assert "converted" not in cli("info", source).output
    # converted again: both steps shown, newest first
    again = tmp_path / "again.zarr"
    assert cli("convert", out, again, "--compression-level", "5", "--chunk-tokens", "64", "--no-progress").exit_code == 0
    lines = [l for l in cli("info", again).output.splitlines() if "from " in l and "fingerprint" in l]
    assert len(lines) == 2 and str(out) in lines[0] and "zstd level 3" in lines[0] and str(source.resolve()) in lines[1]
    assert C.CacheReader(str(again)).spec.chunks["hidden"] == 64


def test_converted_cache_verifies_and_a_flipped_byte_is_found(converted, tmp_path):
    out, _ = converted
    ok = cli("verify", out, "--no-progress", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["ok"]
    broken = tmp_path / "broken.zarr"
    shutil.copytree(out, broken)
    chunk = broken / "shards" / "00001" / "hidden" / "c" / "1" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    bad = cli("verify", broken, "--no-progress", "--json")
    report = json.loads(bad.stdout)
    assert bad.exit_code == 1 and not report["ok"]
    assert any(p["shard"] == 1 and p["array"] == "hidden" and "chunk 1" in p["message"] for p in report["problems"])


def test_stats_of_a_lossless_conversion_shows_zero_error(converted):
    out, _ = converted
    d = json.loads(cli("stats", out, "--json").stdout)["conversion_error"]
    assert d["source_matches_record"] and d["tokens"] == C.CacheReader(str(out)).num_tokens
    assert [lay["rel_l2"] for lay in d["layers"]] == [0.0] * len(LAYERS)
    assert d["topk_logprobs"]["rel_l2"] == 0.0
    text = cli("stats", out).output
    assert "error against" in text and "0.000e+00" in text


# ----------------------------------------------------------------------------- resume


def wait_for_commit(out: Path, batches: int, timeout: float = 60.0) -> None:
    """Until shard 0 of ``out`` has committed ``batches`` batches."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if zarr.open_group(str(out), mode="r")[C.shard_name(0)].attrs["commit"]["batches"] >= batches:
                return
        except Exception:  # noqa: BLE001 - not created yet
            pass
        time.sleep(0.05)
    raise AssertionError(f"no commit of {batches} batches became visible within {timeout} s")


def test_ctrl_c_then_kill9_then_rerun_equals_the_unbroken_conversion(source, lossy, tmp_path):
    """Stopped with Ctrl-C (it commits and says so), resumed, killed with -9 mid-run, rerun:
    every array and attribute equal to the unbroken int4 conversion's."""
    reference = lossy["int4"]
    out = tmp_path / "killed.zarr"
    args = ["convert", source, out, *LOSSY["int4"], "--no-progress", "--commit-seconds", "60"]
    slow = [sys.executable, os.path.join(os.path.dirname(__file__), "slow_convert.py"), "0.3", *map(str, args)]
    interrupted = subprocess.Popen(slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_commit(out, 0)  # shard 0 exists: its first read is under way (and no commit for 60 s)
        interrupted.send_signal(signal.SIGINT)
        _, err = interrupted.communicate(timeout=60)
    finally:
        interrupted.kill()
    assert interrupted.returncode == 130 and "interrupted: shard 00000 committed" in err, err
    assert C.read_shard_state(C.open_root(str(out))[C.shard_name(0)]).commit.batches >= 1  # what it had read
    proc = subprocess.Popen([*slow, "--commit-seconds", "0"], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        resumed_at = C.read_shard_state(C.open_root(str(out))[C.shard_name(0)]).commit.batches
        wait_for_commit(out, resumed_at + 1)
        # while it runs, a second conversion into the same destination is refused naming it
        second = cli("convert", source, out, *LOSSY["int4"], "--no-progress")
        assert second.exit_code == 2 and "being written by another run: " in second.output
        assert f"pid {proc.pid}" in second.output
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = C.read_shard_state(C.open_root(str(out))[C.shard_name(0)])
    assert not state.complete and state.commit.batches < state.planned.batches, "finished before the kill"
    assert state.commit.batches > resumed_at  # the second run resumed and went on
    stopped = json.loads(cli("stats", out, "--json").stdout)["conversion_error"]
    assert "not complete" in stopped["unavailable"]
    rerun = cli_process(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed at batch" in rerun.stderr
    assert store_contents(out) == store_contents(reference)


def test_a_complete_conversion_rerun_converts_nothing(source, converted):
    out, _ = converted
    before = store_contents(out)
    d = json.loads(cli("convert", source, out, "--compression-level", "3", "--no-progress", "--json").stdout)
    assert d["tokens_converted"] == 0 and d["tokens_found_done"] == d["tokens"]
    assert store_contents(out) == before


# ----------------------------------------------------------------------------- refusals


def test_a_destination_holding_another_cache_is_refused(source, converted):
    out, _ = converted
    before = store_contents(out)
    result = cli("convert", source, out, "--compression-level", "5", "--no-progress")
    assert result.exit_code == 2 and "holds another cache" in result.output and "compression_level" in result.output
    assert cli("convert", source, source, "--no-progress").exit_code == 2
    assert store_contents(out) == before


def test_an_unfinished_source_is_refused_naming_the_shard(source, tmp_path):
    partial = tmp_path / "partial.zarr"
    shutil.copytree(source, partial)
    group = zarr.open_group(str(partial / "shards" / "00001"), mode="r+")
    state = C.read_shard_state(group)
    offsets = np.asarray(group["offsets"][:])
    samples = int(group["batches"][1])
    group.attrs.update({"complete": False, "commit": {"batches": 1, "samples": samples,
                                                      "tokens": int(offsets[samples])}})
    result = cli("convert", partial, tmp_path / "dst.zarr", "--no-progress")
    assert result.exit_code == 2, result.output
    assert "shard 00001 is partial" in result.output and f"{samples:,} of {state.planned.samples:,}" in result.output
    assert not (tmp_path / "dst.zarr").exists()


def test_bad_settings_are_usage_errors(source, tmp_path):
    result = cli("convert", source, tmp_path / "x.zarr", "--compression-level", "4")
    assert result.exit_code == 2 and "zstd levels 1, 3" in result.output
    for flag, value in (("--chunk-tokens", "0"), ("--hidden-group-size", "0"), ("--commit-seconds", "-1")):
        result = cli("convert", source, tmp_path / "x.zarr", flag, value)
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output
    assert not (tmp_path / "x.zarr").exists()


# ----------------------------------------------------------------------------- stats


def bf16_to_float64(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float64, exactly (the bits are the high half of a float32's)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def relative_l2_per_layer(ours: Path, reference: Path) -> tuple[np.ndarray, float]:
    """The float64 relative L2 error of every stored hidden value, per layer, and of the top-k
    log-probs, of cache ``ours`` against ``reference``, from their zarr arrays directly."""
    num, den = np.zeros(len(LAYERS)), np.zeros(len(LAYERS))
    tk_num = tk_den = 0.0
    for shard in (0, 1):
        a, b = shard_arrays(ours, shard)[0], shard_arrays(reference, shard)[0]
        x, ref = bf16_to_float64(a["hidden"]), bf16_to_float64(b["hidden"])
        num += ((x - ref) ** 2).sum(axis=(0, 2))
        den += (ref ** 2).sum(axis=(0, 2))
        p, q = a["topk_logprobs"].astype(np.float64), b["topk_logprobs"].astype(np.float64)
        tk_num += ((p - q) ** 2).sum()
        tk_den += (q ** 2).sum()
    return np.sqrt(num / den), float(np.sqrt(tk_num / tk_den))


def test_stats_against_another_cache_matches_a_float64_recomputation(source, tmp_path):
    """A copy of the source with every layer's hidden states and the log-probs perturbed by
    known amounts: ``stats COPY --against SOURCE`` gives their relative L2 error per layer."""
    noisy = tmp_path / "noisy.zarr"
    shutil.copytree(source, noisy)
    rng = np.random.default_rng(0)
    for shard in (0, 1):
        group = zarr.open_group(str(noisy / "shards" / f"{shard:05d}"), mode="r+")
        x = torch.from_numpy(bf16_to_float64(np.asarray(group["hidden"][:])))
        scale = torch.tensor([1e-3, 1e-2, 1e-1], dtype=torch.float64).view(1, -1, 1)
        x = x * (1 + scale * torch.from_numpy(rng.standard_normal(tuple(x.shape))))
        group["hidden"][:] = C.bf16_to_bits(x.to(torch.bfloat16))
        lp = np.asarray(group["topk_logprobs"][:])
        group["topk_logprobs"][:] = (lp * (1 + 1e-3 * rng.standard_normal(lp.shape))).astype(np.float32)
    n = len(C.CacheReader(str(source)))
    d = json.loads(cli("stats", noisy, "--against", source, "--max-samples", n, "--json").stdout)["conversion_error"]
    hidden, topk = relative_l2_per_layer(noisy, source)
    assert d["samples"] == n and d["against"] == str(source) and d["source_matches_record"] is None
    np.testing.assert_allclose([lay["rel_l2"] for lay in d["layers"]], hidden, rtol=1e-9)
    np.testing.assert_allclose(d["topk_logprobs"]["rel_l2"], topk, rtol=1e-9)
    assert 5e-4 < hidden[0] < 2e-3 and 5e-2 < hidden[2] < 2e-1  # the planted scales, roughly
    # a sample of the draw: the error over those samples only, still against the same reference
    sub = json.loads(cli("stats", noisy, "--against", source, "--max-samples", 5, "--json").stdout)
    assert sub["conversion_error"]["samples"] == 5 and sub["conversion_error"]["tokens"] == sub["sampled"]["tokens"]
    # no source recorded and none given: no error section; a cache of other samples is refused
    assert json.loads(cli("stats", source, "--json").stdout)["conversion_error"] is None
    other = tmp_path / "other.zarr"
    shutil.copytree(source, other)
    shutil.rmtree(other / "shards" / "00001")
    refused = cli("stats", other, "--against", source)
    assert refused.exit_code == 2 and "does not hold the samples" in refused.output


def test_stats_of_a_converted_cache_whose_source_moved_says_so(converted, tmp_path):
    out, _ = converted
    moved = tmp_path / "moved.zarr"
    shutil.copytree(out, moved)
    root = zarr.open_group(str(moved), mode="r+")
    spec = root.attrs[C.ATTRS_KEY]
    spec["info"]["converted_from"]["path"] = str(tmp_path / "gone.zarr")
    root.attrs[C.ATTRS_KEY] = spec
    text = cli("stats", moved).output
    assert "gone.zarr" in text and "--against" in text


# ----------------------------------------------------------------------------- lossy


def decode_independently(spec: C.CacheSpec, stored: dict[str, np.ndarray]) -> np.ndarray:
    """(T, L, D) float64 hidden states from a lossy cache's stored payload and scales, written
    out here from the format's definition (not the cache's decoder), rounded to bf16 as the
    reader hands them to training."""
    payload, scales = stored["hidden"], stored["hidden_scale"].astype(np.float64)
    T, L, _ = payload.shape
    if spec.hidden_codec == "fp8":
        values = torch.from_numpy(payload).view(torch.float8_e4m3fn).double().numpy() * scales
    else:
        if spec.hidden_codec == "int8":
            q = payload.view(np.int8).astype(np.float64)
        else:  # two channels a byte, low nibble first, each stored as q + 8
            q = np.stack([payload & 0x0F, payload >> 4], axis=-1).reshape(T, L, -1).astype(np.float64) - 8
        values = (q.reshape(T, L, -1, spec.hidden_group_size) * scales[..., None]).reshape(T, L, -1)
    return torch.from_numpy(values).to(torch.bfloat16).double().numpy()


def logprobs_independently(spec: C.CacheSpec, stored: np.ndarray) -> np.ndarray:
    if spec.topk_dtype == "bfloat16":
        return bf16_to_float64(stored)
    return stored.astype(np.float64)


@pytest.mark.parametrize("name", list(LOSSY))
def test_a_lossy_conversion_keeps_the_plan_and_stats_measures_its_error(source, lossy, name, chats_sample_path,
                                                                         tiny_target_dir):
    out = lossy[name]
    src, dst = C.CacheReader(str(source)), C.CacheReader(str(out))
    spec = dst.spec
    assert spec.hidden_codec == name and spec.format_version == 3 and dst.complete
    assert spec.fingerprint["extraction"]["encoding"] == spec.encoding() and "decoded_from" not in spec.fingerprint
    # the fingerprint an extraction with these settings records: training takes either for the other
    settings = {flag[2:].replace("-", "_"): int(v) if v.isdigit() else v
                for flag, v in zip(LOSSY[name][::2], LOSSY[name][1::2])}
    cfg = ExtractConfig(data=str(chats_sample_path), model=str(tiny_target_dir), out=str(out), **EXTRACT, **settings)
    assert spec.fingerprint == extraction_spec(cfg).fingerprint
    num, den = np.zeros(len(LAYERS)), np.zeros(len(LAYERS))
    tk_num = tk_den = 0.0
    for shard in (0, 1):
        a, a_attrs = shard_arrays(source, shard)
        b, b_attrs = shard_arrays(out, shard)
        assert a_attrs == b_attrs
        for f in ("input_ids", "loss_mask", "topk_ids") + META_FIELDS:
            assert np.array_equal(a[f], b[f]), (shard, f)
        ref = bf16_to_float64(a["hidden"])
        x = decode_independently(spec, b)
        num += ((x - ref) ** 2).sum(axis=(0, 2))
        den += (ref ** 2).sum(axis=(0, 2))
        assert np.abs(x - ref).max() <= np.abs(ref).max() * (2 ** -3 if name == "fp8" else 1 / (7 if name == "int4" else 127))
        p, q = logprobs_independently(spec, b["topk_logprobs"]), a["topk_logprobs"].astype(np.float64)
        tk_num += ((p - q) ** 2).sum()
        tk_den += (q ** 2).sum()
    d = json.loads(cli("stats", out, "--max-samples", len(src), "--json").stdout)["conversion_error"]
    assert d["against"] == str(source.resolve()) and d["source_matches_record"] and d["tokens"] == src.num_tokens
    rel = [lay["rel_l2"] for lay in d["layers"]]
    np.testing.assert_allclose(rel, np.sqrt(num / den), rtol=1e-9)
    assert all(0 < r < (0.2 if name == "int4" else 0.05) for r in rel)
    np.testing.assert_allclose(d["topk_logprobs"]["rel_l2"], np.sqrt(tk_num / tk_den), rtol=1e-9, atol=0)
    assert d["topk_reduced"] == (name != "fp8") and (d["topk_logprobs"]["rel_l2"] > 0) == (name != "fp8")
    text = cli("stats", out, "--max-samples", len(src)).output
    assert f"{rel[0]:.3e}" in text and ("top-k log-probs: rel L2" in text) == (name != "fp8")
    info = cli("info", out).output
    assert f"codec      hidden {spec.codec.describe()}" in info and "hidden bf16 (lossless)" in info


def test_a_lossy_conversion_verifies_and_a_flipped_scale_byte_is_found(lossy, tmp_path):
    ok = cli("verify", lossy["int8"], "--no-progress", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["ok"]
    broken = tmp_path / "broken.zarr"
    shutil.copytree(lossy["int8"], broken)
    chunk = broken / "shards" / "00000" / "hidden_scale" / "c" / "2" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    bad = cli("verify", broken, "--no-progress", "--json")
    problems = json.loads(bad.stdout)["problems"]
    assert bad.exit_code == 1 and any(p["shard"] == 0 and p["array"] == "hidden_scale" and "chunk 2" in p["message"]
                                      for p in problems)


def test_a_lossy_source_reencoded_is_named_in_the_fingerprint(lossy, source, tmp_path):
    """fp8 -> int8 and fp8 -> bf16 hold values that went through fp8: their fingerprints say so,
    so neither passes for a conversion of the lossless source; fp8 -> fp8 at another zstd level
    copies the payload as it is."""
    fp8 = lossy["fp8"]
    for flags, want_error in ((["--hidden-codec", "int8", "--hidden-group-size", "16"], True),
                              (["--hidden-codec", "bf16"], False), (["--compression-level", "5"], None)):
        out = tmp_path / "-".join(flags).replace("--", "")
        assert cli("convert", fp8, out, *flags, "--no-progress").exit_code == 0
        spec = C.CacheReader(str(out)).spec
        if want_error is None:
            assert "decoded_from" not in spec.fingerprint
            for shard in (0, 1):
                a, b = shard_arrays(fp8, shard)[0], shard_arrays(out, shard)[0]
                assert all(np.array_equal(a[f], b[f]) for f in a)
            continue
        assert spec.fingerprint["decoded_from"] == [C.CacheReader(str(fp8)).spec.encoding()]
        lossless = C.CacheReader(str(source)).spec.fingerprint
        assert spec.fingerprint != lossless
        d = json.loads(cli("stats", out, "--against", source, "--json").stdout)["conversion_error"]
        assert all(lay["rel_l2"] > 0 for lay in d["layers"])  # fp8's error stays, whatever the codec now
        assert d["source_matches_record"] is False  # measured against another cache than its own source


def test_another_codec_into_the_same_destination_is_refused(source, lossy):
    result = cli("convert", source, lossy["fp8"], "--hidden-codec", "int8", "--hidden-group-size", "16", "--no-progress")
    assert result.exit_code == 2 and "hidden_codec: cache has 'fp8', run has 'int8'" in result.output
    bad = cli("convert", source, lossy["fp8"].parent / "x.zarr", "--hidden-codec", "int8", "--hidden-group-size", "48")
    assert bad.exit_code == 2 and "not a multiple" in bad.output and "--hidden-group-size 48" in bad.output


def test_a_converted_lossy_cache_trains(lossy, tiny_target_dir, tmp_path):
    from dflash.train.cli import main as train_main

    run = tmp_path / "run"
    train_main(["run", "--preset", "tiny", "--cache", str(lossy["int4"]), "--out", str(run), "--max-steps", "3",
                "--mask-token-id", "3", "--max-anchors", "4", "--eval-samples", "2", "--num-workers", "0",
                "--log-every", "1"])
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [x for x in lines if x.get("kind") != "eval"]
    assert [x["step"] for x in train_rows][-1] == 3 and all(np.isfinite(x["loss"]) for x in train_rows)
    assert any(x.get("kind") == "eval" and np.isfinite(x["loss"]) for x in lines)
    assert json.loads((run / "config.json").read_text())["target"] == str(tiny_target_dir.resolve())


def test_a_nan_in_the_source_stops_a_lossy_conversion_naming_where(source, tmp_path):
    bad = tmp_path / "nan.zarr"
    shutil.copytree(source, bad)
    group = zarr.open_group(str(bad / "shards" / "00001"), mode="r+")
    bits = np.asarray(group["hidden"][:])
    bits[100, 1, 5] = 0x7FC0  # a bf16 NaN
    group["hidden"][:] = bits
    result = cli("convert", bad, tmp_path / "dst.zarr", "--hidden-codec", "fp8", "--no-progress")
    offsets, rows = np.asarray(group["offsets"][:]), np.asarray(group["source_index"][:])
    sample = int(np.searchsorted(offsets, 100, side="right") - 1)
    assert result.exit_code == 2, result.output
    assert (f"{bad} shard 00001: 1 token(s) hold NaN" in result.output and f"sample {sample} of the shard (source row "
            f"{rows[sample]}), token {100 - offsets[sample]}" in result.output)
