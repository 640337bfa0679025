"""PromptRenderer: chat template when the tokenizer has one, raw text otherwise, and the
length policy (reject or left-truncate), always counted."""

from __future__ import annotations

import copy

import pytest

from rlhf_core.models import load_tokenizer
from rlhf_core.records import Prompt
from rollout_workers.prompts import PromptRejected, PromptRenderer, PromptTooLong

# A minimal Jinja chat template: "<role>content\n" per turn, then "<assistant>" to answer.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def plain_tok(tiny_model_cfg):
    tok = load_tokenizer(tiny_model_cfg)
    assert not getattr(tok, "chat_template", None)  # the tiny tokenizer has no template
    return tok


@pytest.fixture(scope="module")
def chat_tok(plain_tok):
    tok = copy.deepcopy(plain_tok)
    tok.chat_template = TEMPLATE
    return tok


def char_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_raw_text_without_a_chat_template(plain_tok):
    r = PromptRenderer(plain_tok, max_prompt_tokens=64)
    text, ids = r.render(Prompt("p", "7:", messages=[{"role": "user", "content": "ignored: text wins"}]))
    assert not r.uses_chat_template
    assert text == "7:"
    assert ids == char_ids(plain_tok, "7:") and len(ids) == 2
    assert r.counters.as_dict() == {"prompts_rendered": 1, "prompts_truncated": 0, "prompts_rejected": 0,
                                    "prompts_empty_text": 0, "prompt_tokens_cut": 0}


def test_messages_without_template_and_without_text_are_joined(plain_tok):
    r = PromptRenderer(plain_tok, max_prompt_tokens=64)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text, ids = r.render(Prompt("p", "", messages=msgs))
    assert text == "be brief\nhi"
    assert ids == char_ids(plain_tok, "be brief\nhi")


def test_chat_template_applied_to_messages(chat_tok):
    r = PromptRenderer(chat_tok, max_prompt_tokens=64)
    msgs = [{"role": "system", "content": "count"}, {"role": "user", "content": "7:"}]
    text, ids = r.render(Prompt("p", "7:", messages=msgs))
    assert r.uses_chat_template
    assert text == "<system>count\n<user>7:\n<assistant>"
    assert ids == char_ids(chat_tok, text) and len(ids) == len(text)


def test_chat_template_wraps_plain_text_as_one_user_turn(chat_tok):
    r = PromptRenderer(chat_tok, max_prompt_tokens=64)
    text, ids = r.render(Prompt("p", "hello"))
    assert text == "<user>hello\n<assistant>"
    assert len(ids) == 23  # 6 + 5 + 1 + 11 characters, one token each


def test_too_long_is_rejected_and_counted(plain_tok):
    r = PromptRenderer(plain_tok, max_prompt_tokens=4, overflow="reject")
    with pytest.raises(PromptTooLong) as info:
        r.render(Prompt("long-1", "abcdef"))
    assert str(info.value).startswith(
        "prompt 'long-1' has 6 tokens, more than rollout.max_prompt_tokens=4 (rollout.prompt_overflow=reject)")
    assert (r.counters.rejected, r.counters.rendered, r.counters.truncated) == (1, 0, 0)
    # exactly at the limit is fine
    assert r.render(Prompt("ok", "abcd"))[1] == char_ids(plain_tok, "abcd")
    assert (r.counters.rejected, r.counters.rendered) == (1, 1)


def test_too_long_is_left_truncated_and_counted(plain_tok):
    r = PromptRenderer(plain_tok, max_prompt_tokens=4, overflow="truncate")
    text, ids = r.render(Prompt("long-2", "abcdef"))
    assert text == "abcdef"  # the text as written (reward functions see it); the ids are cut
    assert ids == char_ids(plain_tok, "cdef")  # the end is kept
    _, ids = r.render(Prompt("long-3", "0123456789"))
    assert ids == char_ids(plain_tok, "6789")
    assert r.counters.as_dict() == {"prompts_rendered": 2, "prompts_truncated": 2, "prompts_rejected": 0,
                                    "prompts_empty_text": 0, "prompt_tokens_cut": 2 + 6}


def test_truncation_applies_after_the_chat_template(chat_tok):
    r = PromptRenderer(chat_tok, max_prompt_tokens=12, overflow="truncate")
    _, ids = r.render(Prompt("p", "hello"))
    assert ids == char_ids(chat_tok, "\n<assistant>")  # the last 12 of "<user>hello\n<assistant>"
    assert r.counters.tokens_cut == 23 - 12


def test_empty_prompt_is_rejected_and_counted(plain_tok):
    r = PromptRenderer(plain_tok, max_prompt_tokens=4)
    with pytest.raises(PromptRejected, match="prompt 'e' has no tokens after rendering") as info:
        r.render(Prompt("e", ""))
    assert not isinstance(info.value, PromptTooLong)
    assert (r.counters.empty, r.counters.rendered) == (1, 0)


def test_bad_policy_is_refused(plain_tok):
    with pytest.raises(ValueError, match="prompt_overflow='drop' is not one of reject, truncate"):
        PromptRenderer(plain_tok, 4, "drop")
    with pytest.raises(ValueError, match="max_prompt_tokens must be >= 1"):
        PromptRenderer(plain_tok, 0)
