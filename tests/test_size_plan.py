"""``dflash-extract --plan`` and the free-space check: the plan's counts against what a real
extraction of the same data records, its estimates against their references, and a run that
refuses to start (or resumes) by the space it still needs."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import namedtuple

import pytest
import torch
from click.testing import CliRunner

from dflash.extract import plan as E
from dflash.extract import runner as R
from dflash.extract.cli import main as extract_main
from dflash.extract.data import load_source
from dflash.extract.plan import plan_shard, shard_rows
from dflash.extract.chat import load_tokenizer
from dflash.shared import cache as C
from dflash.shared.cache_cli import main as cache_main
from test_extract import (BAD_ROWS, COMMON, LAYERS, TOPK, cli, dataset,  # noqa: F401 - dataset: the fixture
                          run_shard, shard_task)

MAX_LENGTH = 64  # short enough that right truncation cuts some of the sample chats
RUN = [*COMMON, "--max-length", str(MAX_LENGTH), "--on-bad-row", "skip"]  # the later --max-length wins

DiskUsage = namedtuple("DiskUsage", "total used free")


@pytest.fixture(scope="module")
def planned_then_extracted(tmp_path_factory, dataset, tiny_target_dir):
    """``--plan --json``, then the real run of the same command: (plan, out, run's stdout)."""
    out = tmp_path_factory.mktemp("cache") / "c.zarr"
    args = ["--data", dataset[0], "--model", tiny_target_dir, "--out", out, *RUN]
    plan = json.loads(cli(*args, "--plan", "--json", world=1).stdout)
    assert not out.exists(), "--plan wrote to --out"
    proc = cli(*args)
    return plan, out, proc.stdout


def test_plan_counts_are_the_runs(planned_then_extracted, dataset, tiny_target_dir):
    """Samples, skipped rows by reason, tokens, assistant tokens and padding of the plan equal what
    the extraction then records (``dflash-cache info`` and the shards' own arrays); its truncated
    samples are the stored rows whose full HF rendering is longer than --max-length."""
    from transformers import AutoTokenizer

    plan, out, _ = planned_then_extracted
    info = json.loads(CliRunner().invoke(cache_main, ["info", str(out), "--json"]).output)
    assert info["complete"]
    for key in ("samples", "skipped", "tokens", "assistant_tokens"):
        assert plan[key] == info[key], key
    assert plan["skipped"] == {r: 1 for _, r in BAD_ROWS.values()}  # every bad row, by its reason
    assert plan["rows"] == len(dataset[1]) == info["samples"] + sum(info["skipped"].values())

    reader = C.CacheReader(str(out))
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    full = {int(i): len(tokenizer.apply_chat_template(dataset[1][i]["messages"], tokenize=True, return_dict=True)
                        ["input_ids"]) for i in reader.source_indices()}
    assert plan["truncated"] == sum(n > MAX_LENGTH for n in full.values()) > 0
    assert plan["longest"] == int(reader.lengths().max()) == MAX_LENGTH

    padded = 0
    for s in range(2):
        g = C.open_root(str(out))[C.shard_name(s)]
        offsets, batches = g["offsets"][:], g["batches"][:]
        lengths = offsets[1:] - offsets[:-1]
        padded += sum(int(b1 - b0) * int(lengths[b0:b1].max()) for b0, b1 in zip(batches[:-1], batches[1:]))
    assert plan["padded_tokens"] == padded

    # the raw bf16 bytes the estimate starts from are the ones the cache counts
    assert plan["bytes"]["raw_bf16_hidden"] == info["raw_bytes"]["hidden"]
    assert plan["layers"] == LAYERS and plan["topk"] == TOPK and plan["bytes"]["estimate"] and plan["time"]["estimate"]


def test_the_plan_reads_no_weights_and_says_what_it_estimates(planned_then_extracted, dataset, tiny_target_dir,
                                                               tmp_path, monkeypatch):
    """A target whose weights file is garbage, or missing, still plans, to the same counts; the
    report calls its bytes and GPU time estimates, and names the lack of free space."""
    plan, _, _ = planned_then_extracted
    for weights in ("corrupt", "absent"):
        target = tmp_path / weights
        shutil.copytree(tiny_target_dir, target)
        if weights == "corrupt":
            (target / "model.safetensors").write_bytes(b"not a safetensors file")
        else:
            (target / "model.safetensors").unlink()
        args = ["--data", str(dataset[0]), "--model", str(target), "--out", str(tmp_path / "c.zarr"),
                "--plan", *map(str, RUN)]
        result = CliRunner().invoke(extract_main, [*args, "--json"])
        assert result.exit_code == 0, result.output
        again = json.loads(result.output)
        for key in ("rows", "samples", "skipped", "truncated", "tokens", "assistant_tokens", "padded_tokens"):
            assert again[key] == plan[key], (weights, key)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**6, 10**6 - 1000, 1000))
    report = CliRunner().invoke(extract_main, args).output
    assert f"samples          {plan['samples']:,} stored" in report
    assert f"{plan['truncated']:,} truncated to --max-length {MAX_LENGTH}" in report
    assert "on disk          about" in report and "An estimate" in report and "GPU-hours" in report
    assert "free space       1000 B" in report and "NOT enough" in report
    assert not (tmp_path / "c.zarr").exists()


def test_a_bad_row_stops_the_plan_as_it_stops_the_run(dataset, tiny_target_dir, tmp_path):
    args = ["--data", str(dataset[0]), "--model", str(tiny_target_dir), "--out", str(tmp_path / "c.zarr"), "--plan",
            *map(str, COMMON)]
    result = CliRunner().invoke(extract_main, args)
    assert result.exit_code == 1
    assert f"{dataset[0]} row 3: unknown role 'robot'" in result.output and "--on-bad-row skip" in result.output


def test_bytes_per_token_from_the_codec_and_the_measured_ratios():
    """At Qwen3-8B shape the estimate gives back each codec's measured cache (bytes/token of all
    arrays, BENCHMARKS_LOG.md); the encoded bytes are what the codec's encoder produces (payload +
    scales), at any group size."""
    from dflash.shared import hidden_codecs as H

    measured = {"bf16": 28_350, "fp8": 16_970, "int8": 19_739, "int4": 9_098}
    for mode, per_token in measured.items():
        estimate = E.size_estimate(5, 4096, 64, H.HiddenCodec(mode))
        assert estimate["per_token"] == pytest.approx(per_token, abs=1.5), mode
        assert estimate["hidden_raw_bf16_per_token"] == 40_960
    hidden = torch.randn(8, 3, 256, dtype=torch.bfloat16)
    for codec in (H.HiddenCodec("fp8"), H.HiddenCodec("int8", 128), H.HiddenCodec("int4", 32),
                  H.HiddenCodec("int8", 64, "float32")):
        estimate = E.size_estimate(3, 256, 16, codec)
        assert estimate["hidden_encoded_per_token"] * 8 == H.encode(codec, hidden).nbytes(), codec
        assert estimate["per_token"] < E.size_estimate(3, 256, 16)["per_token"]
    assert E.size_estimate(3, 256, 16, topk_dtype="float16")["other_raw_per_token"] == 4 + 1 + 16 * 6


def test_forward_flops_per_token_match_torchs_flop_counter(tiny_target_dir):
    """The linear layers' 2 x weights per token and the attention's quadratic term, against
    torch's own FLOP counter over a real forward of the target (eager attention counts the full
    square; causal attention is half of it)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, attn_implementation="eager").eval()
    config = AutoConfig.from_pretrained(tiny_target_dir)

    def counted(n: int) -> int:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, n, dtype=torch.long))
        return counter.get_total_flops()

    s1, s2 = 16, 48
    f1, f2 = counted(s1), counted(s2)
    square = (f2 / s2 - f1 / s1) / (s2 - s1)  # F(S) = linear * S + square * S^2
    linear = f1 / s1 - square * s1
    assert 2 * E.matmul_parameters(config) == pytest.approx(linear, rel=1e-9)
    assert E.attention_flops_per_token(config, s2) == pytest.approx(square * s2 / 2, rel=1e-9)
    reference = E.REFERENCE
    from transformers import Qwen3Config

    same = E.time_estimate(Qwen3Config(**E.REFERENCE_CONFIG), reference["sample_tokens"], 10**6, gpus=4)
    assert same["tokens_per_s_per_gpu"] == pytest.approx(reference["tokens_per_s"])
    assert same["wall_hours"] == pytest.approx(10**6 / reference["tokens_per_s"] / 3600 / 4)


def test_a_run_refuses_to_start_below_the_space_it_still_needs(tmp_path, dataset, tiny_target_dir, monkeypatch,
                                                                caplog):
    """With shard 0 complete, a rerun needs the estimate for shard 1 only: one byte less free and
    it stops before shard 1 exists, naming both numbers; --ignore-free-space starts anyway. A
    fresh run of the same data would need more; a URL is not checked."""
    out = tmp_path / "c.zarr"
    task = shard_task(out, dataset, tiny_target_dir, 0, max_length=MAX_LENGTH)
    threads = torch.get_num_threads()
    try:
        run_shard(task)
    finally:
        torch.set_num_threads(threads)
    cfg = task.cfg
    planned = {}
    ds = load_source(cfg.data)
    for s in (0, 1):
        start, stop = shard_rows(len(ds), 2, s)
        p = plan_shard(ds[start:stop], start, cfg.data, load_tokenizer(cfg), cfg).plan
        planned[s] = {"tokens": p.num_tokens, "samples": len(p.source_index)}
    spec = C.CacheSpec.from_dict(C.open_root(str(out)).attrs[C.ATTRS_KEY])
    size = E.size_estimate(len(LAYERS), spec.hidden_size, TOPK)
    rest = E.total_bytes(size, planned[1]["tokens"], planned[1]["samples"])
    fresh = E.total_bytes(size, planned[0]["tokens"] + planned[1]["tokens"],
                          planned[0]["samples"] + planned[1]["samples"])
    assert fresh > rest

    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12 - rest + 1, rest - 1))
    with pytest.raises(R.ExtractFailed) as failed:
        R.run(cfg)
    message = str(failed.value)
    assert f"({rest - 1:,} B) free" in message and f"({rest:,} B, an estimate" in message
    assert "the rest of this run" in message and "--ignore-free-space" in message
    assert C.shard_name(1) not in C.open_root(str(out))

    committed = {0: C.read_shard_states(C.open_root(str(out)), [0])[0].commit}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12 - rest, rest))
    assert E.run_space_problem(cfg, spec, planned, committed) is None  # exactly enough for the rest
    assert "needs about" in E.run_space_problem(cfg, spec, planned, {})  # not for a fresh run
    with caplog.at_level("INFO"):
        url = dataclasses.replace(cfg, out="file://" + str(out))
        assert E.run_space_problem(url, spec, planned, {}) is None
    assert "free space not checked" in caplog.text

    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12, 0))
    summary = R.run(dataclasses.replace(cfg, ignore_free_space=True))
    assert summary["complete"] and summary["samples"] == planned[0]["samples"] + planned[1]["samples"]


def test_the_plan_estimates_the_chosen_codec_and_refuses_one_that_cannot_work(dataset, tiny_target_dir, tmp_path):
    """--hidden-codec int4 is planned at its own encoded bytes (a quarter of bf16's, plus scales);
    a group size that does not divide the hidden size stops the plan naming the flags."""
    from transformers import AutoConfig

    from dflash.shared.hidden_codecs import HiddenCodec

    hidden_size = AutoConfig.from_pretrained(tiny_target_dir).hidden_size
    args = ["--data", str(dataset[0]), "--model", str(tiny_target_dir), "--out", str(tmp_path / "c.zarr"), "--plan",
            "--json", *map(str, RUN)]
    result = CliRunner().invoke(extract_main, [*args, "--hidden-codec", "int4", "--hidden-group-size", "16"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["bytes"]["hidden_codec"] == "int4"
    encoded = HiddenCodec("int4", 16).bytes_per_token(len(LAYERS), hidden_size)
    assert plan["bytes"]["hidden_encoded_per_token"] == encoded
    lossless = json.loads(CliRunner().invoke(extract_main, args).output)
    assert plan["bytes"]["expected"] < lossless["bytes"]["expected"]
    result = CliRunner().invoke(extract_main, [*args, "--hidden-codec", "int8", "--hidden-group-size", "48"])
    assert result.exit_code == 1 and "--hidden-group-size 48" in result.output and "not a multiple" in result.output
    result = CliRunner().invoke(extract_main, [a for a in args if a != "--plan"])
    assert result.exit_code == 2 and "--json goes with --plan" in result.output


def test_is_local_and_size_text():
    """The one URL test and the one byte formatter every command uses."""
    from dflash.shared.compression import is_local, size_text

    assert is_local("/data/cache") and is_local("rel/cache") and not is_local("s3://b/c") and not is_local("file:///c")
    assert [size_text(n) for n in (None, 0, 1023, 1536, 5 * 2**30)] == ["unknown", "0 B", "1023 B", "1.5 KiB", "5.0 GiB"]
