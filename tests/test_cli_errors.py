"""Bad input to the dflash-* commands ends in one line that names the flag or file, with a
non-zero exit status, never in a Python traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from train_helpers import one_thread, write_pattern_cache  # noqa: F401 - one_thread: autouse fixture

from dflash.eval.cli import cli as eval_cli
from dflash.extract.regenerate_cli import main as regenerate_cli
from dflash.shared.cache_cli import main as cache_cli
from dflash.train.cli import cli as train_cli

@pytest.fixture(scope="module")
def cache(tiny_target_dir, tiny_tokenizer, tmp_path_factory) -> Path:
    return write_pattern_cache(tmp_path_factory.mktemp("errors") / "cache", tiny_target_dir, tiny_tokenizer,
                               n_samples=8)


@pytest.fixture(scope="module")
def drafter(tiny_target_dir, tmp_path_factory) -> Path:
    """An exported (untrained) drafter of the tiny target."""
    from transformers import AutoConfig

    from dflash.train.export import export_drafter
    from dflash.train.model import DFlashDrafter, DrafterConfig

    config = DrafterConfig.from_target_config(AutoConfig.from_pretrained(tiny_target_dir), [0, 2], mask_token_id=3,
                                              block_size=4, num_hidden_layers=1)
    return export_drafter(DFlashDrafter(config), config, tmp_path_factory.mktemp("errors") / "drafter")


def refused(command, args: list[str], *named: str) -> str:
    """Run ``command`` as its console script would; assert a clean refusal naming each of ``named``."""
    result = CliRunner().invoke(command, [str(a) for a in args])
    # an escaping exception would be result.exception itself (the console script prints its traceback)
    assert isinstance(result.exception, SystemExit) and result.exit_code in (1, 2), (result.exception, result.output)
    assert "Traceback" not in result.output
    for name in named:
        assert str(name) in result.output, result.output
    return result.output


def test_train_layers_out_of_order(cache, tmp_path):
    refused(train_cli, ["run", "--cache", cache, "--out", tmp_path / "run", "--preset", "tiny",
                        "--target-layer-ids", "3,1"], "--target-layer-ids", "ascending")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag,value,rule", [
    ("--batch-size", 0, "at least 1"), ("--micro-batch-size", 0, "at least 1"), ("--eval-every", 0, "at least 1"),
    ("--save-every", 0, "at least 1"), ("--log-every", 0, "at least 1"), ("--max-steps", 0, "at least 1"),
    ("--num-draft-layers", 0, "at least 1"), ("--num-workers", -1, "0 or more"), ("--grad-clip", -1, "0 or more"),
    ("--lr", -1, "above 0"), ("--epochs", 0, "above 0"), ("--gamma", 0, "above 0"), ("--peak-tflops", 0, "above 0"),
    ("--warmup-ratio", 2, "within [0, 1]"), ("--beta2", 1, "within [0, 1)")])
def test_train_numbers_out_of_range_are_refused_before_training(cache, tmp_path, flag, value, rule):
    """Each of these once ended in a traceback (a division by zero), a refusal from inside torch that named no
    setting, or a run that trained something else than asked (0 epochs ran a step)."""
    refused(train_cli, ["run", "--cache", cache, "--out", tmp_path / "run", "--preset", "tiny", flag, value],
            f"{flag[2:].replace('-', '_')} must be {rule}, got {value}")
    assert not (tmp_path / "run").exists()


def test_train_numbers_at_the_edge_of_their_range_are_taken():
    from dflash.train.config import tiny

    tiny().override(grad_clip=0.0, weight_decay=0.0, eval_samples=0, num_workers=0, keep_checkpoints=0,
                    warmup_ratio=0.0, min_lr_ratio=1.0, beta1=0.0, kd_weight=1.0, max_steps=1, lr=1e-9).validate()


def test_train_target_folder_missing(cache, tmp_path):
    missing = tmp_path / "no_target"
    refused(train_cli, ["run", "--cache", cache, "--out", tmp_path / "run", "--preset", "tiny",
                        "--target", missing], "--target", missing)


def test_train_mask_id_outside_the_vocabulary(cache, tmp_path):
    refused(train_cli, ["run", "--cache", cache, "--out", tmp_path / "run", "--preset", "tiny",
                        "--target-layer-ids", "0,2", "--mask-token-id", "100000"], "--mask-token-id 100000")


def test_train_cache_missing(tmp_path):
    refused(train_cli, ["run", "--cache", tmp_path / "no_cache", "--out", tmp_path / "run"], tmp_path / "no_cache")


def test_export_checkpoint_missing(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    refused(train_cli, ["export", tmp_path / "run", "--out", tmp_path / "x", "--checkpoint", "step_000999"],
            "--checkpoint", "step_000999")


@pytest.mark.parametrize("content", [None, "{not json", '[{"messages": []}'])
def test_eval_prompts_missing_or_not_json(tiny_target_dir, drafter, tmp_path, content):
    prompts = tmp_path / "prompts.json"
    if content is not None:
        prompts.write_text(content)
    refused(eval_cli, ["--target", tiny_target_dir, "--drafter", drafter, "--prompts", prompts],
            "--prompts", prompts)


def test_eval_target_and_drafter_not_there(tiny_target_dir, cache, tmp_path, chats_sample_path):
    refused(eval_cli, ["--target", tmp_path / "none", "--drafter", cache, "--prompts", chats_sample_path],
            "--target", tmp_path / "none")
    refused(eval_cli, ["--target", tiny_target_dir, "--drafter", cache, "--prompts", chats_sample_path],
            "--drafter", cache)


def test_a_folder_without_config_json_is_no_model_folder(tiny_target_dir, cache, drafter, chats_sample_path, tmp_path):
    """Once transformers' five lines about backend tokenizers, naming no flag in dflash-eval; now the flag and the
    missing file, before anything loads. A tokenizer folder needs no config.json."""
    from dflash.extract.cli import main as extract_main

    folder = tmp_path / "tokenizer_only"
    shutil.copytree(tiny_target_dir, folder)
    (folder / "config.json").unlink()
    said = f"{folder} holds no config.json"
    refused(extract_main, ["--data", chats_sample_path, "--model", folder, "--out", tmp_path / "c.zarr"], "--model",
            said)
    refused(regenerate_cli, ["--data", chats_sample_path, "--model", folder, "--out", tmp_path / "out"], "--model",
            said)
    refused(train_cli, ["run", "--cache", cache, "--out", tmp_path / "run", "--preset", "tiny", "--target", folder],
            "--target", said)
    refused(eval_cli, ["--target", folder, "--drafter", drafter, "--prompts", chats_sample_path], "--target", said)
    assert not any((tmp_path / name).exists() for name in ("c.zarr", "out", "run"))
    refused(extract_main, ["--data", chats_sample_path, "--model", tiny_target_dir, "--tokenizer", folder, "--out",
                           tmp_path / "t.zarr", "--device", "cpu", "--attn-implementation", "bogus"], "bogus")


def test_eval_target_whose_tokenizer_cannot_load_names_the_flag(tiny_target_dir, drafter, chats_sample_path,
                                                                tmp_path):
    folder = tmp_path / "broken_tokenizer"
    shutil.copytree(tiny_target_dir, folder)
    (folder / "tokenizer.json").write_text("{")
    refused(eval_cli, ["--target", folder, "--drafter", drafter, "--prompts", chats_sample_path], "--target")


def test_eval_new_tokens_past_the_targets_positions(tiny_target_dir, drafter, chats_sample_path):
    """One position past max_position_embeddings (prompt, new tokens and a last block) is refused up front."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.eval.cli import load_prompts

    prompt = load_prompts(str(chats_sample_path), AutoTokenizer.from_pretrained(tiny_target_dir), limit=1)[0]
    new = AutoConfig.from_pretrained(tiny_target_dir).max_position_embeddings - len(prompt) - 4 + 1  # block of 4
    refused(eval_cli, ["--target", tiny_target_dir, "--drafter", drafter, "--prompts", chats_sample_path, "--limit",
                       1, "--max-new-tokens", new], "--max-new-tokens", f"({len(prompt)} tokens), {new} new tokens")


def test_regenerate_new_tokens_past_the_targets_positions(tiny_target_dir, chats_sample_path, tmp_path):
    from transformers import AutoConfig

    room = AutoConfig.from_pretrained(tiny_target_dir).max_position_embeddings
    refused(regenerate_cli, ["--data", chats_sample_path, "--model", tiny_target_dir, "--out", tmp_path / "out",
                             "--max-new-tokens", room - 99, "--max-prompt-tokens", 100],
            f"--max-new-tokens {room - 99} after a prompt of 100 (--max-prompt-tokens) runs past the target's {room}")


def test_template_kwargs_that_apply_chat_template_takes_itself(tiny_target_dir, drafter, chats_sample_path, tmp_path):
    """Passed twice, the template call failed: a traceback in dflash-eval, every row skipped in dflash-regenerate."""
    said = "--template-kwargs cannot set ['tokenize']"
    refused(eval_cli, ["--target", tiny_target_dir, "--drafter", drafter, "--prompts", chats_sample_path,
                       "--template-kwargs", '{"tokenize": true}'], said)
    refused(regenerate_cli, ["--data", chats_sample_path, "--model", tiny_target_dir, "--out", tmp_path / "out",
                             "--template-kwargs", '{"tokenize": true}'], said)
    assert not (tmp_path / "out").exists()


def test_extract_attention_kernel_that_transformers_does_not_know(tiny_target_dir, chats_sample_path, tmp_path):
    """The target loads in the shard's worker: its refusal was an 'unexpected' error with a traceback."""
    from dflash.extract.cli import main as extract_main

    refused(extract_main, ["--data", chats_sample_path, "--model", tiny_target_dir, "--out", tmp_path / "c.zarr",
                           "--device", "cpu", "--no-progress", "--attn-implementation", "bogus"],
            "cannot load the target", "with --attn-implementation bogus")


def test_extract_model_or_tokenizer_folder_missing(tiny_target_dir, chats_sample_path, tmp_path):
    from dflash.extract.cli import main as extract_main

    base = ["--data", chats_sample_path, "--out", tmp_path / "c.zarr", "--device", "cpu"]
    refused(extract_main, [*base, "--model", tmp_path / "none"], "--model", f"{tmp_path / 'none'} is not a folder")
    refused(extract_main, [*base, "--model", tiny_target_dir, "--tokenizer", tmp_path / "none"], "--tokenizer")
    assert not (tmp_path / "c.zarr").exists()


def test_regenerate_model_folder_missing(chats_sample_path, tmp_path):
    refused(regenerate_cli, ["--data", chats_sample_path, "--model", tmp_path / "none", "--out", tmp_path / "out"],
            "--model", tmp_path / "none")


def test_cache_convert_onto_a_file(cache, tmp_path):
    (tmp_path / "file").write_text("")
    refused(cache_cli, ["convert", cache, tmp_path / "file", "--hidden-codec", "fp8", "--no-progress"],
            tmp_path / "file")


@pytest.mark.parametrize("args,flag", [(["stats", "--max-samples", "-1"], "--max-samples"),
                                       (["stats", "--threshold", "-1"], "--threshold"),
                                       (["verify", "--workers", "0"], "--workers"),
                                       (["show", "0", "--top", "-1"], "--top"),
                                       (["show", "0", "--tokens", "-5"], "--tokens")])
def test_cache_numbers_out_of_range(cache, args, flag):
    """Once numpy's words (negative dimensions), or a report of nothing."""
    refused(cache_cli, [args[0], cache, *args[1:]], f"Invalid value for '{flag}'")


def test_console_script_prints_no_traceback(cache, tmp_path):
    """The real entry point in its own process: the layer list out of order named, exit status 1."""
    args = ["--cache", str(cache), "--out", str(tmp_path / "run"), "--preset", "tiny", "--target-layer-ids", "3,1"]
    run = subprocess.run([sys.executable, "-m", "dflash.train.cli", *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "Error: --target-layer-ids: target layer ids [3, 1]" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_on_a_machine_without_it(cache, tiny_target_dir, drafter, tmp_path):
    refused(train_cli, ["run", "--cache", cache, "--out", tmp_path / "run", "--preset", "tiny", "--device", "cuda"],
            "--device", "0 visible CUDA devices")
    refused(eval_cli, ["--target", tiny_target_dir, "--drafter", drafter, "--prompts", "x.jsonl", "--device", "cuda:1"],
            "--device", "cuda:1")


def test_device_name_not_a_device(tiny_target_dir, drafter):
    refused(eval_cli, ["--target", tiny_target_dir, "--drafter", drafter, "--prompts", "x.jsonl", "--device", "gpu"],
            "--device", "'gpu' is not a device")


def test_only_expected_errors_become_one_line(tmp_path):
    """ValueError and OSError (bad input) are one line; any other error keeps its traceback."""
    import click

    from dflash.shared.cli import Command

    errors = {"value": ValueError("--kind: not good"), "os": FileNotFoundError(2, "No such file", str(tmp_path / "f")),
              "bug": RuntimeError("internal")}

    @click.command(cls=Command)
    @click.option("--kind")
    def command(kind):
        raise errors[kind]

    assert "Error: --kind: not good" in refused(command, ["--kind", "value"])
    assert f"Error: {tmp_path / 'f'}: No such file" in refused(command, ["--kind", "os"])
    result = CliRunner().invoke(command, ["--kind", "bug"])
    assert result.exception is errors["bug"]


def test_eval_report_path_that_cannot_be_written(tiny_target_dir, drafter, chats_sample_path, tmp_path):
    """Refused before the target loads: a report lost after minutes of decoding was the alternative."""
    (tmp_path / "file").write_text("")
    for where, said in ((tmp_path, f"{tmp_path}: cannot write a report there"), (tmp_path / "file" / "report.json",
                                                                                 "file: File exists")):
        refused(eval_cli, ["--target", tiny_target_dir, "--drafter", drafter, "--prompts", chats_sample_path,
                           "--json", where], "--json", said)


def test_extract_with_every_row_skipped_or_no_rows_fails_after_its_summary(tiny_target_dir, tmp_path):
    """An empty cache is written and counted, but the exit status says nothing was extracted: training would
    refuse the cache minutes later."""
    from dflash.extract.cli import main as extract_main
    from dflash.shared import cache as C

    bad, empty = tmp_path / "bad.jsonl", tmp_path / "empty.jsonl"
    bad.write_text('{"messages": [{"role": "robot", "content": "x"}]}\n{"text": 3}\n')
    empty.write_text("")
    for data, said in ((bad, "all 2 rows skipped"), (empty, "it has no rows")):
        out = tmp_path / f"{data.stem}.zarr"
        output = refused(extract_main, ["--data", data, "--model", tiny_target_dir, "--out", out, "--device", "cpu",
                                        "--no-progress", "--on-bad-row", "skip"], f"no samples from {data}: {said}")
        assert "samples written  0 of 0 planned" in output
        assert C.committed_samples(C.open_root(str(out))) == 0
