"""Stage one's start: the command line reaches the workers' spawn without importing torch, zarr or
transformers, and a worker loads its model before the parent has prepared the cache root, except
where another live run holds its shard or the shard is complete already."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from dflash.extract import worker as W
from dflash.extract.target import TargetRunner, load_target
from dflash.shared import cache as C
from dflash.shared.shard_lock import ShardLock
from test_extract import LAYERS, TOPK, dataset, shard_task  # noqa: F401 - dataset: the fixture

HEAVY = ("torch", "zarr", "transformers", "datasets")

LAUNCH = """
import json, sys
from dflash.extract.cli import main
from dflash.extract.config import ExtractConfig
from dflash.extract.launch import node_layout, node_tasks
cfg = ExtractConfig(data="rows.jsonl", model="target", out="c.zarr", device="cpu", workers=2, compression_level=3)
cfg.validate()
tasks = node_tasks(cfg, node_layout())
print(json.dumps({"tasks": len(tasks), "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def test_the_command_line_reaches_the_spawn_without_torch_zarr_or_transformers():
    """What runs before the workers are spawned (the CLI module, the settings and their
    validation, the tasks) imports none of the heavy libraries: each would delay every worker's
    start by its import (seconds on a host without bytecode), the parent's own copy of them is
    imported only after the spawn."""
    proc = subprocess.run([sys.executable, "-c", LAUNCH], capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"tasks": 2, "heavy": []}, proc.stderr[-2000:]
    # the check itself sees such an import: the cache module brings torch and zarr
    proc = subprocess.run([sys.executable, "-c", LAUNCH.replace("import json, sys", "import json, sys\n"
                                                                "import dflash.shared.cache")],
                          capture_output=True, text=True, check=True)
    assert {"torch", "zarr"} <= set(json.loads(proc.stdout.strip().splitlines()[-1])["heavy"])


@pytest.fixture
def loads(monkeypatch):
    """Every model load of the worker in this process, with whether the root was ready when it
    began; ``recording.done`` is set once a load has ended."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(dict(root_ready=recording.root_ready.is_set() if recording.root_ready else None))
        model = load_target(*args, **kwargs)
        recording.done.set()
        return model

    recording.root_ready, recording.done = None, threading.Event()
    monkeypatch.setattr(W, "load_target", recording)
    return calls, recording


def run_in_thread(task, report, stop, go, root_ready):
    """``run_shard`` on a thread: (thread, outcome dict with 'record' or 'error')."""
    outcome = {}

    def body():
        threads = torch.get_num_threads()
        try:
            outcome["record"] = W.run_shard(task, report, stop, go, root_ready)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            outcome["error"] = e
        finally:
            torch.set_num_threads(threads)

    thread = threading.Thread(target=body)
    thread.start()
    return thread, outcome


def test_a_worker_loads_the_model_before_the_root_is_ready(tmp_path, dataset, tiny_target_dir, loads, monkeypatch):
    """The model is loaded (and the head set up) while the worker still waits for ``root_ready``;
    once the root is ready the run goes on with that model and writes the whole shard; then the
    shard is complete, and a rerun's worker would not load the model early."""
    calls, recording = loads
    out = tmp_path / "c.zarr"
    task = shard_task(out, dataset, tiny_target_dir, 1)
    assert W._may_load_before_the_root(task)
    stop, go, root_ready = threading.Event(), threading.Event(), threading.Event()
    recording.root_ready = root_ready
    handed = []  # the runner there is when the root is ready
    original = W._runner_for
    monkeypatch.setattr(W, "_runner_for", lambda spec, runner, *a: handed.append(runner) or original(spec, runner, *a))
    thread, outcome = run_in_thread(task, lambda *a, **k: None, stop, go, root_ready)
    assert recording.done.wait(60), outcome
    thread.join(timeout=1)
    assert thread.is_alive(), outcome  # waits for root_ready: it cannot end on its own
    assert calls == [{"root_ready": False}]
    root_ready.set()
    go.set()
    thread.join(timeout=120)
    assert "error" not in outcome, outcome
    assert calls == [{"root_ready": False}]  # loaded once, before the root was ready, and used
    assert len(handed) == 1 and isinstance(handed[0], TargetRunner)
    record = outcome["record"]
    assert record["samples"] == C.open_root(str(out))[C.shard_name(1)].attrs["planned"]["samples"] > 0
    assert not W._may_load_before_the_root(task)  # complete now


def test_a_worker_whose_shard_a_live_run_holds_loads_nothing_before_the_root_is_ready(
        tmp_path, dataset, tiny_target_dir, loads):
    """While a live process (here this one) holds the shard's lock, the worker reads it and loads
    no model before ``root_ready``; stopped there (the parent refused the run), it leaves the
    cache as it was and never loaded the model."""
    calls, recording = loads
    out = tmp_path / "c.zarr"
    task = shard_task(out, dataset, tiny_target_dir, 0)
    holder = ShardLock(str(out), 0)
    holder.acquire()
    try:
        assert not W._may_load_before_the_root(task)
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        stop, go, root_ready = threading.Event(), threading.Event(), threading.Event()
        recording.root_ready = root_ready
        planning = threading.Event()

        def report(kind, **f):
            if kind == "planning":
                planning.set()

        thread, outcome = run_in_thread(task, report, stop, go, root_ready)
        assert planning.wait(60)
        thread.join(timeout=2)  # where the model loaded first, it would have done so by now
        stop.set()  # the parent refuses the run and stops its workers
        thread.join(timeout=60)
        after = sorted(p.relative_to(out) for p in out.rglob("*"))
    finally:
        holder.release()
    assert isinstance(outcome.get("error"), W.Stopped), outcome
    assert calls == []
    assert after == before
    assert W._may_load_before_the_root(task)  # released


def test_a_runner_built_before_the_root_is_rebuilt_where_the_root_stores_other_layers(
        tmp_path, dataset, tiny_target_dir):
    """The root's layers and top-k decide: a runner set up from other settings is replaced by one
    for the root's, on the same model, and its outputs equal a runner built for them directly."""
    task = shard_task(tmp_path / "c.zarr", dataset, tiny_target_dir, 0)
    spec = C.CacheSpec.from_dict(C.open_root(str(tmp_path / "c.zarr")).attrs[C.ATTRS_KEY])
    assert spec.layer_ids == LAYERS and spec.topk == TOPK
    model = load_target(str(tiny_target_dir), dtype="float32")
    early = TargetRunner(model, [0, 1], TOPK - 1)
    timing = {}
    runner = W._runner_for(spec, early, task.cfg, torch.device("cpu"), timing)
    assert runner is not early and runner.model is model and "model_load_s" not in timing
    assert (runner.layer_ids, runner.topk) == (LAYERS, TOPK)
    assert W._runner_for(spec, runner, task.cfg, torch.device("cpu"), timing) is runner  # agrees: kept
    ids, mask, index = TargetRunner.pad_batch([torch.arange(5, 25), torch.arange(30, 40)])
    direct = TargetRunner(load_target(str(tiny_target_dir), dtype="float32"), LAYERS, TOPK)
    a, b = runner.forward(ids, mask, index), direct.forward(ids, mask, index)
    for name in ("hidden", "topk_logprobs", "topk_ids"):
        assert np.array_equal(getattr(a, name).numpy(), getattr(b, name).numpy()), name


def test_a_head_compiled_before_the_weights_equals_the_eager_head(tiny_target_dir):
    """The head's log-sum-exp compiled from the vocabulary, dtype and device alone (as a worker
    does while its model loads) gives the eager runner's outputs, bit for bit."""
    from dflash.extract.target import compile_logsumexp

    model = load_target(str(tiny_target_dir), dtype="float32")
    vocab = model.get_output_embeddings().weight.shape[0]
    compiled = compile_logsumexp(vocab, torch.float32, "cpu", 7, "eager")
    ids, mask, index = TargetRunner.pad_batch([torch.arange(5, 25), torch.arange(30, 40)])
    eager = TargetRunner(model, LAYERS, TOPK, lm_head_chunk=7).forward(ids, mask, index)
    early = TargetRunner(model, LAYERS, TOPK, lm_head_chunk=7, head_backend="eager", compiled_logsumexp=compiled)
    assert early._logsumexp is compiled
    out = early.forward(ids, mask, index)
    for name in ("hidden", "topk_logprobs", "topk_ids"):
        assert np.array_equal(getattr(out, name).numpy(), getattr(eager, name).numpy()), name
