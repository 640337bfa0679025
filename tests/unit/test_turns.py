"""rlhf_core.turns: the retokenisation drift check tokenises a turn, not the conversation.

The check compares the chat template's rendering of the whole conversation, tokenised, with the
context ids. It tokenises only the text from the last added token an earlier check placed; these
tests hold it to the whole-text comparison on random conversations (policy turns of random ids,
so some are not what the tokenizer would write, and drift), for four tokenizers: the tiny
model's, a byte-level BPE and a Metaspace BPE (the pre-tokenizer that marks only the text's
first word) with ChatML's added tokens, and the tiny one with a template that re-renders history.
"""

from __future__ import annotations

import copy
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.sessions import PLAIN_TEMPLATE
from rlhf_core.models import load_tokenizer
from rlhf_core.turns import TemplateConversation, encode

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [f"count from {i} to {i + 7}: " + " ".join(str(j) for j in range(i, i + 8)) + " ok, next please." for i in range(200)]


def chatml_bpe(pre_tokenizer, decoder) -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizer, decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=alphabet, show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def tokenizers(tiny_model_cfg):
    plain = load_tokenizer(tiny_model_cfg)
    plain.chat_template = PLAIN_TEMPLATE
    trims = copy.deepcopy(plain)  # renders an assistant message trimmed: history differs from the turns
    trims.chat_template = PLAIN_TEMPLATE.replace("{{ m['content'] if m['content'] is string else '' }}",
                                                 "{{ (m['content'] if m['content'] is string else '')|trim }}")
    return {"tiny": plain, "tiny-trims-history": trims,
            "byte-level-bpe": chatml_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()),
            "metaspace-bpe": chatml_bpe(pre_tokenizers.Metaspace(prepend_scheme="first"), decoders.Metaspace(prepend_scheme="first"))}


def play(tok, rng: random.Random, turns: int, record: list[str] | None = None):
    """One conversation of random turns; yields (drift as after_turn counts it, drift of the
    whole text tokenised) after each turn."""
    conv = TemplateConversation(tok, [{"role": "user", "content": f"count from {rng.randint(0, 9)} FIRST"}])
    context = conv.initial_ids()
    specials = set(tok.all_special_ids)
    words = [i for i in range(len(tok)) if i not in specials]
    for turn in range(turns):
        if rng.random() < 0.5:  # a turn the tokenizer would write itself
            turn_ids = encode(tok, f" {rng.randint(0, 99)} and {rng.randint(0, 99)} ")
        else:  # any ids: often not the tokenizer's own spelling of their text
            turn_ids = [rng.choice(words) for _ in range(rng.randint(1, 12))]
            if rng.random() < 0.3:  # an added token's text spelt out in pieces (a character-level vocabulary drifts so)
                turn_ids += [tok.convert_tokens_to_ids(c) for c in tok.eos_token if c in tok.get_vocab()]
        if rng.random() < 0.7:
            turn_ids.append(tok.eos_token_id)
        context = context + turn_ids
        text = tok.decode(turn_ids, skip_special_tokens=True)  # the message content, as a client sends it back
        if record is not None:
            record.clear()
        ids, drift = conv.after_turn(context, turn_ids, text, f"ok {turn}, next please", "user")
        context = context + ids
        yield drift, encode(tok, conv.rendered) != context


@pytest.mark.parametrize("name", ["tiny", "tiny-trims-history", "byte-level-bpe", "metaspace-bpe"])
def test_the_drift_check_agrees_with_tokenising_the_whole_conversation(tokenizers, name):
    tok, rng = tokenizers[name], random.Random(7)
    seen = {True: 0, False: 0}
    for _ in range(40):
        for counted, whole in play(tok, rng, turns=6):
            assert counted == whole
            seen[whole] += 1
    assert seen[True] and seen[False]  # both cases came up


class Recording:
    """A tokenizer that records the texts it is asked to tokenise."""

    def __init__(self, tok) -> None:
        self.tok, self.texts = tok, []

    def __call__(self, text, **kwargs):
        self.texts.append(text)
        return self.tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("name", ["tiny", "byte-level-bpe"])
def test_a_turn_tokenises_its_own_text_not_the_whole_conversation(tokenizers, name):
    # Turns the tokenizer writes itself (no drift): after the first turns, nothing tokenised for
    # a turn holds the first message (marked FIRST), and its longest text stays as long however
    # long the conversation grows: it starts at the last added token the previous check placed.
    tok = Recording(tokenizers[name])
    conv = TemplateConversation(tok, [{"role": "user", "content": "count from 3 FIRST"}])
    context = conv.initial_ids()
    for turn in range(12):
        turn_ids = [*encode(tok, f" {turn} and {turn + 1} "), tok.eos_token_id]
        context = context + turn_ids
        tok.texts.clear()
        ids, drift = conv.after_turn(context, turn_ids, tok.decode(turn_ids, skip_special_tokens=True),
                                     f"ok {turn}, next please", "user")
        context = context + ids
        assert not drift
        if turn == 0:
            assert any("FIRST" in t for t in tok.texts)  # nothing checked yet: the whole text once
        else:  # from the end of the previous assistant message: two turns and their messages
            assert not any("FIRST" in t for t in tok.texts) and max(map(len, tok.texts)) < 130
    assert len(conv.rendered) > 5 * 130


def test_once_a_conversation_drifted_its_later_checks_tokenise_nothing(tokenizers):
    # A turn with a sampled <pad> in the middle: the message content leaves it out (as a client
    # sends the text back), so the rendering tokenises without it and the check counts drift.
    # The context keeps that turn's ids (token in, token out), so every later check would find
    # the same difference: they answer at once, where each tokenised the whole conversation
    # twice (the tail from the last checked place, then the whole text to confirm).
    tok = Recording(tokenizers["tiny"])
    conv = TemplateConversation(tok, [{"role": "user", "content": "count from 3"}])
    context = conv.initial_ids()
    drifts, tokenised = [], []
    for turn in range(6):
        turn_ids = encode(tok, f" {turn} and ")
        if turn == 1:
            turn_ids.append(tok.pad_token_id)
        turn_ids += [*encode(tok, f"{turn + 1} "), tok.eos_token_id]
        context = context + turn_ids
        ids, check = conv.next_turn(context, turn_ids, tok.decode(turn_ids, skip_special_tokens=True),
                                    f"ok {turn}, next please", "user")
        context = context + ids
        tok.texts.clear()
        drifts.append(check())
        tokenised.append(sum(map(len, tok.texts)))
        assert drifts[-1] == (encode(tokenizers["tiny"], conv.rendered) != context)  # what the whole text says
    assert drifts == [False, True, True, True, True, True]
    assert tokenised[1] > 0 and tokenised[2:] == [0, 0, 0, 0]
