import json

import pytest
import torch

from toy_target import build_qwen3

from dflash.eval import toy_tokenizer as toy


def test_tokenizer_special_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    assert len(tok) == 512
    assert tok.eos_token == tok.pad_token == toy.END_OF_TEXT
    ids = tok.convert_tokens_to_ids([toy.IM_START, toy.IM_END, toy.MASK_TOKEN])
    assert len(set(ids)) == 3 and tok.unk_token_id not in ids
    # special tokens are never split, the mask token is a single, unused id
    encoded = tok("a<|im_end|>b<|MASK|>", add_special_tokens=False)["input_ids"]
    assert ids[1] in encoded and ids[2] in encoded
    text = "def f(x):\n    return x  # ünïcode ✓\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_templates_with_and_without_tags(tiny_tokenizer, tiny_tokenizer_notags):
    assert "{% generation %}" in tiny_tokenizer.chat_template
    assert "{% generation %}" not in tiny_tokenizer_notags.chat_template
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    for tok in (tiny_tokenizer, tiny_tokenizer_notags):
        assert tok.apply_chat_template(messages, tokenize=False) == expected
        prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n")


def test_tokenizer_is_deterministic(tmp_path):
    corpus = toy.default_corpus()[:2]
    toy.build_tokenizer(tmp_path / "a", vocab_size=300, corpus=corpus)
    toy.build_tokenizer(tmp_path / "b", vocab_size=300, corpus=corpus)
    a = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    b = json.loads((tmp_path / "b" / "tokenizer.json").read_text())
    assert a == b


def test_missing_corpus_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        toy.build_tokenizer(tmp_path, corpus=[tmp_path / "nope.txt"])


def test_toy_target_reloads_and_runs(tiny_target_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (tiny_target_dir / "model.safetensors").is_file()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (4, 64, len(tiny_tokenizer))
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert out.logits.shape == (1, len(ids), len(tok))
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
    assert torch.isfinite(out.logits).all()


def test_toy_target_is_seeded(tmp_path, tiny_tokenizer):
    from safetensors.torch import load_file

    rng_state = torch.random.get_rng_state()
    a = load_file(build_qwen3(tmp_path / "a", tiny_tokenizer, num_hidden_layers=1) / "model.safetensors")
    b = load_file(build_qwen3(tmp_path / "b", tiny_tokenizer, num_hidden_layers=1) / "model.safetensors")
    c = load_file(build_qwen3(tmp_path / "c", tiny_tokenizer, num_hidden_layers=1, seed=1) / "model.safetensors")
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # global RNG untouched
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_toy_target_bf16_and_tied(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    path = build_qwen3(tmp_path, tiny_tokenizer, num_hidden_layers=1, tie_word_embeddings=True, dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()


def test_committed_samples(chats_sample_path, chats_sharegpt_sample_path):
    """What the tests need of data/: single and multi-turn chats, system prompts, both formats."""
    rows = [json.loads(line) for line in chats_sample_path.read_text().splitlines()]
    assert len(rows) == 40
    turns = [sum(m["role"] == "assistant" for m in r["messages"]) for r in rows]
    assert min(turns) == 1 and max(turns) > 1
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    shared = [json.loads(line) for line in chats_sharegpt_sample_path.read_text().splitlines()]
    assert len(shared) == 10 and all({m["from"] for m in r["conversations"]} >= {"human", "gpt"} for r in shared)
