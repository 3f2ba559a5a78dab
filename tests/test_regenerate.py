"""Regeneration (dflash.extract.regenerate): regenerated turns equal the target's own
greedy answers (reference: unbatched model.generate, turn by turn), resume after an
interruption gives the same dataset, metadata is recorded, extract reads the result."""

from __future__ import annotations

import json

import pytest
import torch

from dflash.extract import regenerate as regen
from dflash.extract import regenerate_cli as regen_cli

MAX_NEW = 6
LIMIT = 6


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


def _config(data, model_dir, out, **generation):
    settings = regen.GenerationSettings(max_new_tokens=MAX_NEW, dtype="float32", **generation)
    return regen.RegenConfig(data=str(data), model=str(model_dir), out=str(out), generation=settings,
                             batch_size=3, part_size=2, limit=LIMIT, progress=False)


def _rows(out):
    import datasets

    return datasets.load_from_disk(str(out)).to_list()


@pytest.fixture(scope="module")
def greedy_run(tmp_path_factory, target, tokenizer, tiny_target_dir, chats_sample_path):
    out = tmp_path_factory.mktemp("regen") / "greedy"
    meta = regen.regenerate(_config(chats_sample_path, tiny_target_dir, out), model=target, tokenizer=tokenizer)
    return out, meta


def _reference(target, tokenizer, messages):
    """Turn by turn with plain, unbatched model.generate (no code shared with regenerate)."""
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    history = []
    for message in messages:
        if message["role"] != "assistant":
            history.append(message)
            continue
        prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                  do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        new = new[: next((i for i, t in enumerate(new) if t in stops), len(new))]
        history.append({"role": "assistant", "content": tokenizer.decode(new)})
    return history


def test_regenerated_turns_are_the_targets_greedy_answers(greedy_run, target, tokenizer, chats_sample_path):
    out, meta = greedy_run
    source = [json.loads(line) for line in chats_sample_path.read_text().splitlines()][:LIMIT]
    rows = _rows(out)
    assert [r["source_row"] for r in rows] == list(range(LIMIT))
    multi_turn = 0
    for row in rows:
        original = source[row["source_row"]]["messages"]
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in original]
        assert row["messages"] == _reference(target, tokenizer, original)
        for new, old in zip(row["messages"], original):  # only assistant turns change
            if old["role"] != "assistant":
                assert new == old
        multi_turn += sum(m["role"] == "assistant" for m in original) > 1
    assert multi_turn > 0, "the sample should include a multi-turn chat (turn k conditions on regenerated turns)"


def test_metadata_records_how_it_was_made(greedy_run, tiny_target_dir, chats_sample_path):
    from dflash.shared.fingerprint import weights_hash

    out, meta = greedy_run
    on_disk = json.loads((out / regen.METADATA_FILE).read_text())
    assert on_disk == json.loads(json.dumps(meta))
    assert meta["target_fingerprint"]["weights_hash"] == weights_hash(tiny_target_dir)
    assert meta["source_fingerprint"]["content_hash"].startswith("sha256:")
    assert meta["generation"]["temperature"] == 0.0 and meta["generation"]["max_new_tokens"] == MAX_NEW
    assert meta["counts"]["rows_in"] == LIMIT and meta["counts"]["rows_out"] == LIMIT
    rows = _rows(out)
    assert meta["counts"]["turns_regenerated"] == sum(
        sum(m["role"] == "assistant" for m in r["messages"]) for r in rows)
    assert meta["counts"]["truncated_turns"] == sum(r["truncated_turns"] for r in rows)
    assert meta["parts"] == 3 and "tokenizer" in meta


def test_each_generate_call_is_recorded(target, tokenizer, tiny_target_dir, chats_sample_path, tmp_path, monkeypatch):
    """The metadata lists each generate() call: its rows, prompt width and decode steps as generate() returned them
    (half the vocabulary made stop tokens, so batches stop at different steps), and the tokens the rows kept."""
    monkeypatch.setattr(regen, "stop_token_ids", lambda *a: list(range(len(tokenizer) // 2, len(tokenizer))))
    calls, real = [], type(target).generate

    def generate(self, input_ids, **kwargs):
        out = real(self, input_ids=input_ids, **kwargs)
        calls.append((*input_ids.shape, out.shape[1] - input_ids.shape[1]))
        return out

    monkeypatch.setattr(type(target), "generate", generate)
    cfg = _config(chats_sample_path, tiny_target_dir, tmp_path / "out")
    cfg.generation.max_new_tokens = 12
    meta = regen.regenerate(cfg, model=target, tokenizer=tokenizer)
    batches = meta["batches_this_process"]
    assert [(b["rows"], b["width"], b["steps"]) for b in batches] == calls
    assert len({steps for *_, steps in calls}) > 1, calls
    assert sum(b["tokens"] for b in batches) == meta["counts"]["generated_tokens"] > 0


def test_extract_reads_the_result_and_masks_the_regenerated_turns(greedy_run, tokenizer):
    from dflash.extract.chat import render
    from dflash.extract.data import load_source, normalize_row

    out, _ = greedy_run
    ds = load_source(str(out))
    assert len(ds) == LIMIT
    conv = normalize_row(ds[0], 0, str(out))
    ids, mask = render(tokenizer, conv, max_length=4096)
    masked_text = tokenizer.decode(ids[mask])
    for message in conv.messages:
        if message["role"] == "assistant":
            assert message["content"] in masked_text


def test_interrupted_run_resumes_to_the_same_dataset(tmp_path, target, tokenizer, tiny_target_dir,
                                                     chats_sample_path, monkeypatch):
    """Sampling (seeded per part), so a resume that redid or reordered work would show."""
    sampled = dict(temperature=1.0, top_p=0.9, seed=3)
    straight = tmp_path / "straight"
    regen.regenerate(_config(chats_sample_path, tiny_target_dir, straight, **sampled), model=target,
                     tokenizer=tokenizer)

    resumed = tmp_path / "resumed"
    cfg = _config(chats_sample_path, tiny_target_dir, resumed, **sampled)
    assert regen.regenerate(cfg, model=target, tokenizer=tokenizer, max_parts=1) is None
    assert sorted(p.name for p in (resumed / regen.PARTS_DIR).glob("*.done.json")) == ["part-00000.done.json"]
    assert not (resumed / regen.METADATA_FILE).exists()

    real, calls = regen.generate_batch, []

    def dies_in_part_two(*args, **kwargs):  # part 1's first batch succeeds, its second crashes
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    monkeypatch.setattr(regen, "generate_batch", dies_in_part_two)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(cfg, model=target, tokenizer=tokenizer)
    monkeypatch.setattr(regen, "generate_batch", real)
    meta = regen.regenerate(cfg, model=target, tokenizer=tokenizer)
    assert meta is not None and meta["counts"]["rows_out"] == LIMIT
    assert _rows(resumed) == _rows(straight)
    # and sampling really differed from greedy somewhere, so the seed mattered
    greedy = tmp_path / "greedy"
    regen.regenerate(_config(chats_sample_path, tiny_target_dir, greedy), model=target, tokenizer=tokenizer)
    assert _rows(greedy) != _rows(straight)


def test_an_unknown_bad_row_policy_is_refused_by_name(tmp_path):
    cfg = regen.RegenConfig(data="d", model="m", out=str(tmp_path), on_bad_row="ignore")
    with pytest.raises(ValueError, match="on_bad_row must be one of 'skip', 'error', got 'ignore'"):
        cfg.validate()


def test_resume_with_other_settings_is_refused(greedy_run, target, tokenizer, tiny_target_dir, chats_sample_path):
    out, _ = greedy_run
    with pytest.raises(ValueError, match="generation"):
        regen.regenerate(_config(chats_sample_path, tiny_target_dir, out, temperature=0.7), model=target,
                         tokenizer=tokenizer)


def test_batch_size_defaults_by_device(target, tokenizer, tiny_target_dir, chats_sample_path, tmp_path):
    """In process, no --batch-size: 16 prompts a generate() call on the CPU (512 on a GPU); a given one is kept."""
    cfg = _config(chats_sample_path, tiny_target_dir, tmp_path / "out")
    cfg.batch_size = None
    assert regen.LocalEngine(cfg, model=target, tokenizer=tokenizer).batch_size == regen.BATCH_SIZE["cpu"] == 16
    cfg.batch_size = 5
    assert regen.LocalEngine(cfg, model=target, tokenizer=tokenizer).batch_size == 5


def test_generation_kwargs_override_model_defaults():
    greedy = regen.generation_kwargs(regen.GenerationSettings(), [1, 2], 0)
    assert greedy["do_sample"] is False and "temperature" not in greedy
    sampled = regen.generation_kwargs(regen.GenerationSettings(temperature=0.8, top_p=0.9), [1], 0)
    assert sampled["do_sample"] and sampled["temperature"] == 0.8 and sampled["top_p"] == 0.9
    assert sampled["top_k"] == 0  # Qwen3's generation_config top_k=20 must not leak in


def test_cli_runs(tmp_path, tiny_target_dir, chats_sample_path):
    from click.testing import CliRunner

    out = tmp_path / "cli"
    args = ["--data", str(chats_sample_path), "--model", str(tiny_target_dir), "--out", str(out), "--limit", "2",
            "--max-new-tokens", "3", "--dtype", "float32", "--part-size", "1"]
    result = CliRunner().invoke(regen_cli.main, args)
    assert result.exit_code == 0, result.output
    assert "2/2 rows" in result.output
    again = CliRunner().invoke(regen_cli.main, args)  # everything done: just re-finalises
    assert again.exit_code == 0, again.output
    assert len(_rows(out)) == 2


@pytest.mark.parametrize("room", [None, 40])
def test_static_cache_equals_the_plain_path(greedy_run, tmp_path, target, tokenizer, tiny_target_dir,
                                            chats_sample_path, monkeypatch, room):
    """The static-cache path (one cache for the run, batches padded to its rows; prompts longer
    than its room fall back to the plain path) gives the plain path's rows, in fp32 exactly."""
    fits = []
    original = regen.StaticDecoder.cache_for
    monkeypatch.setattr(regen.StaticDecoder, "cache_for",
                        lambda self, *a: fits.append(original(self, *a) is not None) or original(self, *a))
    monkeypatch.setattr(regen, "STATIC_SMALLEST_ROOM", 16)  # several rooms at the test's prompt lengths
    if room is not None:
        monkeypatch.setattr(regen, "STATIC_PROMPT_TOKENS", room)
    decoder_rooms = set()
    original_init = regen.StaticDecoder.__init__

    def init(self, *args):
        original_init(self, *args)
        self.caches = _Recording(decoder_rooms)

    monkeypatch.setattr(regen.StaticDecoder, "__init__", init)
    cfg = _config(chats_sample_path, tiny_target_dir, tmp_path / "static")
    cfg.static_cache, cfg.batch_size = True, 4
    regen.regenerate(cfg, model=target, tokenizer=tokenizer)
    assert _rows(tmp_path / "static") == _rows(greedy_run[0])
    assert True in fits and (room is None or False in fits), fits  # both paths ran where the room forces it
    assert room is not None or len(decoder_rooms) > 1, decoder_rooms  # several rooms were used


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_static_cache_on_cuda_equals_the_plain_path(tiny_target_dir, tokenizer, monkeypatch):
    """On CUDA generate() compiles the static path's decode step into CUDA graphs, with the grouped one-token
    attention: float32, its answers equal the plain path's, for prompts in two rooms and a batch padded to its rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = model.cuda().eval()
    settings = regen.GenerationSettings(max_new_tokens=MAX_NEW, dtype="float32")
    stops = regen.stop_token_ids(model, tokenizer)
    kwargs = regen.generation_kwargs(settings, stops, tokenizer.pad_token_id)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": "Say 'ok' " * n}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for n in (1, 2, 12)]
    plain = regen.generate_batch(model, prompts, kwargs, stops)
    monkeypatch.setattr(regen, "STATIC_SMALLEST_ROOM", 32)  # rooms 32 and 128 for prompts of 19, 26 and 96 tokens
    static = regen.StaticDecoder(model, 4, MAX_NEW, 128)
    assert model.config._attn_implementation == regen.GROUPED_DECODE
    for batch in (prompts[:2], prompts):  # the smallest room, then a longer prompt's room
        assert regen.generate_batch(model, batch, kwargs, stops, static) == plain[:len(batch)]
    assert len(static.caches) == 2


class _Recording(dict):
    """A dict that notes every key set in it."""

    def __init__(self, seen: set):
        super().__init__()
        self.seen = seen

    def __setitem__(self, key, value):
        self.seen.add(key)
        super().__setitem__(key, value)


def test_the_deepest_chat_starts_first_so_batches_stay_full(target, tokenizer, monkeypatch):
    """A chat's turns run one batch after another. One 3-turn chat with short prompts beside three 1-turn chats
    with long ones, 2 rows a batch: starting the deep chat first takes 3 batches (6 turns / 2 = its 3 turns in
    a row, the lower bound); taking the longest prompts first, as before, would take 4. Each chat's answers
    equal the unbatched reference either way, and each chat is reported done right after its last batch."""
    from dflash.extract.data import SkipCounter, normalize_row

    deep = [m for i in range(3) for m in ({"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "x"})]
    rows = [{"messages": deep}] + [{"messages": [{"role": "user", "content": "a much longer question " * (4 + i)},
                                                 {"role": "assistant", "content": "y"}]} for i in range(3)]
    skips = SkipCounter()
    chats = [regen.Chat.start(normalize_row(row, i, "rows"), skips) for i, row in enumerate(rows)]
    batches = []
    real = regen.generate_batch
    monkeypatch.setattr(regen, "generate_batch", lambda model, prompts, *a: batches.append(len(prompts)) or
                        real(model, prompts, *a))
    settings = regen.GenerationSettings(max_new_tokens=MAX_NEW, dtype="float32")
    done = []  # each chat once, as soon as its last turn is answered (the progress bar's rows)
    regen.regenerate_conversations(target, tokenizer, chats, settings, 2, skips,
                                   done=lambda chat: done.append((chat, chat.next_turn, len(batches))))
    assert batches == [2, 2, 2], batches
    assert [(c.conv.row_index, turn) for c, turn, _ in done] == [(3, None), (2, None), (1, None), (0, None)]
    assert [after for *_, after in done] == [1, 2, 3, 3]  # the longest 1-turn chat first, each after its batch
    for chat, row in zip(chats, rows):
        assert chat.messages == _reference(target, tokenizer, row["messages"])


def test_part_size_defaults_to_one_per_engine(tmp_path, target, tokenizer, tiny_target_dir, chats_sample_path):
    """In process a part is 4,096 rows by default (an unfinished part is redone whole, and each part ends in a tail
    of small batches); the run records the size it used, so a resume with another is refused by name."""
    cfg = _config(chats_sample_path, tiny_target_dir, tmp_path / "default")
    cfg.part_size, cfg.limit = None, 2
    meta = regen.regenerate(cfg, model=target, tokenizer=tokenizer)
    assert meta["part_size"] == regen.PART_SIZE["in process"] == 4096 and meta["parts"] == 1
    cfg.part_size = 1
    with pytest.raises(ValueError, match="part_size"):
        regen.regenerate(cfg, model=target, tokenizer=tokenizer)


def test_grouped_decode_attention_equals_transformers_sdpa(target):
    """A one-token query's heads grouped onto their key/value heads give transformers' SDPA attention (which copies
    the keys and values to every head), with a left-padding mask; longer queries take transformers' path itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention = target.model.layers[0].self_attn
    assert attention.num_key_value_groups == 2
    g = torch.Generator().manual_seed(0)
    for q_len in (1, 3):
        query = torch.randn(3, 4, q_len, 16, generator=g)
        key, value = torch.randn(2, 3, 2, 9, 16, generator=g)
        mask = torch.ones(3, 1, q_len, 9, dtype=torch.bool)
        mask[1, :, :, :4] = False  # a left-padded row
        mask = mask & torch.ones(q_len, 9, dtype=torch.bool).tril(9 - q_len)  # causal over the last q_len keys
        ours, _ = regen.grouped_decode_attention(attention, query, key, value, mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(attention, query, key, value, mask, scaling=0.25)
        torch.testing.assert_close(ours, theirs)
        assert ours.shape == (3, q_len, 4, 16)


def test_static_decoder_gives_an_sdpa_model_the_grouped_decode(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32, attn_implementation="sdpa")
    regen.StaticDecoder(model, 2, 4, 32)
    assert model.config._attn_implementation == regen.GROUPED_DECODE
    eager = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32, attn_implementation="eager")
    regen.StaticDecoder(eager, 2, 4, 32)
    assert eager.config._attn_implementation == "eager"  # another kernel asked for is left alone
