"""``dflash-eval``: a drafter's acceptance per benchmark replayed over every prompt (``replay_eval``), checked and
timed by real decoding of a sample; exit status 1 on a lossless failure, or in float32 on a tau off the replay's."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from dflash.shared.cli import Command, JsonObject, Maybe, ModelPath, reading, usable_device

log = logging.getLogger("dflash.eval")


def row_to_messages_or_text(row: dict[str, Any], index: int, source: str) -> tuple[list[dict] | None, str | None]:
    """(messages up to the last user turn, None), or (None, text) for a ``text`` row; a row with only
    a ``prompt`` or ``question`` string is one user turn."""
    from dflash.extract.data import DataError, normalize_row

    if all(row.get(c) is None for c in ("messages", "conversations", "text")):
        for column in ("prompt", "question"):
            if isinstance(row.get(column), str) and row[column].strip():
                return [{"role": "user", "content": row[column]}], None
    try:
        conv = normalize_row(row, index, source)
    except DataError as err:
        if err.reason != "no_assistant_turn":
            raise
        # a prompt set has no answers: normalise it as if it had one, with the keys of either list shape
        column = "messages" if row.get("messages") is not None else "conversations"
        answer = {"role": "assistant", "content": ".", "from": "gpt", "value": "."}
        conv = normalize_row({**row, column: [*row[column], answer]}, index, source)
    if conv.kind == "text":
        return None, conv.text
    if not (users := [i for i, m in enumerate(conv.messages) if m["role"] == "user"]):
        raise DataError("no_user_turn", source, index, "no user message to prompt with")
    return conv.messages[: users[-1] + 1], None


def load_prompts(spec: str, tokenizer, *, split: str = "train", limit: int | None = None,
                 template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of up to ``limit`` prompts from dataset ``spec`` (bad rows skipped and counted)."""
    from dflash.extract.data import SkipCounter, guard, load_source

    skips, prompts = SkipCounter(), []
    for index, row in enumerate(load_source(spec, split)):
        if limit is not None and len(prompts) >= limit:
            break
        if (parsed := guard("skip", skips, row_to_messages_or_text, row, index, spec)) is None:
            continue
        messages, text = parsed
        if messages is not None:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 **(template_kwargs or {}))
        prompts.append([int(t) for t in tokenizer(text, add_special_tokens=messages is None)["input_ids"]])
    if skips.total:
        log.warning("prompts: %s", skips.summary())
    return prompts


def parse_benchmarks(specs: list[str]) -> list[tuple[str, str]]:
    """[(name, dataset)] of the --prompts values: NAME=DATA, or DATA named after its file."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, data = spec.partition("=")
        if not (sep and (not name or re.fullmatch(r"[A-Za-z0-9_.-]+", name))):  # else a dataset alone, '=' or '/' in it
            name, data = Path(spec.rstrip("/")).stem or spec, spec
        if not name or not data:
            raise click.BadParameter(f"{spec!r}: give NAME=DATA (e.g. mtbench=mt_bench.jsonl) or a dataset",
                                     param_hint="--prompts")
        if name in dict(out):
            raise click.BadParameter(f"benchmark name {name!r} given twice; name them NAME=DATA",
                                     param_hint="--prompts")
        out.append((name, data))
    return out


@click.command(cls=Command)
@click.option("--target", type=ModelPath(), required=True, help="Target model: HF folder or hub name "
              "(from_pretrained).")
@click.option("--drafter", type=click.Path(exists=True, file_okay=False), required=True, help="Export folder "
              "(config.json) or training run / checkpoint folder (latest checkpoint).")
@click.option("--prompts", multiple=True, required=True, help="Prompt dataset (anything extract's load_source reads) "
              "as DATA or NAME=DATA; repeat for several benchmarks.")
@click.option("--spec-sample", type=click.IntRange(min=0), default=8, help="Prompts per benchmark decoded "
              "speculatively for real (lossless, tau equal, speed); 0 = none, at least the prompts = all.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, help="Prompts per batched generate and target "
              "forward.")
@click.option("--capture/--no-capture", default=None, help="Timed greedy and speculative decoding on a static KV "
              "cache; on CUDA the target's decode/verify forwards and the drafter's proposal in CUDA graphs "
              "(default: on for cuda, off for cpu).")
@click.option("--split", default="train", help="Dataset split.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, help="Tokens generated per prompt.")
@click.option("--limit", type=Maybe(click.IntRange(min=1)), help="Use the first N prompts.")
@click.option("--device", default="cpu", help="cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              help="Target and drafter dtype; auto = float32 on cpu, bfloat16 on cuda.")
@click.option("--template-kwargs", type=JsonObject(), default="{}", help="JSON for the chat template, e.g. "
              '\'{"enable_thinking": false}\'.')
@click.option("--check/--no-check", default=True, help="Fail (exit 1) when speculative output differs from greedy.")
@click.option("--json", "report_path", type=Maybe(str), help="Write the full report here.")
def cli(target: str, drafter: str, prompts: tuple[str, ...], spec_sample: int, batch_size: int,
        capture: bool | None, split: str, max_new_tokens: int, limit: int | None, device: str, dtype: str,
        template_kwargs: dict, check: bool, report_path: str | None):
    """Acceptance (tau) of a DFlash drafter per benchmark: replayed over every prompt, checked and
    timed against real speculative decoding on a sample."""
    usable_device(device)
    started, benchmarks = time.perf_counter(), parse_benchmarks(list(prompts))
    import torch
    from transformers import AutoTokenizer

    from dflash.extract.chat import check_template_kwargs, stop_token_ids
    from dflash.extract.target import load_target

    from . import replay_eval as rp
    from .speculative import captured_decoders, load_drafter

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dtype = dtype if dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    capture = device.startswith("cuda") if capture is None else capture  # uncaptured, launches decide the speed
    try:
        check_template_kwargs(template_kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if report_path:  # found out before minutes of decoding, not after
        with reading("--json"):
            Path(report_path).parent.mkdir(parents=True, exist_ok=True)
            if Path(report_path).is_dir() or not os.access(Path(report_path).parent, os.W_OK):
                raise ValueError(f"{report_path}: cannot write a report there")
    with reading("--target"):
        tokenizer = AutoTokenizer.from_pretrained(target)
    prompt_sets = {}
    for name, data in benchmarks:
        with reading(f"--prompts {name}={data}"):  # a DataError is a ValueError: named with the flag
            prompt_sets[name] = load_prompts(data, tokenizer, split=split, limit=limit, template_kwargs=template_kwargs)
        if not prompt_sets[name]:
            raise click.ClickException(f"no usable prompts in {data}")
    model = load_target(target, dtype=dtype, device=device)
    with reading("--drafter"):
        draft_model, config = load_drafter(drafter, device=device, dtype=getattr(torch, dtype))
    eos = stop_token_ids(model, tokenizer)
    room = getattr(model.config, "max_position_embeddings", None)  # past it, positions the target never saw
    longest = max(len(p) for ids in prompt_sets.values() for p in ids)
    if room and longest + max_new_tokens + config.block_size > room:
        raise click.BadParameter(f"the longest prompt ({longest} tokens), {max_new_tokens} new tokens and a block of "
                                 f"{config.block_size} run past the target's {room} positions (max_position_embeddings)"
                                 "; lower it, or --limit the prompts", param_hint="--max-new-tokens")
    click.echo(f"{', '.join(f'{n}: {len(p)}' for n, p in prompt_sets.items())} prompts, block size "
               f"{config.block_size}, layers {config.target_layer_ids}, {device} {dtype}", err=True)
    report: dict[str, Any] = {"benchmarks": {}, "settings": {
        "target": target, "drafter": drafter, "prompts": list(prompts), "split": split,
        "max_new_tokens": max_new_tokens, "spec_sample": spec_sample, "batch_size": batch_size, "capture": capture,
        "device": device, "dtype": dtype, "eos_token_ids": sorted(eos), "block_size": config.block_size,
        "target_layer_ids": list(config.target_layer_ids)}, "seconds": {"load": time.perf_counter() - started}}
    lines, decoded, timings, proposer, session = [], [], {}, draft_model, None  # decoded: ("NAME ", row) per decode
    if capture and spec_sample:  # one captured pair for every benchmark: each compiles once
        sampled = [p[i] for p in prompt_sets.values() for i in rp.sample_indices(len(p), spec_sample)]
        session, proposer = captured_decoders(model, draft_model, sampled, max_new_tokens)
    for name, ids in prompt_sets.items():
        started = time.perf_counter()
        replay = rp.replay_benchmark(model, draft_model, ids, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                                     batch_size=batch_size, progress=True)
        sample, replayed = None, time.perf_counter()
        if spec_sample:
            sample = rp.spec_sample(model, proposer, ids, replay, spec_sample, max_new_tokens=max_new_tokens,
                                    eos_token_ids=eos, progress=True, session=session)
            decoded += [(f"{name} ", row) for row in sample["per_prompt"]]
        timings[name] = {"replay": replayed - started, **replay["seconds"], "decode": time.perf_counter() - replayed,
                         "warmup": sample["warmup_seconds"] if sample else 0.0}  # warm-up: compiles and captures
        lines.append(rp.benchmark_line(name, replay, sample))
        report["benchmarks"][name] = {"summary": lines[-1], "replay": replay, "sample": sample,
                                      "seconds": timings[name]}
    click.echo(rp.format_benchmarks(lines))
    click.echo(f"seconds: load {report['seconds']['load']:.1f}" + "".join(
        f"; {name} replay {s['replay']:.1f} (generate {s['generate']:.1f}, forward {s['forward']:.1f}, drafter "
        f"{s['drafter']:.1f}), decode {s['decode']:.1f} (warm-up {s['warmup']:.1f})"
        for name, s in timings.items()), err=True)
    failed = [f"{name}{r['mismatch']}" for name, r in decoded if not r["lossless"] and not r["tie"]]
    ties = [f"{name}{r['mismatch']}" for name, r in decoded if r["tie"]]
    diverged = [f"{name}{r['divergence']}" for name, r in decoded if r.get("divergence")]
    if report_path:
        Path(report_path).write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"report -> {report_path}", err=True)
    for label, messages in (("REPLAY CHECK FAILED" if dtype == "float32" else "replay vs online (not float32)",
                             diverged), ("speculative vs greedy parted at a numerical tie (not a failure)", ties),
                            ("LOSSLESS CHECK FAILED", failed)):
        for message in messages:
            click.echo(f"{label}: {message}", err=True)
    if check and (failed or (diverged and dtype == "float32")):
        sys.exit(1)


main = cli  # the dflash-eval entry point

if __name__ == "__main__":
    cli()
