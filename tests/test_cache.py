"""The cache format: round trip, commit protocol, resume, corruption, compatibility."""

import numpy as np
import pytest
import torch

from dflash.shared import cache as C


SMALL_CHUNKS = {"hidden": 16, "input_ids": 64, "loss_mask": 64, "topk_ids": 32, "topk_logprobs": 32}


def make_spec(**kw):
    base = dict(layer_ids=[0, 2], hidden_size=8, topk=3, vocab_size=50, num_target_layers=4,
                max_length=64, truncation="right", chunk_tokens=16,
                fingerprint={"target": {"name": "toy"}, "dataset": {"rows": 10}})
    if kw.get("format_version", C.FORMAT_VERSION) >= 2:  # chunks of three sizes, each crossed by samples
        base["chunks"] = SMALL_CHUNKS
    base.update(kw)
    return C.CacheSpec(**base)


def make_plan(lengths, batch_size=2, source=None):
    n = len(lengths)
    source = np.arange(n) * 3 if source is None else source
    batches = list(range(0, n, batch_size)) + [n]
    return C.ShardPlan(source_index=source, lengths=np.array(lengths), batches=np.array(batches),
                       skipped={"too_short": 1})


def batch_data(spec, plan, b, seed=0):
    """Deterministic synthetic arrays for planned batch b."""
    s0, s1 = int(plan.batches[b]), int(plan.batches[b + 1])
    n = int(plan.lengths[s0:s1].sum())
    g = np.random.default_rng(seed * 1000 + b)
    hidden = torch.randn(n, spec.num_layers, spec.hidden_size, generator=torch.Generator().manual_seed(b)).bfloat16()
    return dict(
        input_ids=g.integers(0, spec.vocab_size, n).astype(np.int32),
        loss_mask=g.random(n) < 0.5,
        hidden=C.bf16_to_bits(hidden),
        topk_ids=g.integers(0, spec.vocab_size, (n, spec.topk)).astype(np.int32),
        topk_logprobs=-g.random((n, spec.topk)).astype(np.float32),
    )


def write_all(path, spec, plan, commit_every=1, stop_after=None, sinks=None):
    """Write (or resume) shard 0 of ``plan``; ``sinks(root)`` may give ShardWriter its sinks."""
    root = C.create_or_open_cache(str(path), spec)
    w = C.ShardWriter(root, 0, plan, spec)
    if sinks:
        w.attach_sinks(sinks(root))
    nb = len(plan.batches) - 1
    for b in range(w.next_batch, nb):
        if stop_after is not None and b >= stop_after:
            return w
        w.write_batch(b, **batch_data(spec, plan, b))
        if (b + 1) % commit_every == 0:
            w.commit()
    w.finish()
    return w


LENGTHS = [5, 17, 3, 40, 16, 16, 1, 9, 33, 2, 7]


def test_round_trip(tmp_path):
    spec, plan = make_spec(), make_plan(LENGTHS)
    write_all(tmp_path / "c.zarr", spec, plan)
    r = C.CacheReader(str(tmp_path / "c.zarr"))
    assert len(r) == len(LENGTHS) and r.complete and r.num_tokens == sum(LENGTHS)
    assert r.lengths().tolist() == LENGTHS
    assert r.source_indices().tolist() == plan.source_index.tolist()
    # reassemble expected token-major arrays from the generator, sample by sample
    expected = {f: np.concatenate([batch_data(spec, plan, b)[f] for b in range(len(plan.batches) - 1)])
                for f in C.TOKEN_FIELDS}
    off = plan.offsets
    for i in range(len(LENGTHS)):
        s = r[i]
        t0, t1 = off[i], off[i + 1]
        assert torch.equal(s["input_ids"], torch.from_numpy(expected["input_ids"][t0:t1]).long())
        assert torch.equal(s["loss_mask"], torch.from_numpy(expected["loss_mask"][t0:t1]))
        assert s["hidden"].dtype == torch.bfloat16 and s["hidden"].shape == (t1 - t0, 2, 8)
        assert torch.equal(s["hidden"], C.bf16_from_bits(expected["hidden"][t0:t1]))
        assert torch.equal(s["topk_logprobs"], torch.from_numpy(expected["topk_logprobs"][t0:t1]))
        assert s["source_index"] == plan.source_index[i]


def test_a_stray_group_among_the_shards_is_named(tmp_path):
    spec, plan = make_spec(), make_plan(LENGTHS)
    write_all(tmp_path / "c.zarr", spec, plan)
    C.open_root(str(tmp_path / "c.zarr"), "r+")["shards"].create_group("notes")
    with pytest.raises(C.CacheError, match="shards/notes is no shard group"):
        C.CacheReader(str(tmp_path / "c.zarr"))


def test_reader_sees_only_committed(tmp_path):
    spec, plan = make_spec(), make_plan(LENGTHS)
    path = str(tmp_path / "c.zarr")
    root = C.create_or_open_cache(path, spec)
    w = C.ShardWriter(root, 0, plan, spec)
    w.write_batch(0, **batch_data(spec, plan, 0))
    w.commit()
    w.write_batch(1, **batch_data(spec, plan, 1))  # written (maybe whole chunks) but not committed
    r = C.CacheReader(path)
    assert len(r) == 2 and r.shards[0].state == "partial"
    with pytest.raises(IndexError):
        r[2]


@pytest.mark.parametrize("span_tokens", [1, 20, 1 << 16])
def test_read_many_equals_read_sample_by_sample(tmp_path, span_tokens):
    """Samples read span by span (preload's way, through zarrs) equal ``read``'s (zarr's own pipeline), field for
    field: spans shorter than a sample, spans that end inside a sample, spans up to the end of a shard, two shards,
    a partly committed one."""
    spec = make_spec()
    path = str(tmp_path / "c.zarr")
    root = C.create_or_open_cache(path, spec)
    for shard, lengths in ((0, LENGTHS), (1, LENGTHS[::-1])):
        plan = make_plan(lengths)
        w = C.ShardWriter(root, shard, plan, spec)
        for b in range(len(plan.batches) - 1 - shard):  # shard 1: its last batch never committed
            w.write_batch(b, **batch_data(spec, plan, b, seed=shard))
            w.commit()
    r = C.CacheReader(path)
    assert [s.state for s in r.shards] == ["complete", "partial"]
    got = list(r.read_many(range(len(r)), span_tokens=span_tokens))
    assert [i for i, _ in got] == list(range(len(r)))
    for i, sample in got:
        expected = r.read(i)
        assert sample.keys() == expected.keys()
        assert all(torch.equal(sample[k], expected[k]) if torch.is_tensor(v) else sample[k] == v
                   for k, v in expected.items()), i
    pipelines = {key: type(a.async_array.codec_pipeline).__name__ for key, a in r._arrays.items()}
    assert {p for (_, _, zarrs), p in pipelines.items() if zarrs} == {"ZarrsCodecPipeline"}, pipelines
    assert {p for (_, _, zarrs), p in pipelines.items() if not zarrs} == {"BatchedCodecPipeline"}, pipelines


def chunk_file_bytes(path) -> dict[str, bytes]:
    """Every chunk file of shard 0's token arrays, by relative name."""
    shard = path / "shards" / "00000"
    return {str(f.relative_to(shard)): f.read_bytes() for a in C.TOKEN_FIELDS
            for f in sorted((shard / a / "c").rglob("*")) if f.is_file()}


@pytest.mark.parametrize("format_version", [1, 2])
@pytest.mark.parametrize("stop_after,commit_every", [(1, 1), (3, 1), (4, 3), (5, 2)])
def test_resume_identical_to_unbroken(tmp_path, stop_after, commit_every, format_version):
    """Stopped after a commit that leaves chunks partial (coarse ones of format 2 too), then
    resumed: every array and every chunk file as an unbroken run writes them."""
    spec, plan = make_spec(format_version=format_version), make_plan(LENGTHS)
    write_all(tmp_path / "a.zarr", spec, plan)
    write_all(tmp_path / "b.zarr", spec, plan, commit_every=commit_every, stop_after=stop_after)
    w = write_all(tmp_path / "b.zarr", spec, plan)  # the rerun resumes
    assert w.complete
    a, b = C.open_root(str(tmp_path / "a.zarr")), C.open_root(str(tmp_path / "b.zarr"))
    for f in C.TOKEN_FIELDS + ("offsets", "source_index", "batches"):
        x, y = np.asarray(a["shards/00000"][f][:]), np.asarray(b["shards/00000"][f][:])
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert a["shards/00000"].attrs.asdict() == b["shards/00000"].attrs.asdict()
    assert chunk_file_bytes(tmp_path / "a.zarr") == chunk_file_bytes(tmp_path / "b.zarr")
    chunks = {f: a["shards/00000"][f].chunks[0] for f in C.TOKEN_FIELDS}
    assert chunks == (SMALL_CHUNKS if format_version == 2 else {f: 16 for f in C.TOKEN_FIELDS})


def test_a_version_1_cache_resumes_in_its_own_layout(tmp_path):
    """A format-1 cache stopped midway and rerun by this code (whose spec says format 2):
    the root keeps format 1 and the shard ends as an unbroken format-1 run writes it."""
    v1, v2, plan = make_spec(format_version=1), make_spec(), make_plan(LENGTHS)
    write_all(tmp_path / "a.zarr", v1, plan)
    write_all(tmp_path / "b.zarr", v1, plan, stop_after=3)
    root = C.create_or_open_cache(str(tmp_path / "b.zarr"), v2)
    stored = C.CacheSpec.from_dict(root.attrs[C.ATTRS_KEY])
    assert stored.format_version == 1 and stored.chunks == {}
    write_all(tmp_path / "b.zarr", stored, plan)
    assert chunk_file_bytes(tmp_path / "a.zarr") == chunk_file_bytes(tmp_path / "b.zarr")
    assert C.CacheReader(str(tmp_path / "b.zarr")).complete


def test_default_chunks_at_8b_shape():
    """Format 2 at Qwen3-8B's shape (5 layers x 4096, top-64): hidden states at chunk_tokens;
    every small array's raw chunk is the largest power of two of rows within 1 MiB, or 64k rows."""
    spec = make_spec(layer_ids=[1, 9, 17, 25, 33], hidden_size=4096, topk=64, num_target_layers=36,
                     chunk_tokens=256, chunks={})
    row_bytes = {"input_ids": 4, "loss_mask": 1, "topk_ids": 4 * 64, "topk_logprobs": 4 * 64}
    assert spec.chunks["hidden"] == 256
    for f, nbytes in row_bytes.items():
        rows = spec.chunks[f]
        assert rows & (rows - 1) == 0 and (rows == 1 << 16 or rows * nbytes <= 1 << 20 < 2 * rows * nbytes), f
    assert spec.chunks == {"hidden": 256, "input_ids": 65536, "loss_mask": 65536, "topk_ids": 4096,
                           "topk_logprobs": 4096}
    assert C.CacheSpec.from_dict(spec.to_dict()) == spec
    v1 = make_spec(format_version=1)
    assert v1.chunks == {} and all(v1.chunk_rows(f) == 16 for f in C.TOKEN_FIELDS)
    with pytest.raises(C.CacheError, match="format version 4 is not supported"):
        C.CacheSpec.from_dict({**spec.to_dict(), "format_version": 4})


def test_other_fingerprint_refused(tmp_path):
    path = str(tmp_path / "c.zarr")
    C.create_or_open_cache(path, make_spec())
    C.create_or_open_cache(path, make_spec())  # same: reopens
    other = make_spec(topk=4, fingerprint={"target": {"name": "other"}, "dataset": {"rows": 10}})
    with pytest.raises(C.CacheMismatch) as e:
        C.create_or_open_cache(path, other)
    msg = str(e.value)
    assert "topk" in msg and "fingerprint.target.name" in msg and "'other'" in msg


def file_bytes(path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name: a byte-exact picture of a store."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_uncommitted_root_with_another_fingerprint_is_replaced(tmp_path, caplog):
    """What a run that failed before its first commit leaves (a shard planned, nothing
    committed) gives way to the corrected run, which says so; only when asked to."""
    path = tmp_path / "c.zarr"
    spec, plan = make_spec(), make_plan(LENGTHS)
    root = C.create_or_open_cache(str(path), spec)
    C.ShardWriter(root, 0, plan, spec).write_batch(0, **batch_data(spec, plan, 0))  # written, never committed
    other = make_spec(topk=4)
    with pytest.raises(C.CacheMismatch, match="topk: cache has 3, run has 4"):
        C.create_or_open_cache(str(path), other)  # not asked to replace: refused as before
    with caplog.at_level("WARNING", logger="dflash.shared.cache"):
        root = C.create_or_open_cache(str(path), other, replace_uncommitted=True)
    assert "replacing a cache root made with another fingerprint" in caplog.text and "topk: cache has 3" in caplog.text
    assert C.CacheSpec.from_dict(root.attrs[C.ATTRS_KEY]) == other
    assert list(C.open_root(str(path))["shards"].group_keys()) == []  # the old plan cannot block the new one
    write_all(path, other, plan)  # the corrected run writes its shard from the start
    assert len(C.CacheReader(str(path))) == len(LENGTHS)


def test_committed_root_with_another_fingerprint_is_left_byte_identical(tmp_path):
    """One committed sample in any shard: refused even when replacing is allowed, every file untouched."""
    path = tmp_path / "c.zarr"
    spec, plan = make_spec(), make_plan(LENGTHS)
    write_all(path, spec, plan, stop_after=1)  # shard 0: batch 0 committed
    root = C.open_root(str(path), "r+")
    C.ShardWriter(root, 1, plan, spec)  # shard 1: planned, nothing committed
    assert C.committed_samples(root) == 2
    before = file_bytes(path)
    with pytest.raises(C.CacheMismatch, match="topk: cache has 3, run has 4"):
        C.create_or_open_cache(str(path), make_spec(topk=4), replace_uncommitted=True)
    assert file_bytes(path) == before


def test_foreign_zarr_data_is_never_replaced(tmp_path):
    import zarr

    path = tmp_path / "c.zarr"
    zarr.open_group(str(path), mode="w").create_array("x", shape=(4,), dtype="int32")
    before = file_bytes(path)
    with pytest.raises(C.CacheError, match="not a dflash cache"):
        C.create_or_open_cache(str(path), make_spec(), replace_uncommitted=True)
    assert file_bytes(path) == before


def test_resume_under_another_compute_refused(tmp_path):
    """A shard with committed samples resumes only where it was computed (device, head,
    versions): the message names each difference and how to redo the shard. A shard with
    nothing committed takes the new record; a finished one is never refused."""
    spec, plan = make_spec(), make_plan(LENGTHS)
    path = tmp_path / "c.zarr"
    here = {"device": "NVIDIA H200", "head": "inductor", "torch": "2.11.0"}
    elsewhere = {**here, "device": "cpu AVX2 x4 threads", "head": "eager"}
    root = C.create_or_open_cache(str(path), spec)
    C.ShardWriter(root, 0, plan, spec, compute=elsewhere)  # created, nothing committed
    w = C.ShardWriter(root, 0, plan, spec, compute=here)  # so this run takes it over
    assert root["shards/00000"].attrs["compute"] == here
    w.write_batch(0, **batch_data(spec, plan, 0))
    w.commit()
    assert C.ShardWriter(root, 0, plan, spec, compute=dict(here)).next_batch == 1  # same: resumes
    with pytest.raises(C.CacheError) as e:
        C.ShardWriter(root, 0, plan, spec, compute=elsewhere)
    msg = str(e.value)
    assert "shard 00000 has 2 samples computed elsewhere" in msg
    assert "device: 'NVIDIA H200' then, 'cpu AVX2 x4 threads' now" in msg and "head: 'inductor' then, 'eager' now" in msg
    assert "torch" not in msg and "delete the folder shards/00000" in msg
    assert C.open_root(str(path))["shards/00000"].attrs["compute"] == here  # the refusal changed nothing
    import shutil

    shutil.rmtree(path / "shards" / "00000")  # what the message says: the shard starts over
    assert C.ShardWriter(C.open_root(str(path), "r+"), 0, plan, spec, compute=elsewhere).next_batch == 0
    done = tmp_path / "done.zarr"
    write_all(done, spec, plan)  # finished (no compute recorded by write_all)
    C.open_root(str(done), "r+")["shards/00000"].attrs["compute"] = here
    assert C.ShardWriter(C.open_root(str(done), "r+"), 0, plan, spec, compute=elsewhere).complete


def test_changed_plan_refused(tmp_path):
    spec = make_spec()
    write_all(tmp_path / "c.zarr", spec, make_plan(LENGTHS), stop_after=2)
    with pytest.raises(C.CacheError, match="planned differently"):
        write_all(tmp_path / "c.zarr", spec, make_plan(LENGTHS[:-1]))


def test_corrupted_chunk_refused(tmp_path):
    spec, plan = make_spec(), make_plan(LENGTHS)
    path = tmp_path / "c.zarr"
    write_all(path, spec, plan)
    chunk = path / "shards" / "00000" / "hidden" / "c" / "1" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    r = C.CacheReader(str(path))
    # chunk 1 holds tokens 16..31: sample 1 (tokens 5..22) touches it, sample 0 does not
    r[0]
    with pytest.raises(C.CacheError, match="shard 00000 sample 1"):
        r[1]
    with pytest.raises(C.CacheError, match=r"shard 00000 tokens 0:\d+ \(sample 0 on\) array hidden"):
        list(r.read_many(range(len(r))))  # the preload's reads, through zarrs, check the checksum too


def test_check_compatible_names_every_mismatch(tmp_path):
    spec, plan = make_spec(fingerprint={"tokenizer": {"hash": "abc"}}), make_plan(LENGTHS)
    write_all(tmp_path / "c.zarr", spec, plan)
    r = C.CacheReader(str(tmp_path / "c.zarr"))
    r.check_compatible(layer_ids=[2], hidden_size=8, vocab_size=50, tokenizer_hash="abc")
    with pytest.raises(C.CacheMismatch) as e:
        r.check_compatible(layer_ids=[0, 1, 3], hidden_size=16, vocab_size=51, tokenizer_hash="xyz")
    msg = str(e.value)
    for part in ("[1, 3]", "hidden size", "vocabulary", "tokenizer"):
        assert part in msg
    assert r.layer_slots([2, 0]) == [1, 0]


def test_reader_pickles(tmp_path):
    import pickle
    spec, plan = make_spec(), make_plan(LENGTHS)
    write_all(tmp_path / "c.zarr", spec, plan)
    r = C.CacheReader(str(tmp_path / "c.zarr"))
    r2 = pickle.loads(pickle.dumps(r))
    assert torch.equal(r[3]["hidden"], r2[3]["hidden"])


class WriteLog:
    """Stands in for a zarr array in ``ShardWriter``: records each write's first row and the
    rows committed when it came, then writes through."""

    def __init__(self, array, writer, log, path):
        self.array, self.writer, self.log, self.path = array, writer, log, path

    def __setitem__(self, key, value):
        self.log.append((self.path, key.start, key.stop, self.writer.committed["tokens"]))
        self.array[key] = value

    def __getitem__(self, key):
        return self.array[key]


@pytest.mark.parametrize("stop_after", [None, 3])
def test_chunks_with_committed_rows_are_rewritten_through_zarrs_own_pipeline(tmp_path, stop_after):
    """Under the zarrs pipeline (which truncates a chunk file, then writes it), a write that
    rewrites a chunk holding committed rows goes through zarr's own pipeline (which replaces
    the file in one step), and only that chunk; every other write goes through zarrs."""
    import zarr

    spec, plan = make_spec(), make_plan(LENGTHS)
    path = tmp_path / "c.zarr"
    log = []
    with zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"}):
        for attempt in ("first", "resumed") if stop_after else ("only",):
            root = C.create_or_open_cache(str(path), spec)
            w = C.ShardWriter(root, 0, plan, spec)
            for f in C.TOKEN_FIELDS:
                assert type(w.arrays[f].async_array.codec_pipeline).__name__ == "ZarrsCodecPipeline"
                assert type(w._atomic_arrays[f].async_array.codec_pipeline).__name__ == "BatchedCodecPipeline"
                w.arrays[f] = WriteLog(w.arrays[f], w, log, ("zarrs", f))
                w._atomic_arrays[f] = WriteLog(w._atomic_arrays[f], w, log, ("zarr", f))
            for b in range(w.next_batch, len(plan.batches) - 1):
                if attempt == "first" and b >= stop_after:
                    break
                w.write_batch(b, **batch_data(spec, plan, b))
                w.commit()
            else:
                w.finish()
    assert any(p == "zarr" for (p, _), *_ in log)  # commits inside chunks happened: the rule was exercised
    for (pipeline, f), start, stop, committed in log:
        C_ = spec.chunks[f]
        assert start % C_ == 0
        if pipeline == "zarrs":
            assert start >= committed, (f, start, committed)  # no chunk it touches holds a committed row
        else:
            assert start < committed and stop <= start + C_, (f, start, stop, committed)  # that one chunk only
    write_all(tmp_path / "ref.zarr", spec, plan)
    assert [np.array_equal(C.open_root(str(path))["shards/00000"][f][:], C.open_root(str(tmp_path / "ref.zarr"))["shards/00000"][f][:])
            for f in C.TOKEN_FIELDS] == [True] * len(C.TOKEN_FIELDS)

def test_shard_state_round_trip(tmp_path):
    """What a shard records, read back as a ShardState, equals what its plan and commits say,
    counted here from the plan itself; malformed attributes name the shard."""
    spec, plan = make_spec(), make_plan(LENGTHS)
    compute = {"device": "cpu", "torch": "2.13.0"}
    root = C.create_or_open_cache(str(tmp_path / "c.zarr"), spec)
    w = C.ShardWriter(root, 0, plan, spec, compute=compute)
    for b in range(3):
        w.write_batch(b, **batch_data(spec, plan, b))
    w.commit()
    state = C.read_shard_state(C.open_root(str(tmp_path / "c.zarr"))["shards/00000"])
    nb = len(plan.batches) - 1
    samples = int(plan.batches[3])
    assert state == C.ShardState(
        plan_digest=plan.digest(), planned=C.ShardCounts(nb, len(LENGTHS), sum(LENGTHS)),
        commit=C.ShardCounts(3, samples, sum(LENGTHS[:samples])), complete=False,
        skipped={"too_short": 1}, compute=compute)
    assert state.status == "partial" and C.ShardState.from_attrs(state.to_attrs()) == state
    for b in range(3, nb):
        w.write_batch(b, **batch_data(spec, plan, b))
    w.finish()
    done = C.read_shard_states(C.open_root(str(tmp_path / "c.zarr")), [0, 1])
    assert done[1] is None and done[0].complete and done[0].status == "complete"
    assert done[0].commit == done[0].planned
    broken = C.open_root(str(tmp_path / "c.zarr"), "r+")["shards/00000"]
    broken.attrs["commit"] = {"batches": 1}
    with pytest.raises(C.CacheError, match="shards/00000: missing or malformed shard attributes"):
        C.read_shard_state(broken)


def test_every_metadata_write_of_a_shard_holds_a_whole_record(tmp_path, monkeypatch):
    """A reader sees a shard's metadata as written at some moment: every version a shard group
    writes while it is created, committed and finished is either the empty group or a record
    that parses whole (a reader of a run in progress never meets a half-written record)."""
    from zarr.core.group import AsyncGroup

    versions: list[dict] = []
    save = AsyncGroup._save_metadata

    async def recording(self, *args, **kwargs):
        if self.path.startswith("shards/"):
            versions.append(dict(self.metadata.attributes))
        return await save(self, *args, **kwargs)

    monkeypatch.setattr(AsyncGroup, "_save_metadata", recording)
    spec, plan = make_spec(), make_plan(LENGTHS)
    root = C.create_or_open_cache(str(tmp_path / "c.zarr"), spec)
    w = C.ShardWriter(root, 0, plan, spec, compute={"device": "cpu"})
    for b in range(len(plan.batches) - 1):
        w.write_batch(b, **batch_data(spec, plan, b))
        w.commit()
    w.finish()
    again = C.ShardWriter(C.open_root(str(tmp_path / "c.zarr"), "r+"), 0, plan, spec, compute={"device": "cuda"})
    assert again.complete
    assert len(versions) >= len(plan.batches), versions  # the creation, each commit, the end
    for attrs in versions:
        if attrs:
            C.ShardState.from_attrs(attrs)  # raises ValueError naming a missing field
    assert versions[-1]["complete"] is True


def test_only_the_cache_module_reads_shard_attributes():
    """The contract in one file: every other module gets a ShardState (root attributes hold
    the CacheSpec, read under ATTRS_KEY)."""
    import pathlib
    import re

    package = pathlib.Path(C.__file__).resolve().parents[1]
    offenders = []
    for path in sorted(p for d in ("shared", "extract", "train", "eval", "bench") for p in (package / d).rglob("*.py")):
        if path == pathlib.Path(C.__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.attrs\b", line) and "ATTRS_KEY" not in line:
                offenders.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_a_reader_opens_only_the_arrays_it_is_asked_for(tmp_path):
    """With every other array's folder deleted, opening and reading some fields still works,
    equal to what was written; asking for a deleted array names it."""
    import shutil

    spec, plan = make_spec(), make_plan(LENGTHS)
    path = tmp_path / "c.zarr"
    write_all(path, spec, plan)
    for name in ("hidden", "topk_ids", "topk_logprobs", "source_index", "batches"):
        shutil.rmtree(path / "shards" / "00000" / name)
    r = C.CacheReader(str(path))
    assert len(r) == len(LENGTHS) and r.lengths().tolist() == LENGTHS
    expected = {f: np.concatenate([batch_data(spec, plan, b)[f] for b in range(len(plan.batches) - 1)])
                for f in ("input_ids", "loss_mask")}
    off = plan.offsets
    for i in range(len(LENGTHS)):
        raw = r.read_raw(i, ("input_ids", "loss_mask"))
        assert np.array_equal(raw["input_ids"], expected["input_ids"][off[i]:off[i + 1]])
        assert np.array_equal(raw["loss_mask"], expected["loss_mask"][off[i]:off[i + 1]])
    with pytest.raises(C.CacheError, match="shard 00000 has no array hidden"):
        r.read_raw(0, ("hidden",))
    with pytest.raises(C.CacheError, match="no array source_index"):
        r.read(0, ("input_ids",))


def test_a_shard_created_but_never_recorded_is_skipped_by_readers_and_made_anew(tmp_path):
    """A writer that died between creating a shard's group and recording its state leaves a
    group without a state: readers skip it (nothing in it is committed) and the next writer
    starts it over, ending as an unbroken run does."""
    spec, plan = make_spec(), make_plan(LENGTHS)
    write_all(tmp_path / "a.zarr", spec, plan)
    root = C.create_or_open_cache(str(tmp_path / "b.zarr"), spec)
    root.create_group("shards/00000").create_array("input_ids", shape=(3,), dtype="int32")  # then it died
    r = C.CacheReader(str(tmp_path / "b.zarr"))
    assert len(r) == 0 and r.shards == []
    assert C.read_shard_states(root, [0]) == {0: None} and C.committed_samples(root) == 0
    write_all(tmp_path / "b.zarr", spec, plan)
    a, b = C.open_root(str(tmp_path / "a.zarr")), C.open_root(str(tmp_path / "b.zarr"))
    for f in C.TOKEN_FIELDS + ("offsets", "source_index", "batches"):
        assert np.array_equal(np.asarray(a["shards/00000"][f][:]), np.asarray(b["shards/00000"][f][:])), f
    assert C.read_shard_state(a["shards/00000"]) == C.read_shard_state(b["shards/00000"])
