"""dflash-cache info/show/verify/stats against numpy recomputations of the data written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

from dflash.shared import cache as C
from dflash.shared.cache_cli import main
from dflash.shared.fingerprint import tokenizer_fingerprint

LAYER_IDS = [0, 2, 3]
D, K, CHUNK = 8, 4, 16
OUTLIER = 250.0  # planted at hidden[:, 0, 0] of every 5th token, above the stats threshold
PHRASES = ["What is 2 + 3?", "Reverse the word 'apple'.", "Sort these numbers: [4, 1, 3].",
           "How many times does 'o' appear in 'ocean'?", "Compute 7 times 8."]
ANSWERS = ["2 + 3 = 5.", "'apple' reversed is 'elppa'.", "Sorted: [1, 3, 4].",
           "The letter 'o' appears 1 time in 'ocean'.", "7 times 8 is 56."]


def _sample(tok, rng):
    """One ChatML-ish sample: (ids, loss_mask, assistant_text) with a known assistant span."""
    q = int(rng.integers(len(PHRASES)))
    user = tok.encode(f"<|im_start|>user\n{PHRASES[q]}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    answer = ANSWERS[q] + "<|im_end|>"
    asst = tok.encode(answer, add_special_tokens=False)
    ids = np.array(user + asst, dtype=np.int32)
    mask = np.array([False] * len(user) + [True] * len(asst))
    return ids, mask, answer


def _token_fields(ids, mask, vocab, rng, gen):
    n = len(ids)
    scale = torch.arange(1, len(LAYER_IDS) + 1, dtype=torch.float32).view(1, -1, 1)
    hidden = torch.randn(n, len(LAYER_IDS), D, generator=gen) * scale
    hidden[::5, 0, 0] = OUTLIER
    logits = rng.normal(size=(n, vocab)) * 3
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    top = np.argsort(-logp, axis=1)[:, :K]
    return dict(input_ids=ids, loss_mask=mask, hidden=C.bf16_to_bits(hidden.bfloat16()),
                topk_ids=top.astype(np.int32),
                topk_logprobs=np.take_along_axis(logp, top, 1).astype(np.float32))


SMALL_CHUNKS = {"hidden": CHUNK, "topk_ids": CHUNK, "topk_logprobs": 2 * CHUNK, "input_ids": 4 * CHUNK,
                "loss_mask": 4 * CHUNK}
"""Format 2's per-array chunks, small enough that samples cross chunks of every array."""


def build_cache(path: Path, tok, tok_dir: Path, format_version: int = C.FORMAT_VERSION) -> dict:
    """Shard 0: 7 samples, complete. Shard 1: 6 planned in 3 batches, 2 committed, the 3rd
    written but not committed. Returns what was written, per shard, for the reference.
    ``format_version`` 1: every array chunked at ``CHUNK``, as that format's writer did."""
    vocab = len(tok)
    spec = C.CacheSpec(
        layer_ids=LAYER_IDS, hidden_size=D, topk=K, vocab_size=vocab, num_target_layers=4, max_length=128,
        truncation="right", chunk_tokens=CHUNK, format_version=format_version,
        chunks=dict(SMALL_CHUNKS) if format_version >= 2 else {},
        fingerprint={
            "target": {"name_or_path": str(tok_dir), "revision": "rev123", "dtype": "bfloat16",
                       "config_hash": "c0ffee" * 10, "weights_hash": "beef" * 16},
            "tokenizer": tokenizer_fingerprint(tok),
            "dataset": {"source": "chats.jsonl", "split": "train", "num_rows": 20, "content_hash": "sha256:abcdef012345"},
        })
    root = C.create_or_open_cache(str(path), spec)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    expected = {"spec": spec, "shards": []}
    layout = [  # (source rows, batches, batches to commit, skipped)
        (np.array([0, 2, 3, 5, 6, 8, 9]), [0, 2, 4, 7], 3, {"too_long": 2}),
        (np.array([10, 11, 13, 14, 15, 17]), [0, 2, 4, 6], 2, {"template_error": 1}),
    ]
    for sid, (source, batches, commit_batches, skipped) in enumerate(layout):
        samples = [_sample(tok, rng) for _ in source]
        plan = C.ShardPlan(source, np.array([len(s[0]) for s in samples]), np.array(batches), skipped)
        w = C.ShardWriter(root, sid, plan, spec, compute={"device": f"gpu-{sid % 2}", "torch": "2.x"})
        per_sample = [_token_fields(ids, mask, vocab, rng, gen) for ids, mask, _ in samples]
        for b in range(len(batches) - 1):
            part = per_sample[batches[b]:batches[b + 1]]
            w.write_batch(b, **{f: np.concatenate([p[f] for p in part]) for f in C.TOKEN_FIELDS})
            if b < commit_batches:
                w.commit()
        if commit_batches == len(batches) - 1:
            w.finish()
        n = batches[commit_batches]
        expected["shards"].append({
            "n": n, "planned": len(source), "offsets": plan.offsets, "source": source, "skipped": skipped,
            "answers": [s[2] for s in samples[:n]],
            "fields": {f: np.concatenate([p[f] for p in per_sample[:n]]) for f in C.TOKEN_FIELDS},
        })
    return expected


@pytest.fixture
def cache(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
    path = tmp_path / "c.zarr"
    return path, build_cache(path, tiny_tokenizer, tiny_tokenizer_dir)


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    return result


def run_json(*args, code=0):
    extra = ["--no-progress"] if args[0] == "verify" else []
    return json.loads(run(*args, "--json", *extra, code=code).output)


def all_committed(exp, field):
    return np.concatenate([s["fields"][field] for s in exp["shards"]])


def global_index(exp, shard, local):
    return sum(s["n"] for s in exp["shards"][:shard]) + local


# ----------------------------------------------------------------------------- info


def test_info_counts_match_numpy(cache):
    path, exp = cache
    d = run_json("info", path)
    sh = exp["shards"]
    assert [s["state"] for s in d["shards"]] == ["complete", "partial"]
    assert [s["samples"] for s in d["shards"]] == [s["n"] for s in sh]
    assert [s["planned_samples"] for s in d["shards"]] == [s["planned"] for s in sh]
    assert [s["tokens"] for s in d["shards"]] == [len(s["fields"]["input_ids"]) for s in sh]
    assert [s["planned_tokens"] for s in d["shards"]] == [int(s["offsets"][-1]) for s in sh]
    assert [s["assistant_tokens"] for s in d["shards"]] == [int(s["fields"]["loss_mask"].sum()) for s in sh]
    tokens = len(all_committed(exp, "input_ids"))
    assert d["samples"] == sum(s["n"] for s in sh) and d["tokens"] == tokens
    assert d["assistant_tokens"] == int(all_committed(exp, "loss_mask").sum())
    assert d["skipped"] == {"too_long": 2, "template_error": 1}
    assert d["layer_ids"] == LAYER_IDS and d["hidden_size"] == D and d["topk"] == K
    assert d["fingerprint"]["dataset"] == {"name": "chats.jsonl", "split": "train", "rows": 20,
                                           "hash": "sha256:abcdef012345"}
    # bytes and ratios, recomputed from the files on disk
    files = [p for p in path.rglob("*") if p.is_file()]
    assert d["bytes_on_disk"] == sum(p.stat().st_size for p in files)
    L = len(LAYER_IDS)
    assert d["raw_bytes"]["hidden"] == tokens * L * D * 2
    meta = 8 * sum((s["planned"] + 1) + s["planned"] + 4 for s in sh)  # offsets, source_index, 3 batches + 1
    assert d["raw_bytes"]["total"] == tokens * (L * D * 2 + 4 + 1 + 8 * K) + meta
    hidden_disk = 0
    for sid, s in enumerate(sh):
        nchunks = math.ceil(len(s["fields"]["input_ids"]) / CHUNK)
        chunk_dir = path / "shards" / f"{sid:05d}" / "hidden" / "c"
        hidden_disk += sum(p.stat().st_size for p in chunk_dir.rglob("*") if p.is_file() and int(p.relative_to(chunk_dir).parts[0]) < nchunks)
    assert d["compression_ratio"]["hidden"] == pytest.approx(tokens * L * D * 2 / hidden_disk)
    text = run("info", path).output
    for part in ("partial", "complete", "rev123", "c0ffeec0ffee", "[0, 2, 3]", "output_hidden_states", "too_long=2"):
        assert part in text
    # where each shard was computed, as its writer recorded it
    assert [s["compute"]["device"] for s in d["shards"]] == ["gpu-0", "gpu-1"]
    assert "computed   device gpu-0, torch 2.x  (shards 00000)" in text
    assert "computed   device gpu-1, torch 2.x  (shards 00001)" in text


def test_a_version_1_cache_reads_verifies_and_shows_its_version(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
    """A cache written in format 1 (every array in CHUNK-token chunks) reads back what was
    written, verifies clean, and ``info`` names its version and chunking; a flipped byte in a
    small array's chunk is still found."""
    path = tmp_path / "v1.zarr"
    exp = build_cache(path, tiny_tokenizer, tiny_tokenizer_dir, format_version=1)
    for f in C.TOKEN_FIELDS:
        assert zarr.open_array(str(path / "shards" / "00000" / f)).chunks[0] == CHUNK
    d = run_json("info", path)
    assert d["format_version"] == 1 and d["chunks"] == {f: CHUNK for f in C.TOKEN_FIELDS}
    assert "dflash-cache v1" in run("info", path).output
    r = C.CacheReader(str(path))
    for f in C.TOKEN_FIELDS:
        got = np.concatenate([r.read_raw(i, [f])[f] for i in range(len(r))])
        assert np.array_equal(got, all_committed(exp, f)), f
    assert run_json("verify", path)["ok"]
    chunk = path / "shards" / "00000" / "loss_mask" / "c" / "1"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    d = run_json("verify", path, code=1)
    assert [(p["shard"], p["array"], p["check"]) for p in d["problems"]] == [(0, "loss_mask", "undecodable")]


def test_info_shows_the_format_and_each_arrays_chunks(cache):
    path, _ = cache
    d = run_json("info", path)
    assert d["format_version"] == C.FORMAT_VERSION == 2
    assert d["chunks"] == {f: zarr.open_array(str(path / "shards" / "00000" / f)).chunks[0] for f in C.TOKEN_FIELDS}
    assert d["chunks"] == SMALL_CHUNKS
    text = run("info", path).output
    assert "dflash-cache v2" in text and f"chunks     hidden {CHUNK}, top-k {CHUNK}/{2 * CHUNK}" in text


def test_not_a_cache_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    for cmd in ("info", "verify", "stats"):
        run(cmd, tmp_path / "empty", code=2)


# ----------------------------------------------------------------------------- verify


def test_verify_clean(cache):
    path, exp = cache
    d = run_json("verify", path)
    assert d["ok"] and d["num_problems"] == 0 and d["problems"] == []
    assert [(s["state"], s["samples"], s["planned_samples"]) for s in d["shards"]] == [("complete", 7, 7), ("partial", 4, 6)]
    out = run("verify", path, "--no-progress").output
    assert "OK" in out and "committed 4/6 samples" in out


def _samples_touching(offsets, n, t0, t1):
    return [i for i in range(n) if offsets[i] < t1 and offsets[i + 1] > t0]


def test_verify_flipped_bytes_name_shard_and_samples(cache):
    path, exp = cache
    for sid, array, chunk in ((1, "hidden", 1), (0, "topk_ids", 2)):
        f = path / "shards" / f"{sid:05d}" / array / "c" / str(chunk) / "0"
        f = f / "0" if array == "hidden" else f  # chunk keys: c/<token chunk>/0[/0]
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    d = run_json("verify", path, "--workers", "2", code=1)
    got = {(p["shard"], p["array"]): p for p in d["problems"]}
    assert set(got) == {(1, "hidden"), (0, "topk_ids")}, d["problems"]
    for sid, array, chunk in ((1, "hidden", 1), (0, "topk_ids", 2)):
        s = exp["shards"][sid]
        want = _samples_touching(s["offsets"], s["n"], chunk * CHUNK, (chunk + 1) * CHUNK)
        p = got[(sid, array)]
        assert p["check"] == "undecodable" and p["samples"] == want
        assert p["global_samples"] == [global_index(exp, sid, i) for i in want]
        assert f"shard {sid:05d} sample {want[0]}" in p["message"]
    out = run("verify", path, "--no-progress", code=1).output
    assert "2 problem(s)" in out and "shard 00001 sample" in out


def test_verify_nan_inf_and_bad_logprobs_written_through_zarr(cache):
    path, exp = cache
    root = zarr.open_group(str(path), mode="r+")
    off0, off1 = exp["shards"][0]["offsets"], exp["shards"][1]["offsets"]
    root["shards/00000/hidden"][int(off0[4]) + 1, 1, 3] = 0x7FC0  # bf16 NaN in sample 4, layer id 2
    root["shards/00001/hidden"][int(off1[1]), 2, 0] = 0xFF80  # bf16 -Inf in shard 1 sample 1, layer id 3
    root["shards/00000/topk_logprobs"][int(off0[2]), 0] = 0.5  # > 0 in sample 2
    lp = root["shards/00000/topk_logprobs"]
    t = int(off0[3]) + 2
    lp[t, K - 1] = float(lp[t, 0]) + 0.1  # still < 0, but ascending at the end: sample 3
    root["shards/00001/topk_ids"][int(off1[3]) - 1, 1] = exp["spec"].vocab_size  # sample 2
    d = run_json("verify", path, code=1)
    found = {(p["shard"], p["array"], p["check"], tuple(p["samples"])) for p in d["problems"]}
    assert (0, "hidden", "nan_inf", (4,)) in found
    assert (1, "hidden", "nan_inf", (1,)) in found
    assert (0, "topk_logprobs", "positive", (2,)) in found
    assert (0, "topk_logprobs", "not_descending", (3,)) in found
    assert (1, "topk_ids", "out_of_vocab", (2,)) in found
    assert len(found) == 5, d["problems"]
    nan = next(p for p in d["problems"] if p["shard"] == 0 and p["check"] == "nan_inf")
    assert "layers [2]" in nan["message"] and nan["global_samples"] == [4]
    assert next(p for p in d["problems"] if p["shard"] == 1 and p["array"] == "hidden")["global_samples"] == [global_index(exp, 1, 1)]


def test_verify_problem_cap(cache):
    path, exp = cache
    for chunk in range(5):  # five bad chunks: each reported, reading goes on past each
        f = path / "shards" / "00000" / "hidden" / "c" / str(chunk) / "0" / "0"
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x55
        f.write_bytes(bytes(raw))
    h = zarr.open_group(str(path), mode="r+")["shards/00001/hidden"]
    h[:] = np.full(h.shape, 0x7F80, dtype=np.uint16)  # every token of shard 1 is +Inf: one merged problem
    d = run_json("verify", path, "--max-problems", "3", code=1)
    assert d["num_problems"] == 6 and len(d["problems"]) == 3 and d["problems_left_out"] == 3
    d = run_json("verify", path, code=1)
    assert [p["tokens"][0] for p in d["problems"] if p["check"] == "undecodable"] == [0, 16, 32, 48, 64]
    inf = next(p for p in d["problems"] if p["check"] == "nan_inf")
    committed = len(exp["shards"][1]["fields"]["input_ids"])
    assert inf["shard"] == 1 and inf["samples"] == list(range(exp["shards"][1]["n"]))
    assert f"{committed * len(LAYER_IDS) * D} NaN/Inf values" in inf["message"]
    assert f"at {committed} token(s)" in inf["message"]


def test_verify_corrupt_offsets_and_duplicate_sources(cache):
    path, exp = cache
    root = zarr.open_group(str(path), mode="r+")
    off = exp["shards"][0]["offsets"]
    root["shards/00000/offsets"][3] = int(off[4]) + 1  # sample 3 gets a negative length
    root["shards/00001/source_index"][1] = int(exp["shards"][0]["source"][5])
    d = run_json("verify", path, code=1)
    checks = {(p["shard"], p["array"], p["check"]): p for p in d["problems"]}
    neg = checks[(0, "offsets", "offsets")]
    assert neg["samples"] == [3] and "shard 00000 sample 3" in neg["message"]
    assert (0, None, "plan_digest") not in checks  # the digest cannot be recomputed for an invalid plan
    dups = [p for p in d["problems"] if p["check"] == "duplicate"]
    assert sorted((p["shard"], p["samples"][0]) for p in dups) == [(0, 5), (1, 1)]
    assert dups[0]["global_samples"][0] in (5, global_index(exp, 1, 1))
    # the reader itself must still refuse nothing here: offsets[7] is intact
    C.CacheReader(str(path))


def test_verify_subtle_offsets_change_breaks_plan_digest(cache):
    path, exp = cache
    off = exp["shards"][0]["offsets"]
    zarr.open_group(str(path), mode="r+")["shards/00000/offsets"][3] = int(off[3]) + 1  # still monotone
    d = run_json("verify", path, code=1)
    assert [(p["shard"], p["check"]) for p in d["problems"]] == [(0, "plan_digest")]


def test_verify_sample_longer_than_max_length(cache):
    path, exp = cache
    attrs = dict(zarr.open_group(str(path), mode="r+").attrs[C.ATTRS_KEY])
    lengths = np.diff(exp["shards"][1]["offsets"])
    attrs["max_length"] = int(lengths[3]) - 1
    zarr.open_group(str(path), mode="r+").attrs[C.ATTRS_KEY] = attrs
    d = run_json("verify", path, code=1)
    too_long = [p for p in d["problems"] if p["check"] == "lengths"]
    want = {sid: np.flatnonzero(np.diff(s["offsets"]) > lengths[3] - 1).tolist() for sid, s in enumerate(exp["shards"])}
    assert {p["shard"]: p["samples"] for p in too_long} == {k: v for k, v in want.items() if v}
    assert 3 in want[1]


def test_verify_commit_record_past_offsets(cache):
    path, exp = cache
    g = zarr.open_group(str(path), mode="r+")["shards/00001"]
    g.attrs["commit"] = {"batches": 2, "samples": 4, "tokens": int(exp["shards"][1]["offsets"][4]) + 3}
    d = run_json("verify", path, code=1)
    assert any(p["shard"] == 1 and p["array"] == "offsets" and "commit record" in p["message"] for p in d["problems"])


# ----------------------------------------------------------------------------- show


def test_show_marks_assistant_text(cache, tiny_tokenizer, tiny_tokenizer_dir):
    path, exp = cache
    index = global_index(exp, 1, 2)  # shard 1, local sample 2
    s = exp["shards"][1]
    t0, t1 = int(s["offsets"][2]), int(s["offsets"][3])
    ids, mask = s["fields"]["input_ids"][t0:t1], s["fields"]["loss_mask"][t0:t1]
    answer = tiny_tokenizer.decode(ids[mask].tolist())
    assert answer == s["answers"][2]  # the reference itself round-trips
    for extra in ([], ["--tokenizer", tiny_tokenizer_dir]):  # recorded path, then the override
        out = run("show", path, index, *extra).output
        assert f"[[{answer}]]" in out
        assert f"source row {s['source'][2]}" in out and f"length {t1 - t0}" in out
    d = run_json("show", path, index, "--tokens", "5")
    assert d["shard_id"] == 1 and d["local_index"] == 2 and d["source_index"] == int(s["source"][2])
    assert d["tokenizer"]["hash_matches_cache"] is True
    assert [seg["text"] for seg in d["segments"] if seg["assistant"]] == [answer]
    assert len(d["tokens"]) == 5
    lp, top = s["fields"]["topk_logprobs"][t0:t1], s["fields"]["topk_ids"][t0:t1]
    for t in d["tokens"]:
        assert [p["id"] for p in t["top"]] == top[t["pos"], :3].tolist()
        np.testing.assert_allclose([p["prob"] for p in t["top"]], np.exp(lp[t["pos"], :3]), rtol=1e-6)
        assert t["top"][0]["text"] == tiny_tokenizer.decode([int(top[t["pos"], 0])])
    h = C.bf16_from_bits(s["fields"]["hidden"][t0:t1]).double().norm(dim=-1)  # (T, L)
    np.testing.assert_allclose([n["mean"] for n in d["layer_norms"]], h.mean(0).numpy(), rtol=1e-9)
    np.testing.assert_allclose([n["max"] for n in d["layer_norms"]], h.max(0).values.numpy(), rtol=1e-9)


def test_show_without_tokenizer_prints_ids(cache, tmp_path):
    path, exp = cache
    s = exp["shards"][0]
    ids, mask = s["fields"]["input_ids"][: s["offsets"][1]], s["fields"]["loss_mask"][: s["offsets"][1]]
    out = run("show", path, 0, "--tokenizer", tmp_path / "nowhere").output
    assert "no tokenizer" in out
    assert "[[" + " ".join(map(str, ids[mask].tolist())) + " ]]" in out
    run("show", path, sum(x["n"] for x in exp["shards"]), code=2)  # past the committed samples


# ----------------------------------------------------------------------------- stats


def test_stats_match_numpy(cache):
    path, exp = cache
    d = run_json("stats", path, "--threshold", "100")
    lengths = np.concatenate([np.diff(s["offsets"][: s["n"] + 1]) for s in exp["shards"]])
    edges = [0] + [2 ** e for e in range(int(np.ceil(np.log2(lengths.max() + 1))) + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    hist = {(b["lo"], b["hi"]): b["count"] for b in d["lengths"]["histogram"]}
    assert sum(hist.values()) == len(lengths)
    for i, c in enumerate(counts):
        assert hist.get((edges[i], edges[i + 1]), 0) == c
    assert d["lengths"]["mean"] == pytest.approx(lengths.mean())
    assert d["lengths"]["percentiles"]["90"] == pytest.approx(np.percentile(lengths, 90))
    mask = all_committed(exp, "loss_mask")
    assert d["assistant_fraction"] == pytest.approx(mask.mean())
    assert d["sampled"]["indices_all"] and d["sampled"]["samples"] == len(lengths)
    x = C.bf16_from_bits(all_committed(exp, "hidden")).double().numpy()  # (T, L, D)
    for j, lay in enumerate(d["activations"]["layers"]):
        v = x[:, j, :]
        assert lay["layer_id"] == LAYER_IDS[j]
        assert lay["mean"] == pytest.approx(v.mean(), abs=1e-9)
        assert lay["std"] == pytest.approx(v.std(), rel=1e-6)
        assert lay["rms"] == pytest.approx(np.sqrt((v ** 2).mean()), rel=1e-9)
        assert lay["abs_max"] == pytest.approx(np.abs(v).max())
        assert lay["frac_above_threshold"] == pytest.approx((np.abs(v) > 100).mean())
    assert d["activations"]["layers"][0]["frac_above_threshold"] > 0  # the planted outliers
    p = np.exp(all_committed(exp, "topk_logprobs").astype(np.float64))
    assert d["topk"]["mean_top1_prob"] == pytest.approx(p[:, 0].mean(), rel=1e-9)
    assert d["topk"]["mean_topk_mass"] == pytest.approx(p.sum(1).mean(), rel=1e-9)
    rest = 1 - p.sum(1)
    h = -(p * np.log(p)).sum(1) - rest * np.log(rest)
    assert d["topk"]["mean_entropy_lower_bound"] == pytest.approx(h.mean(), rel=1e-9)
    hits, total = 0, 0
    for s in exp["shards"]:
        for i in range(s["n"]):
            a, b = int(s["offsets"][i]), int(s["offsets"][i + 1])
            hits += int((s["fields"]["topk_ids"][a:b - 1, 0] == s["fields"]["input_ids"][a + 1:b]).sum())
            total += b - a - 1
    assert d["topk"]["top1_is_next_token"] == pytest.approx(hits / total)
    out = run("stats", path).output
    assert "#" in out and "abs max" in out and "top-1 prob" in out


def test_stats_subsample_is_seeded(cache):
    path, _ = cache
    a = run_json("stats", path, "--max-samples", "3", "--seed", "1")
    b = run_json("stats", path, "--max-samples", "3", "--seed", "1")
    c = run_json("stats", path, "--max-samples", "3", "--seed", "2")
    assert a == b and a["sampled"]["samples"] == 3 and not a["sampled"]["indices_all"]
    assert a["lengths"] == c["lengths"]  # lengths always cover every sample
    assert a["activations"] != c["activations"] or a["sampled"]["tokens"] != c["sampled"]["tokens"]
