import copy
import json

import numpy as np
import pytest

from dflash.extract import data as D
from dflash.extract.chat import mask_method, render
from dflash.extract.config import ExtractConfig
from dflash.extract.data import Conversation, DataError, SkippedSample

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def chat(*pairs, row=0):
    return Conversation("chat", messages=[{"role": r, "content": c} for r, c in pairs], source="data/x.jsonl", row_index=row)


HANDMADE = [
    chat(("user", "What is 2 + 2?"), ("assistant", "2 + 2 = 4.")),
    chat(("system", "You are terse."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"), ("assistant", "Bye!")),
    chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"), ("user", "e"), ("assistant", "f")),
    chat(("user", "Run it"), ("assistant", "Calling the tool."), ("tool", "result: 3"), ("assistant", "It is 3.")),
    chat(("user", "two in a row"), ("assistant", "First."), ("assistant", "Second.")),
    chat(("user", "trailing user turn"), ("assistant", "ok"), ("user", "no answer to this")),
    chat(("user", "unicode"), ("assistant", "ünïcødé ✓ — 東京 😀")),
    chat(("user", "spaces"), ("assistant", "  leading and trailing spaces  ")),
]


def sample_conversations(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [D.normalize_row(row, i, str(path)) for i, row in enumerate(rows)]


def reference(tokenizer, conv):
    """Expected ids and mask, built by tokenizing the toy template's pieces one by one."""
    ids, mask = [], []

    def add(text, in_loss):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([in_loss] * len(piece))

    for m in conv.messages:
        add(f"{IM_START}{m['role']}\n", False)
        add(m["content"], m["role"] == "assistant")
        add(IM_END, m["role"] == "assistant")
        add("\n", False)
    return np.array(ids, dtype=np.int32), np.array(mask, dtype=bool)


def all_conversations(chats_sample_path, chats_sharegpt_sample_path):
    return HANDMADE + sample_conversations(chats_sample_path) + sample_conversations(chats_sharegpt_sample_path)


# --- the mask is exactly the assistant tokens ------------------------------------------


def test_both_methods_match_reference(tiny_tokenizer, tiny_tokenizer_notags, chats_sample_path, chats_sharegpt_sample_path):
    assert mask_method(tiny_tokenizer) == "generation_tags" and mask_method(tiny_tokenizer_notags) == "template_probe"
    for conv in all_conversations(chats_sample_path, chats_sharegpt_sample_path):
        ref_ids, ref_mask = reference(tiny_tokenizer, conv)
        # the piecewise reference tokenizes like the full text, or it would prove nothing
        full = tiny_tokenizer.apply_chat_template(conv.messages, tokenize=False)
        assert tiny_tokenizer(full, add_special_tokens=False)["input_ids"] == ref_ids.tolist()
        results = [
            render(tiny_tokenizer, conv, max_length=4096),  # auto -> generation tags
            render(tiny_tokenizer_notags, conv, max_length=4096),  # auto -> template probe
            render(tiny_tokenizer, conv, max_length=4096, method="template_probe"),
        ]
        for ids, mask in results:
            assert ids.dtype == np.int32 and mask.dtype == bool
            np.testing.assert_array_equal(ids, ref_ids)
            np.testing.assert_array_equal(mask, ref_mask)


def test_tags_method_matches_hf_mask_on_plain_chats(tiny_tokenizer, chats_sample_path):
    """Cross-check against HF's own return_assistant_tokens_mask where boundaries are clean
    (HF's char-to-token mapping differs between versions on edge cases, so not there)."""
    for conv in sample_conversations(chats_sample_path):
        out = tiny_tokenizer.apply_chat_template(conv.messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = render(tiny_tokenizer, conv, max_length=4096)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.astype(int).tolist() == list(out["assistant_masks"])


def test_masked_tokens_decode_to_assistant_contents(tiny_tokenizer, tiny_tokenizer_notags):
    conv = HANDMADE[1]
    expected = "".join(m["content"] + IM_END for m in conv.messages if m["role"] == "assistant")
    for tok in (tiny_tokenizer, tiny_tokenizer_notags):
        ids, mask = render(tok, conv, max_length=512)
        assert tok.decode(ids[mask].tolist()) == expected
        # unmasked tokens are the headers, user/system turns and separators
        assert "Hello" not in tok.decode(ids[~mask].tolist())
        assert tok.decode(ids[~mask].tolist()).count("assistant\n") == 2


def test_text_rows_are_all_loss(tiny_tokenizer):
    conv = Conversation("text", text="Plain pretraining text.\nSecond line.", source="s", row_index=0)
    ids, mask = render(tiny_tokenizer, conv, max_length=512)
    assert ids.tolist() == tiny_tokenizer(conv.text)["input_ids"]
    assert mask.all() and len(mask) == len(ids)


# --- templates that differ from the toy one ---------------------------------------------


def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


# A Qwen3-like template (written for this test): the last assistant turn after the final
# user message gets an empty think block, earlier ones do not; with enable_thinking=False
# the generation prompt also writes the empty think block. @G@/@E@ mark where generation
# tags go in the tagged variant.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}@G@"
    "{%- if loop.last and loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>' }}@E@{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def qwen3_like(tokenizer, tags):
    g, e = ("{% generation %}", "{% endgeneration %}") if tags else ("", "")
    return with_template(tokenizer, QWEN3_LIKE.replace("@G@", g).replace("@E@", e))


def test_qwen3_like_template_without_tags(tiny_tokenizer):
    tagged, untagged = qwen3_like(tiny_tokenizer, True), qwen3_like(tiny_tokenizer, False)
    conv = HANDMADE[1]  # two assistant turns: only the last one gets the think block
    a = render(tagged, conv, max_length=512)
    b = render(untagged, conv, max_length=512)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert untagged.decode(b.input_ids[b.loss_mask].tolist()) == f"Hello.{IM_END}<think>\n\n</think>\n\nBye!{IM_END}"


def test_template_whose_prompt_differs_from_its_history(tiny_tokenizer):
    """With enable_thinking=False the generation prompt carries an empty think block that
    history turns lack: re-rendering a prefix as a prompt would not match, the walk does."""
    untagged, tagged = qwen3_like(tiny_tokenizer, False), qwen3_like(tiny_tokenizer, True)
    kwargs = {"enable_thinking": False}
    prompt = untagged.apply_chat_template(HANDMADE[1].messages[:2], tokenize=False, add_generation_prompt=True, **kwargs)
    assert not untagged.apply_chat_template(HANDMADE[1].messages, tokenize=False).startswith(prompt)
    a = render(tagged, HANDMADE[1], max_length=512, template_kwargs=kwargs)
    b = render(untagged, HANDMADE[1], max_length=512, template_kwargs=kwargs)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_chat_opening_with_an_assistant_turn(tiny_tokenizer, tiny_tokenizer_notags):
    conv = chat(("assistant", "Hi, how can I help?"), ("user", "x"), ("assistant", "y"))
    for tok in (tiny_tokenizer, tiny_tokenizer_notags):
        ids, mask = render(tok, conv, max_length=512)
        assert tok.decode(ids[mask].tolist()) == f"Hi, how can I help?{IM_END}y{IM_END}"


@pytest.mark.parametrize(
    "assistant_block",
    [
        "{% generation %}{{- m.content }}{% endgeneration %}{{- '<|im_end|>\\n' }}",  # end-of-turn outside
        "{% generation %}{{- m.content + '<|im_end|>\\n' }}{% endgeneration %}",  # separator inside
    ],
)
def test_end_of_turn_handling_does_not_depend_on_tag_placement(tiny_tokenizer, assistant_block):
    template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        + assistant_block
        + "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tok = with_template(tiny_tokenizer, template)
    for conv in HANDMADE:
        np.testing.assert_array_equal(render(tok, conv, max_length=512).loss_mask, reference(tok, conv)[1])


def test_token_straddling_the_header_boundary(tmp_path):
    """With a "\\n\\n" merge, header "\\n" + content "\\n..." becomes one token: both methods mark it."""
    from dflash.eval import toy_tokenizer as toy

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("para one\n\n\npara two\n\n" * 200)
    tagged = toy.build_tokenizer(tmp_path / "t", vocab_size=300, corpus=[corpus])
    untagged = toy.build_tokenizer(tmp_path / "u", vocab_size=300, generation_tags=False, corpus=[corpus])
    conv = chat(("user", "q"), ("assistant", "\n\npara"))
    a, b = render(tagged, conv, max_length=64), render(untagged, conv, max_length=64)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    tokens = tagged.convert_ids_to_tokens(a.input_ids.tolist())
    first = int(np.flatnonzero(a.loss_mask)[0])
    assert tagged.convert_tokens_to_string([tokens[first]]).startswith("\n\n")  # header's "\n" merged in


# --- errors, truncation and the skip policy ----------------------------------------------


def test_template_rejection_names_the_row(tiny_tokenizer, tiny_tokenizer_notags):
    conv = chat(("user", "u"), ("system", "late system"), ("assistant", "a"), row=17)
    for tok in (tiny_tokenizer, tiny_tokenizer_notags):
        with pytest.raises(DataError, match=r"^data/x\.jsonl row 17: chat template rejected .*system message must come first") as info:
            render(tok, conv, max_length=512)
        assert info.value.reason == "template_rejected"


def test_truncation_policies(tiny_tokenizer):
    conv = HANDMADE[2]
    full = render(tiny_tokenizer, conv, max_length=4096)
    n = len(full.input_ids)
    assert not full.truncated and full.num_tokens == n

    cut = render(tiny_tokenizer, conv, max_length=n - 3, truncation="right")
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[: n - 3])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[: n - 3])
    assert cut.truncated and cut.num_tokens == n

    with pytest.raises(DataError, match=rf"row 0: {n} tokens > max_length 10") as info:
        render(tiny_tokenizer, conv, max_length=10, truncation="error")
    assert info.value.reason == "too_long" and not isinstance(info.value, SkippedSample)
    with pytest.raises(SkippedSample) as info:
        render(tiny_tokenizer, conv, max_length=10, truncation="skip")
    assert info.value.reason == "too_long"
    # right truncation that leaves no assistant token: a counted skip, not a silent empty sample
    with pytest.raises(SkippedSample) as info:
        render(tiny_tokenizer, conv, max_length=5, truncation="right")
    assert info.value.reason == "no_loss_tokens"
    # an unknown policy is refused once, where the run's settings are checked
    with pytest.raises(ValueError, match="truncation must be one of 'right', 'skip', 'error', got 'left'"):
        ExtractConfig(data="d", model="m", out="o", truncation="left").validate()


def test_skip_policy_counts_render_failures(tiny_tokenizer):
    convs = [HANDMADE[0], chat(("user", "u"), ("system", "late"), ("assistant", "a"), row=1), HANDMADE[2], HANDMADE[3]]
    limit = len(render(tiny_tokenizer, HANDMADE[0], max_length=4096).input_ids)
    assert all(len(render(tiny_tokenizer, c, max_length=4096).input_ids) > limit for c in convs[2:])
    skips = D.SkipCounter()
    out = [D.guard("skip", skips, render, tiny_tokenizer, c, max_length=limit, truncation="skip") for c in convs]
    assert [o is None for o in out] == [False, True, True, True]
    assert skips.to_dict() == {"template_rejected": 1, "too_long": 2}
    # too_long under truncation="skip" is counted even when other bad rows are fatal
    skips = D.SkipCounter()
    assert D.guard("error", skips, render, tiny_tokenizer, HANDMADE[2], max_length=limit, truncation="skip") is None
    assert skips.to_dict() == {"too_long": 1}
    with pytest.raises(DataError, match="chat template rejected"):
        D.guard("error", skips, render, tiny_tokenizer, convs[1], max_length=limit)


def test_end_of_turn_from_the_template(tiny_tokenizer):
    """A template whose turns end with <|endoftext|>: learned from its rendering, with
    <|im_end|> still in the vocabulary; an explicit end_of_turn overrides it."""
    from dflash.extract.chat import end_of_turn_id

    template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|endoftext|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tok = with_template(tiny_tokenizer, template)
    conv = HANDMADE[1]
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|endoftext|>")
    ids, mask = render(tok, conv, max_length=512)
    assert tok.decode(ids[mask].tolist()) == "Hello.<|endoftext|>Bye!<|endoftext|>"
    # overriding with a token the template never writes leaves no end of turn to find
    with pytest.raises(DataError, match=r"no end-of-turn '<\|im_end\|>' after assistant message 2") as info:
        render(tok, conv, max_length=512, end_of_turn="<|im_end|>")
    assert info.value.reason == "mask_not_located"
    with pytest.raises(ValueError, match="not a token of the vocabulary"):
        end_of_turn_id(tok, "<|nope|>")


def test_content_as_a_list_of_text_parts(tiny_tokenizer):
    """Contents given as lists of text parts, rendered part by part by the template."""
    text_of = ("{%- if m.content is string %}{{- m.content }}{%- else %}"
               "{%- for p in m.content %}{%- if p.type == 'text' %}{{- p.text }}{%- endif %}{%- endfor %}{%- endif %}")
    template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' %}@G@" + text_of + "{{- '<|im_end|>' }}@E@{{- '\\n' }}"
        "{%- else %}" + text_of + "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    parts = lambda *texts: [{"type": "text", "text": t} for t in texts]  # noqa: E731
    conv = Conversation("chat", source="data/x.jsonl", row_index=0, messages=[
        {"role": "user", "content": parts("Look at ", "this.")}, {"role": "assistant", "content": parts("Seen", ".")},
        {"role": "user", "content": "plain"}, {"role": "assistant", "content": parts("Done.")}])
    tagged = with_template(tiny_tokenizer, template.replace("@G@", "{% generation %}").replace("@E@", "{% endgeneration %}"))
    untagged = with_template(tiny_tokenizer, template.replace("@G@", "").replace("@E@", ""))
    a, b = render(tagged, conv, max_length=512), render(untagged, conv, max_length=512)
    assert b.input_ids.tolist() == untagged.apply_chat_template(conv.messages, tokenize=True, return_dict=False)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert untagged.decode(b.input_ids[b.loss_mask].tolist()) == f"Seen.{IM_END}Done.{IM_END}"


def test_template_that_refuses_the_probe(tiny_tokenizer):
    """A template that needs a system message is probed with one; one that refuses every
    probe chat keeps its tags where it has them, and without them every row is refused."""
    template = (
        "{%- if messages[0].role != 'system' %}{{- raise_exception('a system message is required') }}{%- endif %}"
        "{%- if messages | length > 3 and @REFUSE@ %}{{- raise_exception('at most one exchange') }}{%- endif %}"
        "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        "@G@{{- m.content + '<|im_end|>' }}@E@{{- '\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )

    def variant(tags: bool, refuse_long: bool):
        text = template.replace("@REFUSE@", "true" if refuse_long else "false")
        g, e = ("{% generation %}", "{% endgeneration %}") if tags else ("", "")
        return with_template(tiny_tokenizer, text.replace("@G@", g).replace("@E@", e))

    needs_system = HANDMADE[1]  # a system message, then two exchanges
    for tags in (True, False):
        sample = render(variant(tags, refuse_long=False), needs_system, max_length=512)
        np.testing.assert_array_equal(sample.input_ids, reference(tiny_tokenizer, needs_system)[0])
        np.testing.assert_array_equal(sample.loss_mask, reference(tiny_tokenizer, needs_system)[1])

    short = chat(("system", "s"), ("user", "u"), ("assistant", "a"))  # the probes need two exchanges
    sample = render(variant(True, refuse_long=True), short, max_length=512)
    np.testing.assert_array_equal(sample.loss_mask, reference(tiny_tokenizer, short)[1])
    with pytest.raises(DataError, match=r"row 0: cannot learn the chat template's assistant turns: the template "
                                        r"rejected the probe chats .*at most one exchange") as info:
        render(variant(False, refuse_long=True), short, max_length=512)
    assert info.value.reason == "mask_not_located"


def test_close_spans_at_end_of_turn_matches_a_token_by_token_walk():
    """The vectorised closing of masked runs against its definition, walked token by token: a run keeps its tokens
    up to and including its first end-of-turn token, in it or right after it, and none after that."""
    from dflash.extract.chat import _close_spans_at_end_of_turn

    def walk(ids, mask, eot):
        out, run, closed = [], False, False
        for token, inside in zip(ids, mask):
            if inside and not run:  # a run starts here
                run, closed = True, False
            if inside:
                out.append(not closed)
                closed = closed or token == eot
            else:
                out.append(run and not closed and token == eot)  # the end of turn right after a run
                run = False
        return out

    rng = np.random.default_rng(0)
    for _ in range(3000):
        n = int(rng.integers(0, 40))
        ids, mask = rng.integers(0, 4, n), rng.random(n) < rng.random()
        assert _close_spans_at_end_of_turn(ids, mask, 2).tolist() == walk(ids.tolist(), mask.tolist(), 2)
    # the cases by hand: closed inside the run, right after it, and not at all
    assert _close_spans_at_end_of_turn([5, 2, 5, 9], [1, 1, 1, 0], 2).tolist() == [True, True, False, False]
    assert _close_spans_at_end_of_turn([5, 5, 2, 9], [1, 1, 0, 0], 2).tolist() == [True, True, True, False]
    assert _close_spans_at_end_of_turn([5, 5, 9, 2], [0, 1, 0, 0], 2).tolist() == [False, True, False, False]
