"""Stage one end to end on the CPU: tiny Qwen3 (save_pretrained -> from_pretrained), two
processes as torchrun starts them, checked against the HF model's own outputs."""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zarr

from dflash.extract import runner as R
from dflash.extract import worker as W
from dflash.extract.chat import render
from dflash.extract.config import ExtractConfig
from dflash.extract.data import normalize_row
from dflash.extract.plan import length_bucketed_batches, shard_rows
from dflash.extract.target import TargetRunner, compute_environment, load_target
from dflash.extract.chat import load_tokenizer
from dflash.shared import cache as C
from dflash.shared import shard_lock as L

LAYERS = [0, 1, 2]  # of the 4-layer target: every layer a serving engine can capture (not L-1 = 3)
TOPK = 16
MAX_LENGTH = 96
# the CLI flags every end-to-end run here shares (the kill test reruns exactly these)
COMMON = ["--device", "cpu", "--dtype", "float32", "--shards", "2", "--cpu-threads", "1", "--layers", ",".join(map(str, LAYERS)),
          "--topk", str(TOPK), "--max-length", str(MAX_LENGTH), "--batch-tokens", "400",
          "--commit-seconds", "0", "--chunk-tokens", "64", "--no-progress"]
BAD_ROWS = {  # row index -> (row, reason it is skipped)
    3: ({"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "hi"}]}, "unknown_role"),
    11: ({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": 42}]}, "non_string_content"),
    20: ({"prompt": "no chat here"}, "missing_columns"),
    33: ({"text": "a"}, "too_short"),
}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "dflash.extract.cli"]
"""dflash-extract under torchrun, two processes (gloo on the CPU)."""


def slow_torchrun(delay_s: float) -> list[str]:
    """TORCHRUN with a sleep of ``delay_s`` before each batch (``slow_extract.py``): a run to stop midway."""
    return [*TORCHRUN[:-2], os.path.join(os.path.dirname(__file__), "slow_extract.py"), str(delay_s)]


def rank_envs(world: int, **env) -> list[dict[str, str]]:
    """The environment torchrun gives each of ``world`` processes on one node, with ``env``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [{**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env}
            for r in range(world)]


def cli(*args, check=True, world=2, **env):
    """dflash-extract in ``world`` processes with torchrun's environment, without its agent (whose own
    report of a failed rank prints a traceback); the ranks' largest exit code, their output joined."""
    procs = [subprocess.Popen([sys.executable, "-m", "dflash.extract.cli", *map(str, args)], env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in rank_envs(world, **env)]
    outs = [p.communicate(timeout=600) for p in procs]
    proc = subprocess.CompletedProcess(args, max(p.returncode for p in procs), *map("".join, zip(*outs)))
    if check and proc.returncode != 0:
        raise AssertionError(f"dflash-extract failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, chats_sample_path):
    """The 40 sample chats with four bad rows spliced in (44 rows)."""
    rows = [json.loads(line) for line in chats_sample_path.read_text().splitlines()]
    for index in sorted(BAD_ROWS):
        rows.insert(index, BAD_ROWS[index][0])
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, dataset, tiny_target_dir):
    """One unbroken run under torchrun, two processes, with --on-bad-row skip; (cache path, summary JSON)."""
    out = tmp_path_factory.mktemp("cache") / "c.zarr"
    summary = out.parent / "summary.json"
    t0 = time.monotonic()
    proc = subprocess.run([*TORCHRUN, "--data", dataset[0], "--model", tiny_target_dir, "--out", out, "--on-bad-row",
                           "skip", "--summary-json", summary, *COMMON], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"torchrun, two processes: {time.monotonic() - t0:.1f} s\n{proc.stdout}")
    return out, json.loads(summary.read_text()), proc


def shard_arrays(path, shard):
    g = C.open_root(str(path))[C.shard_name(shard)]
    return {f: np.asarray(g[f][:]) for f in C.TOKEN_FIELDS + ("offsets", "source_index", "batches")}, g.attrs.asdict()


def shard_task(out, dataset, tiny_target_dir, shard, **overrides):
    """A prepared cache at ``out`` (the two-shard layout of ``extracted``) and the task of one
    of its shards, for runs of ``run_shard`` in this process."""
    settings = dict(device="cpu", shards=2, layers=LAYERS, topk=TOPK, max_length=MAX_LENGTH, batch_tokens=400,
                    commit_seconds=0, chunk_tokens=64, on_bad_row="skip", cpu_threads=1, progress=False,
                    dtype="float32")
    cfg = ExtractConfig(data=str(dataset[0]), model=str(tiny_target_dir), out=str(out), **{**settings, **overrides})
    spec = run_spec(cfg)
    R.prepare_root(cfg, spec)
    return W.WorkerTask(cfg=cfg, spec=spec, shard_id=shard, device="cpu")


def run_shard(task, report=lambda *a, **k: None):
    """Lock, plan and extract one shard in this process as a rank does, its lock released however that
    ends; the shard's seconds (planning, then extract_shard's)."""
    from dflash.extract.data import load_source
    from dflash.extract.plan import plan_shard, shard_slice

    R.use_device(task.cfg)
    lock = L.ShardLock(task.cfg.out, task.shard_id).take(lambda m: report("warning", message=m), task.cfg.wait_for_lock)
    runners = []
    try:
        t = time.perf_counter()
        tokenizer = load_tokenizer(task.cfg)
        rows, start = shard_slice(load_source(task.cfg.data), task.cfg.shards or 1, task.shard_id)
        planned = plan_shard(rows, start, task.cfg.data, tokenizer, task.cfg)
        plan_s = time.perf_counter() - t
        return {"plan_s": plan_s, **W.extract_shard(task, planned, tokenizer.pad_token_id, lock, report, runners)}
    finally:
        lock.release()
        for runner in runners:
            runner.close()


def run_spec(cfg, num_shards=2):
    """The CacheSpec a run of ``cfg`` would write, built as the runner builds it."""
    from transformers import AutoConfig

    from dflash.extract.data import load_source

    return R.build_spec(cfg, load_tokenizer(cfg), AutoConfig.from_pretrained(cfg.model), load_source(cfg.data),
                        num_shards=num_shards)


def kill_run(pid: int) -> None:
    """``kill -9`` the process ``pid`` and every process it started (torchrun starts each of its
    processes in a session of its own), again until none is left."""
    def tree() -> list[int]:
        parents = {}
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = open(stat, "rb").read().rsplit(b")", 1)[1].split()
                if fields[0] != b"Z":  # not a zombie
                    parents[int(stat.split("/")[2])] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
        found = [pid] if pid in parents else []
        for p in found:
            found += [c for c, parent in parents.items() if parent == p]
        return found

    deadline = time.monotonic() + 10
    while (members := tree()) and time.monotonic() < deadline:
        for p in members:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def file_bytes(path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name: a byte-exact picture of a store."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def assert_same_shard(reference, out, shard):
    """Every array and attribute of the shard equal, bitwise."""
    a, a_attrs = shard_arrays(reference, shard)
    b, b_attrs = shard_arrays(out, shard)
    for f in a:
        assert a[f].dtype == b[f].dtype and np.array_equal(a[f], b[f]), (shard, f)
    assert a_attrs == b_attrs


# ----------------------------------------------------------------------------- units


def test_bucketed_batches_respect_budget_and_are_deterministic():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 500)
    source = np.arange(500) * 2
    order, batches = length_bucketed_batches(lengths, source, 1024)
    assert sorted(order.tolist()) == list(range(500))
    ordered = lengths[order]
    assert np.all(np.diff(ordered) <= 0)  # longest first
    for b0, b1 in zip(batches[:-1], batches[1:]):
        assert (b1 - b0) * ordered[b0:b1].max() <= 1024 or b1 - b0 == 1
    order2, batches2 = length_bucketed_batches(lengths, source, 1024)
    assert np.array_equal(order, order2) and np.array_equal(batches, batches2)
    assert [shard_rows(10, 3, s) for s in range(3)] == [(0, 3), (3, 6), (6, 10)]


def test_planning_counts_every_bad_row_and_names_the_first(dataset, tiny_target_dir):
    """With ``--on-bad-row skip`` every bad row of a slice is counted; with ``error`` the bad row
    reported is the first in row order, with file and row."""
    from dflash.extract.data import DataError, load_source
    from dflash.extract.plan import plan_shard

    path, rows = dataset
    cfg = ExtractConfig(data=str(path), model=str(tiny_target_dir), out="unused", device="cpu", max_length=MAX_LENGTH,
                        batch_tokens=400, on_bad_row="skip")
    tok = load_tokenizer(cfg)
    ds = load_source(str(path))
    one = plan_shard(ds, 0, str(path), tok, cfg)
    assert sum(one.plan.skipped.values()) == len(BAD_ROWS)  # every bad row counted, none dropped silently

    clean = [r for i, r in enumerate(rows) if i not in BAD_ROWS or BAD_ROWS[i][1] == "too_short"]
    clean[39] = BAD_ROWS[20][0]  # missing_columns, late in the slice
    clean[28] = BAD_ROWS[3][0]  # unknown_role, earlier: the one to report
    bad = path.parent / "late_bad_rows.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in clean))
    cfg = dataclasses.replace(cfg, data=str(bad), on_bad_row="error")
    with pytest.raises(DataError) as err:
        plan_shard(load_source(str(bad)), 0, str(bad), tok, cfg)
    assert str(err.value).startswith(f"{bad} row 28: unknown role 'robot'") and err.value.reason == "unknown_role"

    # rows are tokenised in batches after their template renders: a row that fails once tokenised (too long) still
    # comes before a later one whose rendering fails (row 28), in the same batch
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    mixed = [short] * 2 + [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "word " * 400}]},
                           short, BAD_ROWS[3][0], short]
    bad.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    with pytest.raises(DataError) as err:
        plan_shard(load_source(str(bad)), 0, str(bad), tok, dataclasses.replace(cfg, truncation="error"))
    assert str(err.value).startswith(f"{bad} row 2: ") and err.value.reason == "too_long"


def test_planning_in_batches_equals_one_row_at_a_time(chats_sample_path, tiny_target_dir):
    """Rows are tokenised a batch at a time, chats and text rows apart: every planned sample is the one ``render``
    gives for its row alone, its ids the template's own (or the tokenizer's for a text row), across batches."""
    from tokenizers.processors import TemplateProcessing

    from dflash.extract.chat import render
    from dflash.extract.data import normalize_row
    from dflash.extract.plan import PLAN_ROWS, plan_shard

    chats = [json.loads(line) for line in chats_sample_path.read_text().splitlines()]
    rows = [chats[i % len(chats)] if i % 3 else {"text": f"plain text row {i} " * (1 + i % 5)}
            for i in range(PLAN_ROWS + 50)]
    cfg = ExtractConfig(data="rows", model=str(tiny_target_dir), out="unused", device="cpu", max_length=4096)
    tok = load_tokenizer(cfg)  # a fresh copy, given a BOS: text rows take it, chats write their own special tokens
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.eos_token} $A", special_tokens=[(tok.eos_token, tok.eos_token_id)])
    assert tok("text")["input_ids"][0] == tok.eos_token_id
    planned = plan_shard(rows, 10, "rows", tok, cfg)
    assert planned.plan.source_index.tolist() == sorted(planned.plan.source_index.tolist(), key=lambda i: (
        -len(render(tok, normalize_row(rows[i - 10], i, "rows"), max_length=4096).input_ids), i))
    ends = np.cumsum(planned.plan.lengths)
    for index, end, length in zip(planned.plan.source_index, ends, planned.plan.lengths):
        row = rows[index - 10]
        alone = render(tok, normalize_row(row, index, "rows"), max_length=4096)
        ids, mask = planned.input_ids[end - length:end], planned.loss_mask[end - length:end]
        assert np.array_equal(ids, alone.input_ids) and np.array_equal(mask, alone.loss_mask), index
        own = tok(row["text"])["input_ids"] if "text" in row else tok.apply_chat_template(row["messages"], tokenize=True)
        assert ids.tolist() == list(getattr(own, "input_ids", own)), index


def test_batched_equals_unbatched_and_hf(tiny_target_dir):
    """fp32 on CPU: padded batch == one sample at a time == HF output_hidden_states / logits."""
    model = load_target(str(tiny_target_dir), dtype="float32")
    runner = TargetRunner(model, LAYERS, TOPK, lm_head_chunk=7)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (23, 5, 17, 1, 40)]
    batched = runner.forward(*TargetRunner.pad_batch(samples, pad_id=0))
    off = 0
    for s in samples:
        single = runner.forward(*TargetRunner.pad_batch([s]))
        n = len(s)
        torch.testing.assert_close(batched.hidden[off:off + n], single.hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.topk_logprobs[off:off + n], single.topk_logprobs, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            ref = model(s[None], output_hidden_states=True)
        for slot, layer in enumerate(LAYERS):
            torch.testing.assert_close(single.hidden[:, slot], ref.hidden_states[layer + 1][0], rtol=1e-5, atol=1e-5)
        ref_lp = torch.log_softmax(ref.logits[0].float(), -1)
        values, ids = torch.topk(ref_lp, TOPK, -1)
        torch.testing.assert_close(single.topk_logprobs, values, rtol=1e-5, atol=1e-5)
        assert torch.equal(single.topk_ids.long(), ids)
        off += n
    runner.close()


def test_compiled_head_compiles_once_and_matches_eager(tiny_target_dir):
    """The head's log-sum-exp compiled with a dynamic row count: one graph at construction for
    every chunk size but 1 (dynamo specialises it: one more), the same top-k as eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = load_target(str(tiny_target_dir), dtype="float32")
    eager = TargetRunner(model, LAYERS, TOPK, lm_head_chunk=7)
    graphs = int(counters["stats"]["unique_graphs"])
    compiled = TargetRunner(model, LAYERS, TOPK, lm_head_chunk=7, head_backend="eager")
    assert int(counters["stats"]["unique_graphs"]) == graphs + 1
    g = torch.Generator().manual_seed(1)
    for lengths in [(23, 5, 17), (12,), (20,), (9,), (40, 33, 2), (8,)]:  # last chunks of 3, 5, 6, 2, 5, then 1 row
        samples = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lengths]
        a, b = (r.forward(*TargetRunner.pad_batch(samples)) for r in (eager, compiled))
        assert torch.equal(a.topk_ids, b.topk_ids)
        torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, rtol=0, atol=1e-6)
    assert int(counters["stats"]["unique_graphs"]) == graphs + 2
    eager.close()
    compiled.close()


# ----------------------------------------------------------------------------- end to end


def test_cache_matches_hf_reference(extracted, dataset, tiny_target_dir):
    out, summary, _ = extracted
    path, rows = dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    reader = C.CacheReader(str(out))
    assert reader.complete and reader.spec.layer_ids == LAYERS and reader.spec.topk == TOPK
    assert len(reader) == len(rows) - len(BAD_ROWS)
    truncated = 0
    for i in range(len(reader)):
        s = reader[i]
        row = s["source_index"]
        ids, mask = render(tokenizer, normalize_row(rows[row], row, str(path)), max_length=MAX_LENGTH,
                           truncation="right")
        truncated += len(ids) == MAX_LENGTH
        assert torch.equal(s["input_ids"], torch.from_numpy(ids).long())
        assert torch.equal(s["loss_mask"], torch.from_numpy(mask))
        with torch.no_grad():
            ref = model(s["input_ids"][None], output_hidden_states=True)
        for slot, layer in enumerate(LAYERS):  # cached bf16 vs the HF fp32 reference rounded to bf16
            torch.testing.assert_close(s["hidden"][:, slot].float(), ref.hidden_states[layer + 1][0].bfloat16().float(),
                                       rtol=2 ** -7, atol=1e-5)
        ref_lp = torch.log_softmax(ref.logits[0].float(), -1)
        values, _ = torch.topk(ref_lp, TOPK, -1)
        torch.testing.assert_close(s["topk_logprobs"], values, rtol=1e-5, atol=1e-5)
        # ids: the reference's log-prob at every stored id is the stored log-prob (robust to exact ties)
        torch.testing.assert_close(ref_lp.gather(1, s["topk_ids"]), s["topk_logprobs"], rtol=1e-5, atol=1e-5)
    assert truncated > 0  # the settings exercised right truncation
    assert summary["tokens"] == reader.num_tokens and summary["complete"]


def test_two_workers_write_every_row_once(extracted, dataset):
    out, summary, proc = extracted
    _, rows = dataset
    reader = C.CacheReader(str(out))
    assert [s.shard_id for s in reader.shards] == [0, 1]
    sources = reader.source_indices().tolist()
    assert len(sources) == len(set(sources))
    assert sorted(sources) == [r for r in range(len(rows)) if r not in BAD_ROWS]
    for shard in reader.shards:  # each shard holds exactly its contiguous slice
        lo, hi = shard_rows(len(rows), 2, shard.shard_id)
        _, attrs = shard_arrays(out, shard.shard_id)
        mine = shard_arrays(out, shard.shard_id)[0]["source_index"]
        assert mine.min() >= lo and mine.max() < hi
        assert sum(attrs["skipped"].values()) == sum(lo <= r < hi for r in BAD_ROWS)
    expected = {}
    for _, reason in BAD_ROWS.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert summary["skipped"] == expected
    assert "skipped rows     4" in proc.stdout and "unknown_role=1" in proc.stdout
    assert summary["assistant_tokens"] == sum(int(reader[i]["loss_mask"].sum()) for i in range(len(reader)))
    assert summary["hidden_compression"] > 1.0 and summary["bytes_stored"] > 0
    root = zarr.open_group(str(out), mode="r")
    fp = root.attrs[C.ATTRS_KEY]["fingerprint"]
    assert set(fp) == {"target", "tokenizer", "dataset", "extraction"}
    assert fp["extraction"]["num_shards"] == 2 and fp["extraction"]["layers"] == LAYERS
    assert fp["target"]["weights_hash"] and fp["dataset"]["content_hash"].startswith("sha256:")


def test_summary_counts_as_dflash_cache_info_does(extracted, tiny_target_dir):
    """The run's closing summary is cache_info's count of the same shards, and both agree with
    the chunk files on disk and the arrays read back."""
    from transformers import AutoConfig

    from dflash.shared.inspect import cache_info

    out, summary, proc = extracted
    info = cache_info(str(out))
    chunk_files = [f for f in out.glob("shards/*/*/c/**/*") if f.is_file()]  # complete: every chunk committed
    hidden_files = [f for f in chunk_files if f.relative_to(out).parts[2] == "hidden"]
    assert summary["bytes_stored"] == info["committed_bytes_on_disk"]["total"] == sum(f.stat().st_size for f in chunk_files)
    assert summary["hidden_bytes_stored"] == info["committed_bytes_on_disk"]["hidden"] \
        == sum(f.stat().st_size for f in hidden_files)
    reader = C.CacheReader(str(out))
    tokens = int(reader.lengths().sum())
    hidden_size = AutoConfig.from_pretrained(tiny_target_dir).hidden_size
    assert summary["hidden_bytes_raw_bf16"] == tokens * len(LAYERS) * hidden_size * 2
    assert summary["hidden_compression"] == pytest.approx(summary["hidden_bytes_raw_bf16"] / summary["hidden_bytes_stored"])
    for key in ("samples", "planned_samples", "tokens", "assistant_tokens", "skipped", "complete"):
        assert summary[key] == info[key], key
    assert summary["samples"] == len(reader) and summary["tokens"] == tokens
    node = R.summarize(str(out), [1])  # one node's shards only
    assert node["samples"] == reader.shards[1].samples and node["bytes_stored"] == sum(
        f.stat().st_size for f in chunk_files if f.relative_to(out).parts[1] == "00001")
    assert f"{summary['samples']:,} of {summary['planned_samples']:,} planned" in proc.stdout


def test_summary_says_where_the_loops_time_went(extracted):
    _, summary, proc = extracted
    timing = summary["worker_seconds"].values()
    share = sum(t["submit_blocked"] for t in timing) / sum(t["loop_s"] for t in timing)
    assert "of it waiting for the writers" in proc.stdout and f"{share:.0%} of it waiting" in proc.stdout
    worker = {"loop_s": 10.0, "cpu_s": 70.0, "drain_s": 0.3, "writer_busy": 9.9, "writer_idle": 0.1,
              "submit_blocked": 2.0, "gpu_busy": 8.0, "gpu_gap": 0.5}
    text = R.format_summary({**summary, "worker_seconds": {"00000": worker, "00001": {**worker, "submit_blocked": 0.4}}})
    assert "forward loops    20.0 s, 12% of it waiting for the writers; GPU busy 80%" in text
    assert "writer-bound" in text and "7.0 CPU cores per worker" in text
    text = R.format_summary({**summary, "worker_seconds": {"00000": {**worker, "submit_blocked": 0.9}}})
    assert "9% of it waiting" in text and "writer-bound" not in text
    short = {**worker, "loop_s": 5.0, "submit_blocked": 2.0}  # start-up dominates: no verdict
    text = R.format_summary({**summary, "worker_seconds": {"00000": short}})
    assert "40% of it waiting" in text and "writer-bound" not in text


def test_summary_times_the_start(extracted):
    """The summary gives rank 0's steps up to its first batch and after its last; each shard says
    how long its planning, model load and head took."""
    _, summary, _ = extracted
    assert {"cache_root", "planning", "writer_start", "forward_loop"} <= set(summary["phases"]["seconds"])
    for t in summary["worker_seconds"].values():
        assert {"plan_s", "model_load_s", "head_setup_s"} <= set(t), t


def test_complete_rerun_is_noop(extracted, dataset, tiny_target_dir):
    out, _, _ = extracted
    before = {s: shard_arrays(out, s)[1] for s in (0, 1)}
    proc = cli("--data", dataset[0], "--model", tiny_target_dir, "--out", out, "--on-bad-row", "skip", *COMMON)
    assert "already complete, nothing to do" in proc.stdout
    assert {s: shard_arrays(out, s)[1] for s in (0, 1)} == before


def test_other_fingerprint_refused(extracted, dataset, tiny_target_dir):
    """A cache with committed samples is never replaced: another fingerprint is refused, every file untouched."""
    out, _, _ = extracted
    before = file_bytes(out)
    args = [a if a != str(TOPK) else "8" for a in COMMON]
    proc = cli("--data", dataset[0], "--model", tiny_target_dir, "--out", out, "--on-bad-row", "skip", *args,
               check=False)
    assert proc.returncode == 1
    assert "another fingerprint" in proc.stderr and "topk: cache has 16, run has 8" in proc.stderr
    assert "Traceback" not in proc.stderr
    # another attention kernel rounds differently: a resume with it is refused too
    proc = cli("--data", dataset[0], "--model", tiny_target_dir, "--out", out, "--on-bad-row", "skip", *COMMON,
               "--attn-implementation", "eager", check=False)
    assert proc.returncode == 1
    assert "attn_implementation: cache has 'sdpa', run has 'eager'" in proc.stderr
    assert file_bytes(out) == before


def test_moved_data_and_target_are_the_same_cache(extracted, dataset, tiny_target_dir, tmp_path):
    """Local data and checkpoints are known by their content: a copy elsewhere reopens the
    cache (the rerun finds it complete); the copy with one row changed is refused, named."""
    import shutil

    out, _, _ = extracted
    data = tmp_path / "elsewhere" / "chats.jsonl"
    data.parent.mkdir()
    shutil.copy(dataset[0], data)
    target = shutil.copytree(tiny_target_dir, tmp_path / "target-copy")
    proc = cli("--data", data, "--model", target, "--out", out, "--on-bad-row", "skip", *COMMON)
    assert "already complete, nothing to do" in proc.stdout
    info = C.CacheReader(str(out)).spec.info
    assert info["dataset_source"] == str(dataset[0]) and info["target_path"] == str(tiny_target_dir)
    lines = data.read_text().splitlines()
    lines[0] = lines[0].replace('"content": "', '"content": "changed ', 1)
    data.write_text("\n".join(lines) + "\n")
    proc = cli("--data", data, "--model", target, "--out", out, "--on-bad-row", "skip", *COMMON, check=False)
    assert proc.returncode == 1 and "dataset.content_hash" in proc.stderr


def test_bad_row_error_names_file_and_row_and_the_fix_runs_at_the_same_out(tmp_path, dataset, tiny_target_dir,
                                                                            chats_sample_path):
    """A run stopped by a bad row names file and row; it committed nothing, so the corrected data
    at the same --out is extracted (the root it left is replaced, saying so), not refused."""
    path, _ = dataset
    out = tmp_path / "c.zarr"
    proc = cli("--data", path, "--model", tiny_target_dir, "--out", out, *COMMON, check=False)
    assert proc.returncode == 1
    assert f"{path} row 3: unknown role 'robot'" in proc.stderr  # shard 0's first bad row
    assert "--on-bad-row skip" in proc.stderr and "Traceback" not in proc.stderr
    assert C.committed_samples(C.open_root(str(out))) == 0  # what the failed run left
    proc = cli("--data", chats_sample_path, "--model", tiny_target_dir, "--out", out, *COMMON)
    assert "replacing a cache root made with another fingerprint" in proc.stderr
    assert "dataset.content_hash" in proc.stderr  # the differences it had, in the log
    reader = C.CacheReader(str(out))
    assert reader.complete and sorted(reader.source_indices().tolist()) == list(range(40))


def test_kill9_then_resume_is_bitwise_identical(tmp_path, extracted, dataset, tiny_target_dir):
    """Killed mid-run (torchrun and its processes), rerun: equal to the unbroken run."""
    reference, _, _ = extracted
    out = tmp_path / "killed.zarr"
    flags = ["--data", str(dataset[0]), "--model", str(tiny_target_dir), "--out", str(out), "--on-bad-row", "skip",
             *COMMON]
    proc = subprocess.Popen([*slow_torchrun(0.25), *flags], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                commits = [zarr.open_group(str(out), mode="r")[C.shard_name(s)].attrs["commit"]["batches"]
                           for s in (0, 1)]
                if max(commits) >= 1:
                    break
            except Exception:  # noqa: BLE001 - not created yet
                pass
            time.sleep(0.05)
        else:
            raise AssertionError("no commit became visible within 60 s")
    finally:
        kill_run(proc.pid)
        proc.wait()
    states = [C.open_root(str(out))[C.shard_name(s)].attrs.asdict() for s in (0, 1)]
    assert not all(a["complete"] for a in states), "the run finished before the kill: nothing was tested"
    rerun = subprocess.run([*TORCHRUN, *flags], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "complete" in rerun.stdout
    for s in (0, 1):
        assert_same_shard(reference, out, s)
    roots = [zarr.open_group(str(path), mode="r").attrs.asdict() for path in (reference, out)]
    assert roots[0] == roots[1]


def test_io_error_stops_cleanly_then_resumes(tmp_path, extracted, dataset, tiny_target_dir, monkeypatch):
    """A store that fails mid-run (disk full) stops the shard with a resume message; nothing
    past the last good commit is recorded; the resumed shard equals the unbroken one."""
    reference, _, _ = extracted
    out = tmp_path / "c.zarr"
    task = shard_task(out, dataset, tiny_target_dir, 0)

    commits = []
    real_commit = C.ShardWriter.commit

    def commit_then_fill_disk(self):
        record = real_commit(self)
        commits.append(record)
        if len(commits) == 2:  # from now on every store write fails, as on a full disk
            async def full(*a, **k):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(zarr.storage.LocalStore, "set", full)
        return record

    monkeypatch.setattr(C.ShardWriter, "commit", commit_then_fill_disk)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(W.WriterFailed) as err:
            run_shard(task)
        message = W.describe_error(err.value, task)
        monkeypatch.undo()
        assert "No space left on device" in message and "rerun the same command to resume" in message
        attrs = C.open_root(str(out))[C.shard_name(0)].attrs.asdict()
        assert attrs["commit"] == commits[1] and not attrs["complete"]  # nothing beyond the last good batch
        assert C.CacheReader(str(out)).shards[0].samples == commits[1]["samples"]
        run_shard(task)  # the rerun resumes
    finally:
        torch.set_num_threads(threads)
    assert_same_shard(reference, out, 0)


def test_a_chunk_zarrs_cannot_store_stops_cleanly_then_resumes(tmp_path, extracted, dataset, tiny_target_dir):
    """A chunk the zarrs pipeline cannot store (an I/O error inside its Rust code): the shard
    stops with the resume message, its commit record covers only chunks stored before, and
    the rerun gives the unbroken shard."""
    reference, _, _ = extracted
    out = tmp_path / "c.zarr"
    task = shard_task(out, dataset, tiny_target_dir, 0)
    bad_chunk = 5  # tokens 320..383: inside the first batch of 400 tokens or at the next
    blocker = out / "shards" / "00000" / "hidden" / "c" / str(bad_chunk)
    threads = torch.get_num_threads()
    try:
        def report(kind, **f):  # the shard's arrays exist once it is planned: block the chunk then
            if kind == "planned":
                blocker.parent.mkdir(parents=True, exist_ok=True)
                blocker.write_text("")  # a file where the chunk's folder goes
        with pytest.raises(W.WriterFailed) as err:
            run_shard(task, report)
        message = W.describe_error(err.value, task)
        assert "not a directory" in message.lower() and "rerun the same command to resume" in message
        attrs = C.open_root(str(out))[C.shard_name(0)].attrs.asdict()
        assert attrs["commit"]["tokens"] <= bad_chunk * 64 and not attrs["complete"]
        blocker.unlink()
        t = run_shard(task)  # the rerun resumes
    finally:
        torch.set_num_threads(threads)
    assert_same_shard(reference, out, 0)
    # where the rerun's time went: before the loop (planning, model load) and in it
    assert t["plan_s"] > 0 and t["model_load_s"] > 0 and t["loop_s"] > 0 and t["cpu_s"] > 0


def test_a_shard_resumes_only_where_it_was_computed(tmp_path, extracted, dataset, tiny_target_dir, monkeypatch):
    """The worker records what computed the shard; stopped after its first batches (Ctrl-C, or
    torchrun's SIGTERM: commit what is written), the shard refuses to resume under another compute
    environment (here another CPU thread count, which changes CPU kernels' reduction order),
    naming the difference, and resumes under the same one to the unbroken shard."""
    reference, _, _ = extracted
    out = tmp_path / "c.zarr"
    task = shard_task(out, dataset, tiny_target_dir, 0)
    forward, calls = TargetRunner.forward, []

    def forward_then_stop(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(self, *args)

    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(TargetRunner, "forward", forward_then_stop)
        with pytest.raises(KeyboardInterrupt):
            run_shard(task)
        monkeypatch.undo()
        attrs = C.open_root(str(out))[C.shard_name(0)].attrs.asdict()
        assert 0 < attrs["commit"]["samples"] < attrs["planned"]["samples"]
        torch.set_num_threads(1)
        assert attrs["compute"] == compute_environment(torch.device("cpu"))
        assert attrs["compute"]["device"].endswith("x1 threads") and attrs["compute"]["torch"] == torch.__version__
        other = dataclasses.replace(task, cfg=dataclasses.replace(task.cfg, cpu_threads=2))
        with pytest.raises(C.CacheError) as err:
            run_shard(other)
        message = W.describe_error(err.value, other)
        assert message.startswith("shard 00000: ") and "x1 threads' then" in message and "x2 threads' now" in message
        run_shard(task)  # where it was started: resumes
    finally:
        torch.set_num_threads(threads)
    assert_same_shard(reference, out, 0)


def test_two_processes_on_an_fsspec_url_equal_torchruns(tmp_path, extracted, dataset, tiny_target_dir):
    """Two processes as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, ... set), writing
    through fsspec to a file:// URL of a folder that does not exist yet (zarr's own pipeline: zarrs
    writes local folders only): the shards equal the torchrun run's, and `dflash-cache info` lists the same bytes
    through the URL as by walking the folder."""
    reference, _, _ = extracted
    out = tmp_path / "c.zarr"
    cli("--data", dataset[0], "--model", tiny_target_dir, "--out", f"file://{out}", "--on-bad-row", "skip", *COMMON)
    for s in (0, 1):
        assert_same_shard(reference, out, s)
    fingerprints = [zarr.open_group(str(p), mode="r").attrs[C.ATTRS_KEY]["fingerprint"] for p in (reference, out)]
    assert fingerprints[0] == fingerprints[1]
    from dflash.shared.inspect import cache_info

    by_url, by_path = cache_info(f"file://{out}"), cache_info(str(out))
    for key in ("bytes_on_disk", "committed_bytes_on_disk", "shards"):
        assert by_url[key] == by_path[key]


def test_another_shard_count_is_refused_naming_the_flag(extracted, dataset, tiny_target_dir):
    """A resume with another number of shards (another torchrun WORLD_SIZE, or --shards) is refused,
    naming --shards, and the cache is left byte-identical."""
    out, _, _ = extracted
    before = file_bytes(out)
    task = shard_task(out, dataset, tiny_target_dir, 0)  # the same settings reopen it
    cfg = dataclasses.replace(task.cfg, shards=3)
    with pytest.raises(R.ExtractFailed, match=r"num_shards: cache has 2, run has 3  \[--shards"):
        R.prepare_root(cfg, run_spec(cfg, num_shards=3))
    assert file_bytes(out) == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_matches_hf_on_the_gpu(tmp_path, dataset, tiny_target_dir):
    """The CUDA path (pinned buffers, side-stream copies, events) stores what HF computes on the GPU."""
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dflash.extract.data import load_source

    out = tmp_path / "c.zarr"
    cfg = ExtractConfig(data=str(dataset[0]), model=str(tiny_target_dir), out=str(out), device="cuda",
                        layers=LAYERS, topk=TOPK, max_length=MAX_LENGTH, batch_tokens=400, commit_seconds=0,
                        chunk_tokens=64, on_bad_row="skip", progress=False, dtype="float32", queue_depth=1)
    spec = R.build_spec(cfg, AutoTokenizer.from_pretrained(cfg.model), AutoConfig.from_pretrained(cfg.model),
                        load_source(cfg.data), num_shards=1)
    R.prepare_root(cfg, spec)
    switch = sys.getswitchinterval()
    try:
        timing = run_shard(W.WorkerTask(cfg=cfg, spec=spec, shard_id=0, device="cuda:0"))
    finally:
        sys.setswitchinterval(switch)
    # the GPU's seconds inside and between batches fit in the loop's wall time
    assert timing["gpu_busy"] > 0 and timing["gpu_gap"] >= 0
    assert timing["gpu_busy"] + timing["gpu_gap"] <= timing["loop_s"]
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).cuda().eval()
    reader = C.CacheReader(str(out))
    assert reader.complete and len(reader) == len(dataset[1]) - len(BAD_ROWS)
    for i in range(len(reader)):
        s = reader[i]
        with torch.no_grad():
            ref = model(s["input_ids"][None].cuda(), output_hidden_states=True)
        for slot, layer in enumerate(LAYERS):
            torch.testing.assert_close(s["hidden"][:, slot].float(),
                                       ref.hidden_states[layer + 1][0].bfloat16().float().cpu(), rtol=2 ** -7, atol=1e-4)
        values = torch.topk(torch.log_softmax(ref.logits[0].float(), -1), TOPK, -1).values.cpu()
        torch.testing.assert_close(s["topk_logprobs"], values, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- chat-template flags


FLAGGED_TEMPLATE = (  # the toy template's turns, an empty think block on request, assistant turns ended by <|endoftext|>
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] }}"
    "{% endgeneration %}"
    "{{- '<|endoftext|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
FLAGGED_KWARGS = {"enable_thinking": False}
FLAGGED_EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(FLAGGED_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def flagged(tmp_path_factory, chats_sample_path, tiny_target_dir, template_file):
    """A two-worker CLI run over the 40 sample chats with all three template flags; the cache path."""
    out = tmp_path_factory.mktemp("flagged") / "c.zarr"
    cli("--data", chats_sample_path, "--model", tiny_target_dir, "--out", out, "--chat-template", template_file,
        "--template-kwargs", json.dumps(FLAGGED_KWARGS), "--end-of-turn", FLAGGED_EOT, *COMMON)
    return out


def flagged_config(chats_sample_path, tiny_target_dir, template_file, out, **changes):
    """The ExtractConfig of the ``flagged`` run (its CLI flags as fields), with ``changes``."""
    cfg = ExtractConfig(data=str(chats_sample_path), model=str(tiny_target_dir), out=str(out), device="cpu",
                        shards=2, layers=LAYERS, topk=TOPK, max_length=MAX_LENGTH, batch_tokens=400,
                        commit_seconds=0, chunk_tokens=64, cpu_threads=1, progress=False, dtype="float32",
                        chat_template=str(template_file), template_kwargs=dict(FLAGGED_KWARGS),
                        end_of_turn=FLAGGED_EOT)
    return dataclasses.replace(cfg, **changes)


def hf_rendering(tokenizer, messages, template, end_of_turn, **template_kwargs):
    """(ids, mask) from HF alone: apply_chat_template with this template and these arguments, and
    its own assistant mask from the generation tags, each span closed by the end-of-turn token
    that follows it."""
    enc = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **template_kwargs)
    ids, mask = np.asarray(enc["input_ids"]), np.asarray(enc["assistant_masks"], dtype=bool)
    closes = np.flatnonzero(mask[:-1] & ~mask[1:] & (ids[1:] == tokenizer.convert_tokens_to_ids(end_of_turn))) + 1
    mask[closes] = True
    return ids, mask


def test_template_flags_reach_every_stored_sample(flagged, chats_sample_path, tiny_target_dir):
    """--chat-template, --template-kwargs and --end-of-turn through the CLI and both workers: every
    sample is what HF renders with that template and those arguments, its mask HF's assistant mask
    closed by that end-of-turn token (not the tokenizer's own template, which renders otherwise);
    the fingerprint records the template actually used and both settings."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    rows = [json.loads(line) for line in chats_sample_path.read_text().splitlines()]
    reader = C.CacheReader(str(flagged))
    assert reader.complete and len(reader) == len(rows)
    eot_id = tokenizer.convert_tokens_to_ids(FLAGGED_EOT)
    for i in range(len(reader)):
        s = reader[i]
        messages = rows[s["source_index"]]["messages"]
        ids, mask = hf_rendering(tokenizer, messages, FLAGGED_TEMPLATE, FLAGGED_EOT, **FLAGGED_KWARGS)
        n = len(s["input_ids"])
        assert n == min(len(ids), MAX_LENGTH)
        assert s["input_ids"].tolist() == ids[:n].tolist() and s["loss_mask"].tolist() == mask[:n].tolist()
        own = tokenizer.apply_chat_template(messages, tokenize=True)
        assert list(own[:n]) != s["input_ids"].tolist()
    assert reader[0]["loss_mask"][reader[0]["input_ids"] == eot_id].all()  # the end of turn is learnt
    fp = reader.spec.fingerprint
    assert fp["tokenizer"]["chat_template_hash"] == hashlib.sha256(FLAGGED_TEMPLATE.encode()).hexdigest()
    rendering = fp["extraction"]["chat_template"]
    assert rendering["template_kwargs"] == FLAGGED_KWARGS and rendering["end_of_turn"] == FLAGGED_EOT
    assert rendering["end_of_turn_id"] == eot_id


def test_info_shows_the_template_flags(flagged, extracted, template_file, tiny_target_dir):
    from click.testing import CliRunner
    from transformers import AutoTokenizer

    from dflash.shared.cache_cli import main as cache_main

    eot_id = AutoTokenizer.from_pretrained(tiny_target_dir).convert_tokens_to_ids(FLAGGED_EOT)
    template_hash = hashlib.sha256(FLAGGED_TEMPLATE.encode()).hexdigest()
    result = CliRunner().invoke(cache_main, ["info", str(flagged), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["fingerprint"]["chat_template"] == {
        "hash": template_hash, "file": str(template_file), "template_kwargs": FLAGGED_KWARGS,
        "end_of_turn": FLAGGED_EOT, "end_of_turn_id": eot_id, "mask_method": "generation_tags"}
    text = CliRunner().invoke(cache_main, ["info", str(flagged)]).output
    line = next(x for x in text.splitlines() if x.startswith("chat "))
    assert f"template {template_hash[:12]} from {template_file}" in line
    assert 'kwargs {"enable_thinking": false}' in line and f"'{FLAGGED_EOT}' (id {eot_id}, --end-of-turn)" in line
    default = CliRunner().invoke(cache_main, ["info", str(extracted[0])]).output
    line = next(x for x in default.splitlines() if x.startswith("chat "))
    assert "the tokenizer's" in line and "kwargs {}" in line and "(from the template)" in line


@pytest.mark.parametrize("change, named", [
    ("chat_template", "fingerprint.tokenizer.chat_template_hash: cache has '{old}', run has '{new}'  "
                      "[the chat template (--chat-template, or the tokenizer's own)]"),
    ("template_kwargs", "fingerprint.extraction.chat_template.template_kwargs.enable_thinking: cache has False, "
                        "run has True  [--template-kwargs]"),
    ("end_of_turn", "fingerprint.extraction.chat_template.end_of_turn: cache has '<|endoftext|>', "
                    "run has '<|im_end|>'  [--end-of-turn]"),
])
def test_resume_with_another_template_flag_is_refused(flagged, chats_sample_path, tiny_target_dir, template_file,
                                                      tmp_path, change, named):
    """A resume with one template flag changed is refused, naming that flag's entry and nothing
    else but what it implies; the cache is left byte-identical."""
    from dflash.eval.toy_tokenizer import chat_template

    other_template = tmp_path / "toy.jinja"
    other_template.write_text(chat_template(generation_tags=True))
    value = {"chat_template": str(other_template), "template_kwargs": {"enable_thinking": True},
             "end_of_turn": "<|im_end|>"}[change]
    same = flagged_config(chats_sample_path, tiny_target_dir, template_file, flagged)
    R.prepare_root(same, run_spec(same))  # unchanged flags: reopens
    before = file_bytes(flagged)
    cfg = dataclasses.replace(same, **{change: value})
    with pytest.raises(R.ExtractFailed) as err:
        R.prepare_root(cfg, run_spec(cfg))
    message = str(err.value)
    old, new = (hashlib.sha256(t.encode()).hexdigest() for t in (FLAGGED_TEMPLATE, other_template.read_text()))
    assert "another fingerprint" in message and named.format(old=old, new=new) in message
    differences = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(differences) == (2 if change == "end_of_turn" else 1)  # another token: another id too
    assert file_bytes(flagged) == before


def test_resume_without_a_template_flag_is_refused_by_the_cli(flagged, chats_sample_path, tiny_target_dir,
                                                              template_file):
    proc = cli("--data", chats_sample_path, "--model", tiny_target_dir, "--out", flagged, "--chat-template",
               template_file, "--end-of-turn", FLAGGED_EOT, *COMMON, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("template_kwargs.enable_thinking: cache has False, missing in run  [--template-kwargs]"
            in proc.stderr), proc.stderr


def test_template_flags_are_checked_before_any_work(tmp_path, chats_sample_path, tiny_target_dir):
    """Each bad value stops the CLI with a message naming the flag and the problem, and writes nothing."""
    from click.testing import CliRunner

    from dflash.extract.cli import main as extract_main

    out = tmp_path / "c.zarr"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message['content'] }}")
    base = ["--data", str(chats_sample_path), "--model", str(tiny_target_dir), "--out", str(out), "--device", "cpu",
            "--no-progress"]
    cases = [
        (["--template-kwargs", '{"enable_thinking": fal'], 2, "not valid JSON"),
        (["--template-kwargs", "[1, 2]"], 2, "expected a JSON object"),
        (["--template-kwargs", '{"add_generation_prompt": true}'], 2, "cannot set ['add_generation_prompt']"),
        (["--chat-template", str(tmp_path / "missing.jinja")], 2, "does not exist"),
        (["--chat-template", str(broken)], 1, f"--chat-template {broken}: not a valid Jinja template"),
        (["--end-of-turn", "<|nope|>"], 1, "--end-of-turn '<|nope|>' is not a token of the vocabulary"),
    ]
    for flags, code, message in cases:
        result = CliRunner().invoke(extract_main, base + flags)
        assert result.exit_code == code and message in result.output, (flags, result.output)
        assert not out.exists()


def test_a_bad_row_in_one_slice_stops_every_process_before_any_shard_exists(tmp_path, chats_sample_path,
                                                                           tiny_target_dir):
    """A bad row in shard 1's slice only: its process names file and row, the other one stops
    too, before either has created its shard."""
    rows = chats_sample_path.read_text().splitlines()
    rows[-1] = json.dumps(BAD_ROWS[3][0])
    data = tmp_path / "late_bad_row.jsonl"
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "c.zarr"
    proc = cli("--data", data, "--model", tiny_target_dir, "--out", out, *COMMON, check=False)
    assert proc.returncode == 1 and f"{data} row {len(rows) - 1}: unknown role 'robot'" in proc.stderr
    assert "stopped: rank 1 failed" in proc.stderr and "Traceback" not in proc.stderr
    assert list(C.open_root(str(out))["shards"].group_keys()) == []


def test_the_shard_writer_uses_zarrs_for_a_folder_and_zarrs_own_pipeline_for_a_url(tmp_path, tiny_target_dir):
    """The worker's zarr settings: the zarrs pipeline where the cache is a local folder, zarr's
    own for an fsspec URL (where zarrs would warn and fall back), both reading back what they
    wrote."""
    import warnings

    from dflash.shared.layers import default_layer_ids

    before = zarr.config.get("codec_pipeline.path")
    spec = C.CacheSpec(layer_ids=default_layer_ids(4), hidden_size=8, topk=2, vocab_size=50, num_target_layers=4,
                       max_length=64, truncation="right", chunk_tokens=16)
    plan = C.ShardPlan(source_index=np.arange(3), lengths=np.array([20, 30, 7]), batches=np.array([0, 2, 3]))
    rng = np.random.default_rng(0)
    for out, expected in ((str(tmp_path / "local.zarr"), "ZarrsCodecPipeline"),
                          (f"file://{tmp_path / 'url.zarr'}", "BatchedCodecPipeline")):
        cfg = ExtractConfig(data="unused", model=str(tiny_target_dir), out=out, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning from zarrs
            with zarr.config.set(C.writer_zarr_settings(cfg.out)):
                root = C.create_or_open_cache(out, spec)
                w = C.ShardWriter(root, 0, plan, spec)
                assert {type(a.async_array.codec_pipeline).__name__ for a in w.arrays.values()} == {expected}
                rows = {}
                for b in range(2):
                    s0, s1 = w.batch_samples(b)
                    n = int(plan.lengths[s0:s1].sum())
                    rows[b] = dict(input_ids=rng.integers(0, 50, n).astype(np.int32), loss_mask=rng.random(n) < 0.5,
                                   hidden=rng.integers(0, 1 << 16, (n, 3, 8)).astype(np.uint16),
                                   topk_ids=rng.integers(0, 50, (n, 2)).astype(np.int32),
                                   topk_logprobs=-rng.random((n, 2)).astype(np.float32))
                    w.write_batch(b, **rows[b])
                    w.commit()
                w.finish()
        assert zarr.config.get("codec_pipeline.path") == before
        r = C.CacheReader(out)
        for f in C.TOKEN_FIELDS:
            got = np.concatenate([r.read_raw(i, [f])[f] for i in range(len(r))])
            assert np.array_equal(got, np.concatenate([rows[0][f], rows[1][f]])), (out, f)

def test_a_second_run_is_refused_naming_the_holder_and_a_waiting_run_takes_over_after_kill9(
        tmp_path, extracted, dataset, tiny_target_dir):
    """Two dflash-extract runs on one --out: the second stops at once naming the worker that
    writes each shard (host, pid, since when); a third with --wait-for-lock waits, takes the
    shards over once the first is killed with -9, and the cache equals an unbroken run's."""
    from click.testing import CliRunner

    from dflash.shared.cache_cli import main as cache_main

    reference, _, _ = extracted
    out = tmp_path / "c.zarr"
    flags = ["--data", str(dataset[0]), "--model", str(tiny_target_dir), "--out", str(out), "--on-bad-row", "skip",
             *COMMON]
    first = subprocess.Popen([*slow_torchrun(30), *flags], start_new_session=True,  # killed long before it ends
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    waiting = None
    try:
        deadline = time.monotonic() + 90
        def writing() -> bool:  # both shards locked and created (a shard being created has no record yet)
            if not all(L.ShardLock(str(out), s).probe() for s in (0, 1)):
                return False
            return None not in C.read_shard_states(C.open_root(str(out)), (0, 1)).values()

        while not writing():
            assert time.monotonic() < deadline, "the first run took no lock within 90 s"
            time.sleep(0.1)
        holders = {s: L.ShardLock(str(out), s).probe() for s in (0, 1)}
        for h in holders.values():  # the first run's workers hold them
            parent = open(f"/proc/{h.pid}/stat").read().rsplit(")", 1)[1].split()[1]
            assert h.host == L.HOST and parent == str(first.pid)
        info = CliRunner().invoke(cache_main, ["info", str(out)])  # dflash-cache info names them too
        for s, h in holders.items():
            assert f"writing    shard {s:05d} now: host {h.host}, pid {h.pid}, since" in info.output, info.output

        waiting = subprocess.Popen([*TORCHRUN, *flags, "--wait-for-lock"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # started beside the second, to save time
        second = cli("--data", dataset[0], "--model", tiny_target_dir, "--out", out, "--on-bad-row", "skip",
                     *COMMON, check=False)
        assert first.poll() is None, "the first run ended before the second started: nothing was tested"
        assert second.returncode == 1
        for s, h in holders.items():
            assert f"shard {s:05d} of {out} is being written by another run: host {h.host}, pid {h.pid}, since " \
                   in second.stderr, second.stderr[-3000:]
        assert "--wait-for-lock" in second.stderr

        lines = []
        while not any("waiting for it (--wait-for-lock)" in line and "dflash-extract: warning" in line
                      for line in lines):  # a worker of the third run waits
            line = waiting.stderr.readline()
            assert line, "".join(x for x in lines if "resource_tracker" not in x)[-3000:]
            lines.append(line)
        assert first.poll() is None
    finally:
        kill_run(first.pid)
        first.wait()
        if sys.exc_info()[0] is not None and waiting is not None:  # failed: the third run is not needed
            waiting.kill()
            waiting.wait()
    stdout, stderr = waiting.communicate(timeout=240)
    stderr = "".join(lines) + stderr
    assert waiting.returncode == 0, stderr[-3000:]
    for s, h in holders.items():
        assert f"shard {s:05d}: took over the lock of host {h.host}, pid {h.pid}" in stderr, stderr[-3000:]
        assert_same_shard(reference, out, s)
    assert all(L.ShardLock(str(out), s).probe() is None for s in (0, 1))  # released
