"""Log-probs through the server: the official OpenAI client parses chat
(whole and streamed) and legacy completion log-probs, and they are the
library's."""

from __future__ import annotations

import pytest
from test_server import openai_client, prompt_ids
from test_server_fixtures import chat_pair, chat_server  # noqa: F401

from dflash_mlx import stream_generate
from dflash_mlx.server.templates import text_prompt

MESSAGES = [{"role": "user", "content": "w7 w8 w11"}]


def library(pair, ids, k):
    """(token texts, log-probs, top pairs as texts) of a greedy reply, EOS left out."""
    model, draft, tokenizer = pair
    eos = set(tokenizer.eos_token_ids)
    out = ([], [], [])
    for r in stream_generate(model, draft, tokenizer, ids, max_tokens=12, logprobs=k):
        for t, lp, top in zip(r.tokens, r.logprobs, r.top_logprobs or [[]] * len(r.tokens)):
            if t not in eos:
                out[0].append(tokenizer.decode([t]))
                out[1].append(lp)
                out[2].append([(tokenizer.decode([i]), v) for i, v in top])
    return out


def close(a, b):
    return a == pytest.approx(b, rel=1e-4, abs=1e-4)


def check_chat(entries, expected):
    tokens, logprobs, tops = expected
    assert [e.token for e in entries] == tokens
    assert close([e.logprob for e in entries], logprobs)
    for e, top in zip(entries, tops):
        assert e.bytes == list(e.token.encode("utf-8"))
        assert [t.token for t in e.top_logprobs] == [t for t, _ in top]
        assert close([t.logprob for t in e.top_logprobs], [v for _, v in top])


def test_chat_logprobs_whole_and_streamed(chat_pair, chat_server):
    expected = library(chat_pair, prompt_ids(chat_pair[2], MESSAGES), 3)
    assert expected[0]
    client = openai_client(chat_server)
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**kw)
    check_chat(reply.choices[0].logprobs.content, expected)

    entries = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries += chunk.choices[0].logprobs.content
    check_chat(entries, expected)

    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == reply.choices[0].message.content


def test_chat_logprobs_without_top(chat_pair, chat_server):
    expected = library(chat_pair, prompt_ids(chat_pair[2], MESSAGES), 0)
    client = openai_client(chat_server)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, logprobs=True)
    check_chat(reply.choices[0].logprobs.content, expected)


def test_completion_logprobs_legacy_layout(chat_pair, chat_server):
    model, draft, tokenizer = chat_pair
    expected = library(chat_pair, text_prompt(tokenizer, "w7 w8 w11", None), 2)
    client = openai_client(chat_server)
    kw = dict(model="tiny", prompt="w7 w8 w11", max_tokens=12, temperature=0, logprobs=2)
    reply = client.completions.create(**kw)
    lp = reply.choices[0].logprobs
    assert lp.tokens == expected[0]
    assert close(lp.token_logprobs, expected[1])
    assert [list(d) for d in lp.top_logprobs] == [[t for t, _ in top] for top in expected[2]]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    tokens, offsets = [], []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
