"""The one compile path: warm-up then fail_on_recompile, main-thread only, flex refusals."""

from __future__ import annotations

import threading

import pytest
import torch

import train_helpers as H
from dflash.train import attention, compile as C
from dflash.train.config import RuntimeConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def default_stance():
    yield
    C.thaw()
    attention.allow_uncompiled_flex(False)


def test_recompile_after_warm_up_is_an_error_naming_the_guard():
    def f(x):
        return (x * 2).sin().sum()

    fn = torch.compile(f, backend="eager", dynamic=False)
    x = torch.randn(8, requires_grad=True)
    before = C.compile_count()
    compiled = C.warm_up([lambda: fn(x).backward()])
    assert compiled == 1 and C.compile_count() == before + 1
    fn(torch.randn(8, requires_grad=True)).backward()  # same shape: no compile
    assert C.compile_count() == before + 1
    with pytest.raises(RuntimeError, match="(?s)recompile.*size mismatch"):
        fn(torch.randn(9, requires_grad=True))
    C.thaw()
    fn(torch.randn(9))  # allowed again once thawed


def test_compile_refuses_other_threads():
    errors = []

    def worker():
        for call in (C.freeze, lambda: C.warm_up([]),
                     lambda: C.compile_model(torch.nn.Linear(2, 2), C.resolve(RuntimeConfig(compile="on"),
                                                                             torch.device("cpu")), 4)):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))

    t = threading.Thread(target=worker, name="not-main")
    t.start()
    t.join()
    assert len(errors) == 3 and all("main thread" in e for e in errors)


def test_compiled_model_refuses_calls_from_other_threads():
    choice = C.resolve(RuntimeConfig(compile="on", compile_backend="eager"), torch.device("cpu"))
    model = C.compile_model(torch.nn.Linear(2, 2), choice, 4)
    x = torch.randn(3, 2)
    assert model(x).shape == (3, 2)  # the main thread may call it
    errors = []

    def worker():
        try:
            model(x)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=worker, name="not-main")
    t.start()
    t.join()
    assert len(errors) == 1 and "compiled drafter" in errors[0] and "main thread" in errors[0]


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

    C.warm_up([lambda: call(0)])
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
    assert eager.attention == "flex" and eager.eager_flex and attention.uncompiled_flex_allowed()


def test_uncompiled_flex_refused_on_cuda_unless_named(monkeypatch):
    gpu = torch.device("cuda", 0)  # resolve() only inspects the device; no CUDA needed
    auto = C.resolve(RuntimeConfig(), gpu)
    assert (auto.attention, auto.compile_model, auto.eager_flex) == ("flex", True, False)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    for requested in ("flex", "auto"):
        with pytest.raises(RuntimeError, match="flex-eager"):
            C.resolve(RuntimeConfig(attention=requested), gpu)
    assert C.resolve(RuntimeConfig(attention="flex-eager"), gpu).eager_flex


def test_training_with_compiled_drafter_never_recompiles(tiny_target_dir, tiny_tokenizer, tmp_path):
    """Two buckets, train + eval graphs warmed up; then 6 steps and 2 evals under fail_on_recompile."""
    torch.set_num_threads(1)
    cache = H.write_pattern_cache(tmp_path / "c.zarr", tiny_target_dir, tiny_tokenizer, n_samples=14,
                                  min_len=10, max_len=60)
    from dflash.train.loop import train

    cfg = H.tiny_config(cache, tiny_target_dir, tmp_path / "run", max_steps=6, compile="on",
                        compile_backend="eager", eval_every=3, log_every=3)
    summary = train(cfg)
    assert summary["warmup_compiled_graphs"] >= 4  # (2 buckets) x (grad, no grad)
    counts = {r["compiles"] for r in summary["history"] if r["kind"] == "train"}
    assert counts == {summary["compiles"]}  # nothing compiled after the warm-up


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
    assert {r["compiles"] for r in rows} == {summary["compiles"]}
