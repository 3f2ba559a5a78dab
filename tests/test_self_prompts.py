"""Self-prompting (QuestionSampler in extract/regenerate.py, `dflash-regenerate --self-prompts N`): the user
header is the template's own start of a user turn; the questions are what the target samples
after it (reference: model.generate from the header, seeded as the run); the answers are the
target's greedy answers (test_regenerate's reference); duplicates across the whole run,
resumed parts included, are dropped and counted; the CLI refuses what cannot work."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from test_regenerate import MAX_NEW, _reference
from test_templates import (  # noqa: F401 - qwen3, qwen3_extended, qwen3_tokenizer_dir: the fixtures
    marked_template, qwen3, qwen3_extended, qwen3_tokenizer_dir, variant)

from dflash.extract import regenerate as regen
from dflash.extract import regenerate_cli as regen_cli
from dflash.extract.chat import user_header
from dflash.extract.regenerate import QuestionSampler

QUESTION_MAX = 12
MIN_CHARS = 12
END_BIAS = 4.0

# ChatML with a default system prompt, as SmolLM2-135M-Instruct's template writes it.
DEFAULT_SYSTEM_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _rendered_user_turn(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)


@pytest.mark.parametrize("name, end", [("tiny", "<|im_end|>"), ("default-system", "<|im_end|>"),
                                       ("qwen3", "<|im_end|>"), ("llama31", "<|eot_id|>"),
                                       ("gemma", "<end_of_turn>"), ("mistral", "[/INST]")])
def test_user_header_is_the_templates_own_start_of_a_user_turn(name, end, tiny_tokenizer, qwen3, qwen3_extended):
    tok = {"tiny": tiny_tokenizer, "default-system": variant(tiny_tokenizer, DEFAULT_SYSTEM_CHATML),
           "qwen3": qwen3}.get(name) or variant(qwen3_extended, marked_template(name, False))
    header, end_of_user_turn = user_header(tok)
    x, y = _rendered_user_turn(tok, "X"), _rendered_user_turn(tok, "Y")
    common = next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)
    assert header == x[:common] and end_of_user_turn == end
    if name == "default-system":
        assert header == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                          "Face<|im_end|>\n<|im_start|>user\n")


@pytest.mark.parametrize("content", ["message['content'] + message['content']", "message['content'] | upper"])
def test_a_template_that_rewrites_user_text_is_refused(tiny_tokenizer, content):
    tok = variant(tiny_tokenizer, "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                                  + content + " + '<|im_end|>\\n' }}{% endfor %}")
    with pytest.raises(ValueError, match="--self-prompts cannot find its user header"):
        user_header(tok)


def test_sampler_drops_and_counts_truncated_empty_short_and_duplicate_questions(tiny_tokenizer):
    texts = ["What is a list?", "What  is a\nlist? ", "   ", "", "Hi?", "Why is the sky blue?", "cut off here"]
    outputs = [(tiny_tokenizer(t, add_special_tokens=False)["input_ids"], t == "cut off here") for t in texts]
    asked = []

    def generate(prompts):
        asked.extend(prompts)
        return [outputs.pop(0) for _ in prompts]

    sampler = QuestionSampler(generate, tiny_tokenizer, "HEADER", 8, 3)
    convs, record = sampler.chats(range(10, 17))
    assert asked == [tiny_tokenizer("HEADER", add_special_tokens=False)["input_ids"]] * 7  # the header's ids
    assert [(c.row_index, c.messages) for c in convs] == [
        (-11, [{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": ""}]),
        (-16, [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": ""}])]
    assert record == {"self_prompts": {"generated": 7, "truncated": 1, "empty": 2, "too_short": 1, "duplicates": 1,
                                       "kept": 2},
                      "questions": ["What is a list?", "Why is the sky blue?"]}


# --- runs on the tiny target -------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def ending_target(tiny_target_dir, tokenizer):
    """The tiny target with <|im_end|>'s logit raised by END_BIAS except right after a newline
    (where a header ends): the random model then ends its questions after a few tokens yet
    starts every answer. Still a function of the tokens, so every reference sees it too."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer("\n")["input_ids"][-1]
    current = {}
    model.register_forward_pre_hook(lambda module, args, kwargs: current.update(ids=kwargs["input_ids"]),
                                    with_kwargs=True)

    def raise_end(module, args, logits):  # logits (B, T, V) for the last T input tokens
        logits = logits.clone()
        logits[..., end] += END_BIAS * (current["ids"][:, -logits.shape[1]:] != newline)
        return logits

    model.lm_head.register_forward_hook(raise_end)
    return model


def _config(out, tiny_target_dir, count, data=None, **prompting):
    prompting = {"question_max_tokens": QUESTION_MAX, "question_min_chars": MIN_CHARS, **prompting}
    return regen.RegenConfig(data=data and str(data), model=str(tiny_target_dir), out=str(out),
                             generation=regen.GenerationSettings(max_new_tokens=MAX_NEW, dtype="float32"),
                             batch_size=4, part_size=4, limit=2, progress=False,
                             self_prompts=count, **prompting)


def _rows(out):
    import datasets

    return datasets.load_from_disk(str(out)).to_list()


def _sampled_questions(model, tokenizer, part, rows, settings):
    """Reference: what model.generate samples after the header for one part (seeded as the run)."""
    header = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False).split("Q")[0]
    ids = tokenizer(header, add_special_tokens=False, return_tensors="pt")["input_ids"].repeat(rows, 1)
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    sampling = (dict(do_sample=True, temperature=settings.question_temperature, top_p=settings.question_top_p,
                     top_k=0) if settings.question_temperature > 0 else dict(do_sample=False))
    torch.manual_seed(part)  # seed 0
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=QUESTION_MAX,
                             eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, **sampling)
    questions = []
    for new in out[:, ids.shape[1]:].tolist():
        cut = next((i for i, t in enumerate(new) if t in stops), None)
        questions.append(None if cut is None else tokenizer.decode(new[:cut]).strip())  # None: truncated
    return questions


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory, ending_target, tokenizer, tiny_target_dir):
    out = tmp_path_factory.mktemp("self_prompts") / "sampled"
    meta = regen.regenerate(_config(out, tiny_target_dir, 8), model=ending_target, tokenizer=tokenizer)
    return out, meta


def test_questions_are_the_targets_samples_and_answers_its_greedy_answers(sampled_run, ending_target, tokenizer):
    out, meta = sampled_run
    settings = regen.RegenConfig(None, None, "")
    expected, seen, reasons = [], set(), []
    for part in range(2):
        for i, question in enumerate(_sampled_questions(ending_target, tokenizer, part, 4, settings)):
            key = None if question is None else " ".join(question.split())
            reason = ("truncated" if key is None else "empty" if not key else "too_short" if len(key) < MIN_CHARS
                      else "duplicates" if key in seen else "kept")
            reasons.append(reason)
            if reason == "kept":
                seen.add(key)
                expected.append((-1 - (part * 4 + i), question))
    rows = _rows(out)
    assert [(r["source_row"], r["messages"][0]["content"]) for r in rows] == expected
    for row in rows:
        assert row["messages"] == _reference(ending_target, tokenizer, row["messages"][:1] + [
            {"role": "assistant", "content": ""}])
    counts = meta["counts"]["self_prompts"]
    assert counts == {key: reasons.count(key) for key in ("generated", "truncated", "empty", "too_short",
                                                           "duplicates", "kept")} | {"generated": 8}
    assert counts["kept"] >= 2 and counts["truncated"] and counts["too_short"], counts  # each occurs here
    assert meta["counts"]["rows_in"] == 8
    parts = [json.loads(p.read_text()) for p in sorted((out / regen.PARTS_DIR).glob("*.done.json"))]
    assert [p["self_prompts"]["generated"] for p in parts] == [4, 4]
    run = json.loads((out / regen.RUN_FILE).read_text())
    assert run["self_prompts"]["self_prompts"] == 8 and run["self_prompts"]["header"] == "<|im_start|>user\n"
    assert run["self_prompts"]["question_temperature"] == 1.0 and run["self_prompts"]["question_top_p"] == 0.95


def test_greedy_questions_are_duplicates_dropped_across_a_resumed_run(tmp_path, ending_target, tokenizer,
                                                                     tiny_target_dir):
    """Temperature 0 writes the same question every time: one kept, N - 1 duplicates, also when
    the run stops after a part and resumes (the dedup remembers the finished parts)."""
    straight = tmp_path / "straight"
    meta = regen.regenerate(_config(straight, tiny_target_dir, 10, question_temperature=0.0, question_min_chars=1),
                            model=ending_target, tokenizer=tokenizer)
    assert meta["counts"]["self_prompts"] == {"generated": 10, "truncated": 0, "empty": 0, "too_short": 0,
                                              "duplicates": 9, "kept": 1}
    (question,) = _sampled_questions(ending_target, tokenizer, 0, 1, regen.RegenConfig(None, None, "", question_temperature=0.0))
    assert [r["messages"][0]["content"] for r in _rows(straight)] == [question]

    resumed = tmp_path / "resumed"
    cfg = _config(resumed, tiny_target_dir, 10, question_temperature=0.0, question_min_chars=1)
    assert regen.regenerate(cfg, model=ending_target, tokenizer=tokenizer, max_parts=1) is None
    again = regen.regenerate(cfg, model=ending_target, tokenizer=tokenizer)
    assert again["counts"] == meta["counts"] and _rows(resumed) == _rows(straight)


def test_interrupted_sampled_run_resumes_to_the_same_dataset(sampled_run, tmp_path, ending_target, tokenizer,
                                                             tiny_target_dir):
    cfg = _config(tmp_path / "resumed", tiny_target_dir, 8)
    assert regen.regenerate(cfg, model=ending_target, tokenizer=tokenizer, max_parts=1) is None
    meta = regen.regenerate(cfg, model=ending_target, tokenizer=tokenizer)
    assert _rows(tmp_path / "resumed") == _rows(sampled_run[0]) and meta["counts"] == sampled_run[1]["counts"]
    with pytest.raises(ValueError, match="self_prompts"):  # other question settings: refused on resume
        regen.regenerate(_config(tmp_path / "resumed", tiny_target_dir, 8, question_top_p=0.5),
                         model=ending_target, tokenizer=tokenizer)


def test_static_cache_samples_the_same_questions(sampled_run, tmp_path, ending_target, tokenizer, tiny_target_dir,
                                                 monkeypatch):
    """The run's StaticDecoder samples the questions too (every batch fills its rows, so the RNG
    draws as on the plain path); fp32 gives the plain path's rows."""
    fits = []
    original = regen.StaticDecoder.cache_for
    monkeypatch.setattr(regen.StaticDecoder, "cache_for",
                        lambda self, *a: fits.append(original(self, *a) is not None) or original(self, *a))
    cfg = _config(tmp_path / "static", tiny_target_dir, 8)
    cfg.static_cache = True
    regen.regenerate(cfg, model=ending_target, tokenizer=tokenizer)
    assert _rows(tmp_path / "static") == _rows(sampled_run[0])
    assert len(fits) > 2 and all(fits), fits  # two question batches and the answers


def test_mixed_with_a_dataset_the_datasets_rows_come_first(tmp_path, ending_target, tokenizer, tiny_target_dir,
                                                           chats_sample_path):
    from dflash.extract.data import load_source, normalize_row

    out = tmp_path / "mixed"
    meta = regen.regenerate(_config(out, tiny_target_dir, 4, data=chats_sample_path), model=ending_target,
                            tokenizer=tokenizer)
    ds = load_source(str(out))
    source_rows = [row["source_row"] for row in ds]
    assert source_rows[:2] == [0, 1] and len(source_rows) > 2 and all(r < 0 for r in source_rows[2:])
    assert meta["counts"]["rows_in"] == 2 + 4 and meta["counts"]["self_prompts"]["generated"] == 4
    conv = normalize_row(ds[len(ds) - 1], len(ds) - 1, str(out))
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]


def test_cli_refuses_what_cannot_work(tmp_path):
    out = str(tmp_path / "o")
    cases = [(["--self-prompts", "3", "--out", out], "--self-prompts needs the target in process"),
             (["--self-prompts", "3", "--endpoint", "http://127.0.0.1:9/v1", "--out", out], "without --endpoint"),
             (["--self-prompts", "-1", "--model", "m", "--out", out], "self_prompts must be 0 or more, got -1"),
             (["--model", "m", "--out", out], "give --data (a chat dataset) or --self-prompts N")]
    for args, message in cases:
        result = CliRunner().invoke(regen_cli.main, args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_adds_self_prompted_questions_to_a_dataset(tmp_path, tiny_target_dir, chats_sample_path):
    args = ["--data", str(chats_sample_path), "--limit", "1", "--self-prompts", "2", "--question-max-tokens", "3",
            "--model", str(tiny_target_dir), "--out", str(tmp_path / "cli"), "--max-new-tokens", "3",
            "--dtype", "float32"]
    result = CliRunner().invoke(regen_cli.main, args)
    assert result.exit_code == 0, result.output
    assert "self-prompted questions {" in result.output and "'generated': 2" in result.output
    assert json.loads((tmp_path / "cli" / regen.RUN_FILE).read_text())["self_prompts"]["question_max_tokens"] == 3
