"""Stage two end to end on the CPU: learning, data parallel equivalence, exact resume,
CLI export, cache refusal, the decoding replay."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

import train_helpers as H
from train_helpers import one_thread  # noqa: F401 - the module's autouse fixture
from dflash.shared.cache import CacheMismatch
from dflash.train import checkpoint
from dflash.train.loop import train


@pytest.fixture(scope="module")
def pattern_cache(tmp_path_factory, tiny_target_dir, tiny_tokenizer):
    path = tmp_path_factory.mktemp("pattern") / "cache.zarr"
    return H.write_pattern_cache(path, tiny_target_dir, tiny_tokenizer, samples_per_shard=10)


def read_metrics(run_dir, kind="train"):
    rows = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
    return [r for r in rows if r["kind"] == kind]


def test_loss_falls_and_acceptance_rises(pattern_cache, tiny_target_dir, tmp_path):
    cfg = H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "run", max_steps=60, log_every=5,
                        eval_every=5, save_every=1000)
    summary = train(cfg)
    train_rows, evals = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "run", "eval")
    assert summary["step"] == 60 and len(evals) == 12
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert evals[0]["tau"] < 3.0 < evals[-1]["tau"] <= cfg.drafter.block_size
    assert train_rows[-1]["acc"] > 0.9
    # the last step is also evaluated and saved
    assert checkpoint.resolve(tmp_path / "run").name == "step_000060"
    for key in ("tok_s", "mfu", "peak_mem_gb", "lr", "grad_norm", "acc_per_pos"):
        assert key in train_rows[-1]


@pytest.mark.parametrize("world,micro", [(2, 2), (3, 1)])
def test_several_processes_match_one(pattern_cache, tiny_target_dir, tmp_path, world, micro):
    """(2, 2): 1 rank x 2 accumulation steps vs 2 ranks x 1; (3, 1): a batch of 4 over 3
    ranks, topped up with 2 empty slots, vs 1 rank x 4 accumulation steps."""
    # CE: the KL's many tiny gradients let Adam amplify reduction-order noise past the
    # tolerance below (4e-5 against CE's 7e-6); empty slots add exactly zero under either loss.
    one = H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "one", max_steps=3, batch_size=4,
                        micro_batch_size=micro, eval_samples=4, loss="ce")
    train(one)
    two = H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "two", max_steps=3, batch_size=4,
                        micro_batch_size=micro, eval_samples=4, loss="ce")
    H.run_distributed(two, world=world)
    a = checkpoint.load_weights(checkpoint.resolve(tmp_path / "one"))
    b = checkpoint.load_weights(checkpoint.resolve(tmp_path / "two"))
    assert checkpoint.read_state(checkpoint.resolve(tmp_path / "two"))["world_size"] == world
    assert a.keys() == b.keys()
    # Reduction order differs across ranks; Adam's g / sqrt(v) turns float-rounding noise on
    # near-zero gradients into up to ~lr / 500 of weight (max seen 7e-6 at lr 3e-3).
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5, msg=k)
    # and the run really moved the weights away from the seeded init
    from dflash.train.model import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    init = DFlashDrafter(DrafterConfig.from_dict(checkpoint.read_state(checkpoint.resolve(tmp_path / "one"))["drafter_config"]))
    assert not torch.allclose(init.state_dict()["fc.weight"], a["fc.weight"])
    la = [r["loss"] for r in read_metrics(tmp_path / "one")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "two")]
    assert la == pytest.approx(lb, rel=1e-5)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_bitwise(pattern_cache, tiny_target_dir, tmp_path, workers):
    kw = dict(max_steps=8, save_every=3, log_every=1, eval_every=4, num_workers=workers, epochs=1)
    train(H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "full", **kw))
    train(H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "cut", stop_after=4, **kw))
    # "killed" after step 4: drop the checkpoint-less tail, keep step 3
    assert checkpoint.resolve(tmp_path / "cut").name == "step_000003"
    rows = [l for l in open(tmp_path / "cut" / "metrics.jsonl") if json.loads(l)["step"] <= 3]
    (tmp_path / "cut" / "metrics.jsonl").write_text("".join(rows))
    summary = train(H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "cut", **kw))
    assert summary["step"] == 8
    full = [(r["step"], r["loss"], r["acc_per_pos"]) for r in read_metrics(tmp_path / "full")]
    cut = [(r["step"], r["loss"], r["acc_per_pos"]) for r in read_metrics(tmp_path / "cut")]
    assert [s for s, *_ in cut] == list(range(1, 9))
    assert cut == full  # bitwise: same floats
    assert read_metrics(tmp_path / "cut", "eval")[-1] == read_metrics(tmp_path / "full", "eval")[-1]
    a = checkpoint.load_weights(checkpoint.resolve(tmp_path / "full"))
    b = checkpoint.load_weights(checkpoint.resolve(tmp_path / "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_preloaded_samples_train_bitwise_as_the_loaders(pattern_cache, tiny_target_dir, tmp_path):
    """--preload on cuts every batch (weightless top-up slots and the held-out replay included) from samples read
    once: the run equals the loader workers' bit for bit, metrics, evaluation and weights."""
    kw = dict(max_steps=6, batch_size=3, log_every=1, eval_every=3, num_workers=2, epochs=1)
    for mode in ("off", "on"):
        train(H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / mode, preload=mode, **kw))
    runs = {mode: [(r["step"], r["loss"], r["acc_per_pos"]) for r in read_metrics(tmp_path / mode)]
            for mode in ("off", "on")}
    assert runs["on"] == runs["off"] and len(runs["on"]) == 6
    assert read_metrics(tmp_path / "on", "eval") == read_metrics(tmp_path / "off", "eval")
    a, b = (checkpoint.load_weights(checkpoint.resolve(tmp_path / mode)) for mode in ("off", "on"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_preload_auto_declines_what_does_not_fit_the_gpu(pattern_cache, monkeypatch, caplog):
    """auto never preloads on the CPU, nor without the warm-up's measured peak; on CUDA it weighs the samples'
    bytes against what the step's peak leaves of the memory this process can have."""
    import numpy as np

    from dflash.shared.cache import CacheReader
    from dflash.train.config import DataConfig
    from dflash.train.data import AnchorDataset, preload_bytes
    from dflash.train.loop import load_resident

    reader = CacheReader(str(pattern_cache))
    ds, every, lengths = AnchorDataset(reader, [0, 2], 64, 8, seed=0), np.arange(len(reader)), reader.lengths()
    need = preload_bytes(ds, every, lengths)
    hidden = sum(len(reader[i]["input_ids"]) for i in every) * 2 * reader.spec.hidden_size * 2  # bf16, 2 layers
    assert hidden < need < 2 * hidden  # the hidden states and the few bytes of ids and top-k a token
    cuda, auto = torch.device("cuda"), DataConfig()
    assert not load_resident([ds], every, lengths, auto, torch.device("cpu"), False, step_peak=0)
    assert not load_resident([ds], every, lengths, auto, cuda, False, step_peak=None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need, 10 * need))  # free
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: need // 2)  # ours, in the cache
    with caplog.at_level("INFO", logger="dflash.train"):
        assert not load_resident([ds], every, lengths, auto, cuda, False, step_peak=need // 2 - need // 20)
    assert "not preloaded" in caplog.text and ds.resident is None  # 0.9 x 1.05 need leaves it 0.055 short


def test_cli_run_and_export(pattern_cache, tiny_target_dir, tmp_path, capsys):
    from dflash.train.cli import main
    from dflash.train.export import load_exported
    from dflash.train.model import DFlashDrafter, DrafterConfig

    run = tmp_path / "run"
    main(["--preset", "tiny", "--cache", str(pattern_cache), "--target", str(tiny_target_dir), "--out", str(run),
          "--max-steps", "2", "--target-layer-ids", "0,2", "--mask-token-id", "3", "--max-anchors", "4"])
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"]["max_anchors"] == 4 and cfg["drafter"]["target_layer_ids"] == [0, 2]
    capsys.readouterr()
    main(["export", str(run), "--out", str(tmp_path / "export"), "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert f"checked against {tiny_target_dir}" in printed
    vllm_line = next(line for line in printed.splitlines() if line.strip().startswith("vllm serve"))
    vllm_args = shlex.split(vllm_line)
    assert vllm_args[2] == str(tiny_target_dir)
    assert json.loads(vllm_args[vllm_args.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": str((tmp_path / "export").resolve()), "num_speculative_tokens": 4 - 1}
    assert "--speculative-algorithm DFLASH" in printed
    loaded, lcfg = load_exported(tmp_path / "export")
    state = checkpoint.read_state(checkpoint.resolve(run))
    ref = DFlashDrafter(DrafterConfig.from_dict(state["drafter_config"]))
    ref.load_state_dict(checkpoint.load_weights(checkpoint.resolve(run)))
    assert lcfg.target_layer_ids == [0, 2] and lcfg.mask_token_id == 3
    from dflash.train import attention

    g = torch.Generator().manual_seed(0)
    S, N, B = 12, 2, lcfg.block_size
    anchors, valid = torch.tensor([[3, 7]]), torch.tensor([[True, True]])
    mask = attention.build_mask("dense", anchors, valid, torch.tensor([S]), S, B)
    args = (torch.randn(1, S, 2 * lcfg.hidden_size, generator=g), torch.arange(S)[None],
            torch.randn(1, N * B, lcfg.hidden_size, generator=g), (anchors[:, :, None] + torch.arange(B)).view(1, -1),
            mask)
    with torch.no_grad():
        assert torch.equal(loaded(*args), ref(*args))


def test_export_refuses_another_target(pattern_cache, tiny_target_dir, tmp_path):
    """A target of another width (its config edited) is refused before anything is written."""
    import shutil

    from click import ClickException

    from dflash.train.cli import main

    run = tmp_path / "run"
    train(H.tiny_config(pattern_cache, tiny_target_dir, run, max_steps=1))
    other = tmp_path / "other"
    shutil.copytree(tiny_target_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"] *= 2
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ClickException, match="hidden size: the drafter has 64, the target 128"):
        main(["export", str(run), "--out", str(tmp_path / "export"), "--target", str(other)])
    assert not (tmp_path / "export").exists()


def test_incompatible_cache_refused_naming_each_mismatch(tiny_target_dir, tiny_tokenizer, tmp_path):
    bad = H.write_pattern_cache(tmp_path / "bad.zarr", tiny_target_dir, tiny_tokenizer, n_samples=6,
                                layer_ids=[0, 1], hidden_size=32, vocab_size=999, tokenizer_hash="deadbeef",
                                num_target_layers=6)
    cfg = H.tiny_config(bad, tiny_target_dir, tmp_path / "run", max_steps=1)
    with pytest.raises(CacheMismatch) as info:
        train(cfg)
    text = str(info.value)
    for needle in ("layers [2] are not stored", "hidden size", "vocabulary size", "tokenizer", "target layer count"):
        assert needle in text, needle
    assert len(info.value.differences) == 5
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_fsdp2_matches_ddp_and_resumes(pattern_cache, tiny_target_dir, tmp_path):
    kw = dict(max_steps=4, save_every=2, log_every=1, eval_every=2)
    H.run_distributed(H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "ddp", **kw), world=2)
    H.run_distributed(H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "fsdp", parallel="fsdp",
                                    stop_after=2, **kw), world=2)
    H.run_distributed(H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "fsdp", parallel="fsdp", **kw),
                      world=2)
    a = checkpoint.load_weights(checkpoint.resolve(tmp_path / "ddp"))
    b = checkpoint.load_weights(checkpoint.resolve(tmp_path / "fsdp"))
    assert checkpoint.resolve(tmp_path / "fsdp").name == "step_000004"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    assert [r["loss"] for r in read_metrics(tmp_path / "fsdp")] == pytest.approx(
        [r["loss"] for r in read_metrics(tmp_path / "ddp")], rel=1e-5)


# ---------------------------------------------------------------------------- the decoding replay


def brute_force_decoding(reader, samples, drafter, head, mask_token_id):
    """(drafted tokens, blocks) of decoding every assistant turn of ``samples`` from its first
    token, one block per call of the drafter's forward over the cached prefix with every key
    visible (decoding's one block), each slot compared with the target's top-1
    stored in the cache, advancing by what was emitted; no code shared with the replay but
    the model."""
    B = drafter.config.block_size
    slots = reader.layer_slots(list(drafter.config.target_layer_ids))
    tokens = blocks = 0
    for index in samples:
        s = reader.read(int(index))
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        top1 = s["topk_ids"][:, 0].tolist()  # the target's greedy choice for position t + 1
        context = s["hidden"][:, slots].flatten(1).float()  # (T, n * D)
        turns, t = [], 0
        while t < len(mask):  # runs of assistant tokens
            if mask[t]:
                start = t
                while t < len(mask) and mask[t]:
                    t += 1
                turns.append((start, t))
            else:
                t += 1
        for start, stop in turns:
            position = start  # the turn's first token comes from the prefill
            while position < stop - 1:
                block = torch.tensor([[ids[position]] + [mask_token_id] * (B - 1)])
                hidden = drafter(context[None, :position], torch.arange(position)[None], head.embed(block),
                                 position + torch.arange(B)[None], torch.ones(1, 1, B, position + B, dtype=torch.bool))
                proposal = head.logits(hidden)[0].argmax(-1).tolist()
                accepted = 0
                for k in range(1, B):
                    if position + k >= stop or proposal[k] != top1[position + k - 1]:
                        break
                    accepted += 1
                emitted = min(accepted + 1, stop - 1 - position)  # the bonus token, never past the turn
                position += emitted
                tokens += emitted
                blocks += 1
    return tokens, blocks


def test_training_and_offline_replay_equal_brute_force_decoding(pattern_cache, tiny_target_dir, tmp_path):
    """Both callers of dflash.train.replay, training's held-out tau (every assistant anchor
    in chunks of max_anchors, padded batches, the compiled-shape eval step) and
    dflash.eval.replay_eval.replay_export (all anchors in one forward per sample), give the brute-force
    decoding's tokens and blocks exactly."""
    from dflash.eval.replay_eval import replay_export
    from dflash.eval.speculative import load_drafter
    from dflash.shared.cache import CacheReader
    from dflash.train.data import Split
    from dflash.train.model import load_target_head

    cfg = H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "run", max_steps=20, eval_every=20)
    summary = train(cfg)
    reader = CacheReader(pattern_cache)
    held_out = Split.of(len(reader), cfg.data.eval_samples, reader.source_indices()).held_out.tolist()
    drafter, dcfg = load_drafter(tmp_path / "run", dtype=torch.float32)
    head = load_target_head(tiny_target_dir, "cpu", torch.float32)
    with torch.no_grad():
        tokens, blocks = brute_force_decoding(reader, held_out, drafter.eval(), head, dcfg.mask_token_id)
    offline = replay_export(pattern_cache, held_out, tmp_path / "run", tiny_target_dir, max_length=cfg.max_length)
    trained = summary["eval"]
    assert blocks > len(held_out) and 1 < tokens / blocks < dcfg.block_size  # neither trivial nor perfect
    assert (offline["tokens"], offline["blocks"]) == (tokens, blocks)
    assert trained["tau_blocks"] == blocks
    assert trained["tau"] == pytest.approx(tokens / blocks, rel=1e-12)
    assert offline["tau"] == pytest.approx(tokens / blocks, rel=1e-12)
    assert 1.0 <= trained["tau_uniform"] <= dcfg.block_size and 1.0 <= offline["tau_uniform"] <= dcfg.block_size


# ---------------------------------------------------------------------------- defaults that follow the cache


def test_run_follows_its_cache(pattern_cache, tiny_target_dir, tmp_path, caplog):
    """No --target, no --target-layer-ids, no --eval-samples: the target the cache records,
    every layer it stores, and a tenth of its 24 samples held out (logged as capped)."""
    from dflash.shared.cache import CacheReader
    from dflash.train.cli import main
    from dflash.train.data import Split

    run = tmp_path / "run"
    caplog.set_level("INFO", logger="dflash.train")
    main(["run", "--preset", "tiny", "--cache", str(pattern_cache), "--out", str(run), "--max-steps", "1",
          "--mask-token-id", "3"])
    reader = CacheReader(pattern_cache)
    saved = json.loads((run / "config.json").read_text())
    assert saved["target"] == reader.spec.fingerprint["target"]["name_or_path"] == str(tiny_target_dir)
    state = checkpoint.read_state(checkpoint.resolve(run))
    assert state["drafter_config"]["target_layer_ids"] == reader.spec.layer_ids == H.LAYER_IDS
    n = len(reader)
    held = Split.of(n, None, reader.source_indices()).held_out
    assert len(held) == n // 10 == 2
    assert sorted(reader.source_indices()[held].tolist()) == sorted(reader.source_indices().tolist())[-2:]
    assert f"held out 2 of {n} samples: the default 64 is capped" in caplog.text


def test_moved_target_is_named(tiny_target_dir, tiny_tokenizer, tmp_path):
    """The cache records where its target was; once moved, the error names it and --target fixes it."""
    import shutil

    where = tmp_path / "target"
    shutil.copytree(tiny_target_dir, where)
    cache = H.write_pattern_cache(tmp_path / "c.zarr", where, tiny_tokenizer, n_samples=12)
    where.rename(tmp_path / "moved")
    cfg = H.tiny_config(cache, "", tmp_path / "run", max_steps=1)
    with pytest.raises(ValueError, match=f"extracted from the target {where}, which no longer exists"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    train(H.tiny_config(cache, tmp_path / "moved", tmp_path / "run", max_steps=1))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["target"] == str(tmp_path / "moved")


def test_cache_with_the_last_layer_is_not_a_default(tiny_target_dir, tiny_tokenizer, tmp_path):
    """A cache made before the rule stored id L-1: it is no default, and the error says what to pass."""
    cache = H.write_pattern_cache(tmp_path / "old.zarr", tiny_target_dir, tiny_tokenizer, n_samples=8,
                                  layer_ids=[0, 1, 2, 3])
    cfg = H.tiny_config(cache, tiny_target_dir, tmp_path / "run", max_steps=1, target_layer_ids=None)
    with pytest.raises(CacheMismatch, match="3 is the last layer.*pass --target-layer-ids 0,1,2"):
        train(cfg)


@pytest.mark.parametrize("n,asked,want", [(848, None, 64), (80, None, 8), (24, None, 2), (9, None, 1), (1, None, 0),
                                          (80, 64, 64), (3, 10, 2), (50, 0, 0)])
def test_held_out_count(n, asked, want):
    from dflash.train.data import held_out_count

    assert held_out_count(n, asked) == want
    if asked is None:  # independent statement of the rule: at most a tenth (where a tenth is 1 or more), at most 64
        assert want <= max(1, n / 10) and want <= 64 and (want >= 1 or n < 2)


def test_cpu_warning_for_the_full_recipe(caplog, tmp_path):
    from click import ClickException

    from dflash.train.cli import cpu_preset_warning, main

    assert "--preset tiny" in cpu_preset_warning("dflash", "cpu")
    assert cpu_preset_warning("tiny", "cpu") is None and cpu_preset_warning("dflash", "cuda") is None
    caplog.set_level("WARNING", logger="dflash.train")
    with pytest.raises(ClickException, match="no cache there"):  # the warning comes before any work
        main(["run", "--cache", str(tmp_path / "missing.zarr"), "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert "takes minutes per step on the CPU; for a CPU run use --preset tiny" in caplog.text


def test_a_slow_loader_is_named(pattern_cache, tmp_path, caplog, monkeypatch):
    """A loader that cannot keep up with the step: one warning, naming the share of time waited and the way out."""
    import time

    from dflash.train import data
    from dflash.train.cli import main

    read = data.AnchorDataset.__getitem__

    def slow_read(self, key):
        time.sleep(0.05)
        return read(self, key)

    monkeypatch.setattr(data.AnchorDataset, "__getitem__", slow_read)  # the forked worker inherits it
    caplog.set_level("WARNING", logger="dflash.train")
    main(["run", "--preset", "tiny", "--cache", str(pattern_cache), "--out", str(tmp_path / "run"), "--max-steps", "4",
          "--log-every", "2", "--num-workers", "1", "--mask-token-id", "3", "--no-progress"])
    warnings = [r.getMessage() for r in caplog.records if "waited on the data loader" in r.getMessage()]
    assert len(warnings) == 1 and "raise --num-workers (now 1)" in warnings[0] and "--hidden-codec fp8" in warnings[0]
    waited = [m["data_wait"] for m in read_metrics(tmp_path / "run")]
    assert max(waited) > 0.3
