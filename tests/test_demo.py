"""The CPU demo end to end (dflash.eval.demo): a reduced run inside the suite, its
rerun reusing every step, and (slow) the demo's acceptance: online > 1 and within 10%
of the training run's offline estimate."""

from __future__ import annotations

import json
import os
import time

import pytest

from dflash.eval import demo


def _built_files(out):
    paths = [out / "target" / "model.safetensors", out / "export" / "model.safetensors", out / "eval.json",
             out / "data" / "train.jsonl", out / "run" / "metrics.jsonl"]
    paths += sorted((out / "cache.zarr").rglob("*"))
    return {str(p): p.stat().st_mtime_ns for p in paths if p.is_file()}


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    lines: list[str] = []
    t0 = time.perf_counter()
    summary = demo.run_demo(out, demo.DemoSettings.small(), echo=lines.append)
    return out, summary, lines, time.perf_counter() - t0


def test_small_demo_end_to_end(small_demo):
    out, summary, lines, _ = small_demo
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["acceptance_online"] == summary["acceptance_online"]
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "export" / "config.json").is_file() and (out / "export" / "model.safetensors").is_file()
    assert summary["lossless"] is True
    result = json.loads((out / "eval.json").read_text())
    assert all(row["lossless"] for row in result["per_prompt"]) and result["overall"]["prompts"] > 0
    assert summary["cache"]["bytes_on_disk"] > 0 and summary["training"]["seconds"] > 0
    B = summary["settings"]["train"]["block_size"]
    assert 1 <= summary["acceptance_online"] <= B and 1 <= summary["acceptance_offline"] <= B
    assert not any("reusing" in line for line in lines)


def test_small_demo_rerun_reuses(small_demo):
    out, first, _, first_seconds = small_demo
    before = _built_files(out)
    lines: list[str] = []
    t0 = time.perf_counter()
    again = demo.run_demo(out, demo.DemoSettings.small(), echo=lines.append)
    seconds = time.perf_counter() - t0
    assert _built_files(out) == before  # nothing rewritten
    text = "\n".join(lines)
    for step in ("[1/6] data: reusing", "[2/6] target: reused", "complete already", "[4/6] train: reusing",
                 "[5/6] eval: reusing"):
        assert step in text
    assert again["acceptance_online"] == first["acceptance_online"]
    assert again["acceptance_offline"] == first["acceptance_offline"]
    assert seconds < first_seconds / 2


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DFLASH_SLOW_TESTS"),
                    reason="the full demo (5-8 min on 2 cores); set DFLASH_SLOW_TESTS=1")
def test_demo_acceptance_online_matches_offline(tmp_path):
    """The demo's real settings: online tau > 1 and within 10% of the offline estimate."""
    summary = demo.run_demo(tmp_path / "demo", demo.DemoSettings.full(), echo=print)
    assert summary["lossless"] is True
    online, offline = summary["acceptance_online"], summary["acceptance_offline"]
    assert online > 1.0
    assert abs(online - offline) / offline < 0.10, (online, offline)
