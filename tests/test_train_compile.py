"""The one compile path: warm-up then fail_on_recompile, flex refusals,
only the context buckets the cache needs, compiled graphs reused by the next process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_helpers as H
from dflash.train import attention, compile as C
from dflash.train.config import RuntimeConfig


def cuda(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@pytest.fixture(autouse=True)
def default_stance(tmp_path, monkeypatch):
    # training points torch's compile cache at a folder for the whole process: keep it in tmp, restored after
    monkeypatch.setenv(C.CACHE_DIR_ENV, str(tmp_path / "inductor"))
    yield
    C.thaw()
    attention.allow_uncompiled_flex(False)


def test_recompile_after_warm_up_is_an_error_naming_the_guard():
    def f(x):
        return (x * 2).sin().sum()

    fn = torch.compile(f, backend="eager", dynamic=False)
    x = torch.randn(8, requires_grad=True)
    before = C.compile_count()
    compiled = C.compile_then_freeze(lambda: fn(x).backward())[1]
    assert compiled == 1 and C.compile_count() == before + 1
    fn(torch.randn(8, requires_grad=True)).backward()  # same shape: no compile
    assert C.compile_count() == before + 1
    with pytest.raises(RuntimeError, match="(?s)recompile.*size mismatch"):
        fn(torch.randn(9, requires_grad=True))
    C.thaw()
    fn(torch.randn(9))  # allowed again once thawed


def test_compiled_drafter_with_flex_does_not_recompile_after_warm_up(monkeypatch):
    """The flex path inside a compiled drafter must not depend on process state that the
    first call changes (it once guarded on the lazily created compiled flex_attention)."""
    monkeypatch.setattr(attention, "_compiled_flex_attention", None)
    from dflash.train.model import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        max_position_embeddings=512, vocab_size=64, block_size=4, target_layer_ids=[0, 1],
                        num_target_layers=3, mask_token_id=63)
    model = DFlashDrafter(cfg).requires_grad_(False)  # flex has no CPU backward
    choice = C.resolve(RuntimeConfig(compile="on", compile_backend="eager"), torch.device("cpu"))
    cmodel = C.compile_model(model, choice, 4)
    S, anchors = 24, torch.tensor([[2, 3, 9]])
    valid, ctx_len = torch.ones_like(anchors, dtype=torch.bool), torch.tensor([20])
    positions = (anchors[:, :, None] + torch.arange(4)).view(1, -1)

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        mask = attention.build_mask("flex", anchors, valid, ctx_len, S, 4)
        return cmodel(torch.randn(1, S, 64, generator=g), torch.arange(S), torch.randn(1, 12, 32, generator=g),
                      positions, mask)

    C.compile_then_freeze(lambda: call(0))
    out = call(1)  # a recompile raises here
    dense = attention.build_mask("dense", anchors, valid, ctx_len, S, 4)
    g = torch.Generator().manual_seed(1)
    ref = model(torch.randn(1, S, 64, generator=g), torch.arange(S), torch.randn(1, 12, 32, generator=g), positions,
                dense)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_resolve_on_cpu():
    cpu = torch.device("cpu")
    choice = C.resolve(RuntimeConfig(), cpu)
    assert (choice.attention, choice.compile_model) == ("dense", False)
    with pytest.raises(ValueError, match="no CPU backward"):
        C.resolve(RuntimeConfig(attention="flex"), cpu)
    eager = C.resolve(RuntimeConfig(attention="flex-eager"), cpu)
    assert eager.attention == "flex" and eager.eager_flex and attention._allow_uncompiled_flex


def test_uncompiled_flex_refused_on_cuda_unless_named(monkeypatch):
    gpu = torch.device("cuda", 0)  # resolve() only inspects the device; no CUDA needed
    auto = C.resolve(RuntimeConfig(), gpu)
    assert (auto.attention, auto.compile_model, auto.eager_flex) == ("flex", True, False)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    for requested in ("flex", "auto"):
        with pytest.raises(RuntimeError, match="flex-eager"):
            C.resolve(RuntimeConfig(attention=requested), gpu)
    assert C.resolve(RuntimeConfig(attention="flex-eager"), gpu).eager_flex


def held_out_buckets(cache, cfg) -> set[int]:
    """The context buckets the held-out samples fall into, from the cache's lengths."""
    from dflash.shared.cache import CacheReader
    from dflash.train.data import Split, bucket_for

    reader = CacheReader(str(cache))
    held_out = Split.of(len(reader), cfg.data.eval_samples, reader.source_indices()).held_out
    lengths = reader.lengths()
    return {bucket_for(min(int(lengths[i]), cfg.max_length), cfg.data.context_buckets) for i in held_out}


@pytest.mark.parametrize("preload", ["off", "on"])
def test_training_with_compiled_drafter_never_recompiles(tiny_target_dir, tiny_tokenizer, tmp_path, preload):
    """Two buckets: the warm-up compiles one training graph per bucket and one of the loss's chunk (padded to one
    shape), the first evaluation one eval graph per bucket of the held-out samples and the no-grad chunk; then 6
    steps and a second evaluation under fail_on_recompile compile nothing, batches cut from preloaded samples too
    (the warm-up's come from the cache: read before the preload)."""
    torch.set_num_threads(1)
    torch._dynamo.reset()  # the other parameter's run compiled the same code
    cache = H.write_pattern_cache(tmp_path / "c.zarr", tiny_target_dir, tiny_tokenizer, n_samples=14,
                                  min_len=10, max_len=60)
    from dflash.train.loop import train

    cfg = H.tiny_config(cache, tiny_target_dir, tmp_path / "run", max_steps=6, compile="on",
                        compile_backend="eager", eval_every=3, log_every=3, preload=preload)
    summary = train(cfg)
    assert len(summary["context_buckets"]) == 2
    assert summary["warmup_compiled_graphs"] == 2 + 1  # grad mode only: no eval graph before step 1
    assert summary["eval_compiled_graphs"] == len(held_out_buckets(cache, cfg)) + 1 > 1
    train_rows = [r for r in summary["history"] if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [3, 6]
    assert train_rows[0]["compiles"] == summary["compiles_after_warm_up"]  # steps 1-3 compiled nothing
    assert train_rows[1]["compiles"] == summary["compiles"] == \
        summary["compiles_after_warm_up"] + summary["eval_compiled_graphs"]  # steps 4-6 and eval 2: nothing


def test_compiled_run_trains_as_the_uncompiled_one(tiny_target_dir, tiny_tokenizer, tmp_path):
    """The warm-up's real step, the eval graphs compiled at the first evaluation and the
    start's I/O thread leave no trace: a compiled run (eager backend: the same operations)
    logs the losses and evaluation of a run that compiles nothing."""
    torch.set_num_threads(1)
    cache = H.write_pattern_cache(tmp_path / "c.zarr", tiny_target_dir, tiny_tokenizer, n_samples=14,
                                  min_len=10, max_len=60)
    from dflash.train.loop import train

    def run(name, compile):
        torch._dynamo.reset()
        cfg = H.tiny_config(cache, tiny_target_dir, tmp_path / name, max_steps=4, compile=compile,
                            compile_backend="eager", eval_every=2, log_every=1)
        return train(cfg)

    plain, compiled = run("plain", "off"), run("compiled", "on")
    assert plain["warmup_compiled_graphs"] == 0 and compiled["warmup_compiled_graphs"] > 0
    losses = [[(r["kind"], r["step"], r["loss"]) for r in s["history"]] for s in (plain, compiled)]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    assert [r.get("tau") for r in plain["history"]] == [r.get("tau") for r in compiled["history"]]


def test_first_evaluation_compiles_then_recompiles_are_errors_again():
    """``compile_then_freeze``: the no-grad graph of a warmed-up function compiles inside it;
    after it, the same call compiles nothing and another shape raises naming the guard."""
    def f(x):
        return (x * 2).sum()

    fn = torch.compile(f, backend="eager", dynamic=False)
    x = torch.randn(8, requires_grad=True)
    assert C.compile_then_freeze(lambda: fn(x).backward())[1] == 1
    with torch.no_grad(), pytest.raises(RuntimeError, match="(?s)recompile.*grad"):
        fn(x)  # frozen: the no-grad graph may not compile outside compile_then_freeze
    result, compiled, _, _ = C.compile_then_freeze(lambda: _no_grad(fn, x))
    assert compiled == 1 and result == pytest.approx(2 * x.detach().sum().item())
    before = C.compile_count()
    _no_grad(fn, x)
    fn(x).backward()
    assert C.compile_count() == before  # both graphs reused
    with pytest.raises(RuntimeError, match="(?s)recompile.*size mismatch"):
        _no_grad(fn, torch.randn(9, requires_grad=True))


def _no_grad(fn, x):
    with torch.no_grad():
        return fn(x).item()


@cuda
def test_cuda_tiny_run_with_compiled_flex(tiny_target_dir, tiny_tokenizer, tmp_path):
    cache = H.write_pattern_cache(tmp_path / "c.zarr", tiny_target_dir, tiny_tokenizer, n_samples=14)
    from dflash.train.loop import train

    cfg = H.tiny_config(cache, tiny_target_dir, tmp_path / "run", max_steps=30, device="auto",
                        attention="auto", compile="auto", autocast="auto", eval_every=30, log_every=10)
    summary = train(cfg)
    rows = [r for r in summary["history"] if r["kind"] == "train"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert summary["eval"]["tau"] > 1.0
    assert {r["compiles"] for r in rows} == {summary["compiles_after_warm_up"]}  # step 30 logs before its evaluation
    assert summary["compiles"] == summary["compiles_after_warm_up"] + summary["eval_compiled_graphs"]


def test_bucket_plan_from_offsets_matches_a_scan_of_the_samples(tiny_target_dir, tiny_tokenizer, tmp_path):
    from dflash.shared.cache import CacheReader
    from dflash.train.data import AnchorDataset, Collate, bucket_for, plan_buckets

    cache = H.write_pattern_cache(tmp_path / "c.zarr", tiny_target_dir, tiny_tokenizer, n_samples=30,
                                  min_len=20, max_len=90, samples_per_shard=7)
    reader = CacheReader(str(cache))
    buckets = [8, 16, 32, 48, 64, 128]
    max_length = 64  # samples longer than this are truncated into the last compiled bucket
    plan = plan_buckets(reader.lengths(), buckets[:5])
    scanned = [len(reader[i]["input_ids"]) for i in range(len(reader))]  # reads every sample
    expected = sorted({bucket_for(min(T, max_length), buckets[:5]) for T in scanned})
    assert plan.buckets == expected and 8 not in plan.buckets and 16 not in plan.buckets
    assert sum(plan.samples.values()) == len(scanned) and plan.samples[8] == plan.samples[16] == 0
    assert "not 8, 16: no sample falls into them" in plan.describe()
    # batches collated with the compiled buckets alone have the shapes they have with every bucket
    ds = AnchorDataset(reader, [0, 2], max_length, 4, 0)
    rng = np.random.default_rng(0)
    for _ in range(12):
        keys = [(0, int(i)) for i in rng.choice(len(reader), size=3, replace=False)]
        keys[rng.integers(3)] = (0, -1)  # a weightless filler sample
        group = [ds[k] for k in keys]
        assert Collate(plan.buckets)(group)["input_ids"].shape == Collate(buckets[:5])(group)["input_ids"].shape
    fillers = [ds[(0, -1)]] * 2
    assert Collate(plan.buckets)(fillers)["input_ids"].shape[1] == plan.buckets[0]


def test_training_compiles_only_the_buckets_its_samples_fall_into(tiny_target_dir, tiny_tokenizer, tmp_path,
                                                                   caplog):
    """Every sample is longer than 32 tokens: bucket 32 is neither warmed up nor compiled, and
    training and evaluation then run under fail_on_recompile."""
    torch.set_num_threads(1)
    cache = H.write_pattern_cache(tmp_path / "c.zarr", tiny_target_dir, tiny_tokenizer, n_samples=12,
                                  min_len=40, max_len=60)
    from dflash.train.loop import train

    def run(name, buckets):
        torch._dynamo.reset()  # graphs compiled by earlier tests of this process would be reused
        cfg = H.tiny_config(cache, tiny_target_dir, tmp_path / name, max_steps=3, compile="on",
                            compile_backend="eager", eval_every=3, log_every=3, context_buckets=buckets,
                            compile_cache=str(tmp_path / "cc"))
        return train(cfg)

    with caplog.at_level(logging.INFO, logger="dflash.train"):
        one = run("one", [32, 64])
    alone = run("alone", [64])  # reference: bucket 64 as the only one configured
    assert one["context_buckets"] == [64] and alone["context_buckets"] == [64]
    assert one["warmup_compiled_graphs"] == alone["warmup_compiled_graphs"] > 0
    assert any("not 32: no sample falls into them" in r.getMessage() for r in caplog.records)
    assert [r["compiles"] for r in one["history"] if r["kind"] == "train"] == [one["compiles_after_warm_up"]]
    assert one["compiles"] == one["compiles_after_warm_up"] + one["eval_compiled_graphs"]  # none after eval 1
    assert one["eval"] is not None and one["compile_cache"] == str((tmp_path / "cc").resolve())


def test_default_compile_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(C.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert C.default_compile_cache() == tmp_path / "xdg" / "dflash" / "compile"
    monkeypatch.setenv(C.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert C.default_compile_cache() == tmp_path / "mine"  # the user's torch setting wins
    assert C.use_compile_cache(str(tmp_path / "chosen")) == (tmp_path / "chosen").resolve()
    assert os.environ[C.CACHE_DIR_ENV] == str((tmp_path / "chosen").resolve()) and (tmp_path / "chosen").is_dir()
    with pytest.raises(ValueError, match="space"):
        C.use_compile_cache(str(tmp_path / "my cache"))


_COMPILE_ONCE = """
import json, sys, torch
from dflash.train import compile as C
C.use_compile_cache(sys.argv[1])
f = torch.compile(lambda x, w: x @ w, backend="inductor", dynamic=False)  # one extern call: no C++ to build
x, w = torch.randn(8, 16), torch.randn(16, 4)
torch.testing.assert_close(f(x, w), x @ w)
print(json.dumps(C.cache_counts()))
"""


def test_second_process_loads_compiled_graphs_from_the_cache_folder(tmp_path):
    """Two separate processes compile the same function with inductor: the first fills the
    folder, the second loads its graph from there and compiles nothing."""
    folder = tmp_path / "compile_cache"
    env = {k: v for k, v in os.environ.items() if k != C.CACHE_DIR_ENV}

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", _COMPILE_ONCE, str(folder)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def files() -> set[Path]:
        return {p for p in folder.rglob("*") if p.is_file() and "locks" not in p.parts}

    first = run()
    assert first["fx_graph_miss"] >= 1 and first["fx_graph_hit"] == 0
    assert any(p.relative_to(folder).parts[0] == "fxgraph" for p in files())
    written = files()
    second = run()
    assert second["fx_graph_hit"] == first["fx_graph_miss"] and second["fx_graph_miss"] == 0
    assert second["aot_autograd_hit"] == first["aot_autograd_miss"] and second["aot_autograd_miss"] == 0
    assert files() == written  # nothing new compiled
