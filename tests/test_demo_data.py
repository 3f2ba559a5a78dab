"""The demo chats' answer check: the generator's own replies are right, a changed reply is
wrong, and a follow-up is judged against the reply the answering model gave before it."""

from __future__ import annotations

import copy

import pytest

from dflash.eval import demo_data


def replies(chat: dict) -> list[dict]:
    return [m for m in chat["messages"] if m["role"] == "assistant"]


def test_the_generators_own_replies_are_right():
    chats = demo_data.generate_chats(300, seed=3)
    checked = [demo_data.right_answers(chat, chat) for chat in chats]
    assert all(ok for turns in checked for _, ok in turns)
    assert sum(len(turns) for turns in checked) == sum(len(replies(c)) for c in chats)
    assert {task for turns in checked for task, _ in turns} == set(demo_data.PROMPT_PREFIXES)


def test_a_changed_reply_is_wrong_and_its_follow_up_follows_it():
    chats = demo_data.generate_chats(300, seed=3)
    chat = next(c for c in chats if any(m["content"] == "Say that again." for m in c["messages"]))
    follow = next(i for i, m in enumerate(chat["messages"]) if m["content"] == "Say that again.")
    answered = copy.deepcopy(chat)
    answered["messages"][follow - 1]["content"] = "something else."  # the reply before the follow-up
    turns = demo_data.right_answers(chat, answered)
    n_before = sum(m["role"] == "assistant" for m in chat["messages"][:follow])
    assert [ok for _, ok in turns][n_before - 1 : n_before + 1] == [False, False]  # the follow-up repeats the source's
    answered["messages"][follow + 1]["content"] = "something else."  # now it repeats what was answered
    turns = demo_data.right_answers(chat, answered)
    assert turns[n_before] == ("say_again", True) and turns[n_before - 1][1] is False


def test_capitals_follow_the_answered_reply():
    chat = {"messages": [{"role": "user", "content": "Repeat after me: apple river"},
                         {"role": "assistant", "content": "apple river"},
                         {"role": "user", "content": "Now in capital letters."},
                         {"role": "assistant", "content": "APPLE RIVER"}]}
    answered = copy.deepcopy(chat)
    answered["messages"][1]["content"] = "apple stone"
    answered["messages"][3]["content"] = "APPLE STONE"
    assert demo_data.right_answers(chat, answered) == [("repeat", False), ("capitals", True)]


def test_another_chat_is_refused():
    chat = demo_data.generate_chats(1, seed=0)[0]
    other = copy.deepcopy(chat)
    next(m for m in other["messages"] if m["role"] == "user")["content"] = "Count from 1000 to 1005."  # never generated
    with pytest.raises(ValueError, match="is not turn 0 of its source chat"):
        demo_data.right_answers(chat, other)
