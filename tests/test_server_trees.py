"""The server verifying draft trees: serve's --tree-budget is every
request's, replies stay the target's own greedy text, usage.dflash says
what was verified, and the batched path decodes plainly (no trees)."""

from __future__ import annotations

import httpx
import pytest
from test_server_batch import chat_ids, mlx_lm_greedy, params, serve_waiting
from test_server_fixtures import chat_pair, serving  # noqa: F401

import dflash_mlx.server.decoder
from dflash_mlx.server.config import ServerConfig
from dflash_mlx.server.service import Service

PROMPT = "w12 w13 w14 w12 w13 w14 w12 w13"


@pytest.fixture
def calls(monkeypatch):
    """The server's stream_generate, recording each call's keyword arguments."""
    real = dflash_mlx.server.decoder.stream_generate
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash_mlx.server.decoder, "stream_generate", recording)
    return seen


@pytest.mark.parametrize("budget, lookup", [(12, False), ("auto", False), (10, True)])
def test_tree_replies_are_the_targets_greedy_text_with_their_figures(chat_pair, calls, budget, lookup):
    model, _, tokenizer = chat_pair
    ids = chat_ids(tokenizer, PROMPT)
    (result,) = serve_waiting(
        chat_pair, [{"prompt": ids, "params": params(16)}], tree_budget=budget, lookup=lookup, batching="off"
    )
    text, tokens, _ = mlx_lm_greedy(model, tokenizer, ids, 16)
    assert result["reply"].content == text and result["done"].usage.completion_tokens == tokens
    assert [c["tree_budget"] for c in calls] == [budget]
    usage = result["done"].usage.dflash
    assert usage["path"] == "dflash" and usage["tree_budget"] == budget
    drafting = usage["cycles"] - usage["plain_cycles"]
    assert usage["rows_verified"] >= drafting * 4  # the smallest tree auto chooses has 4 rows
    if budget == 12:  # the drafter's blocks are 6 rows: these are trees
        assert set(usage["block_sizes"]) - {1} == {12} and usage["rows_verified"] == 12 * drafting
    if lookup:
        assert usage["lookup_hits"] > 0 and usage["acceptance_length"] > 1


def test_without_trees_the_usage_says_so(chat_pair, calls):
    model, _, tokenizer = chat_pair
    ids = chat_ids(tokenizer, PROMPT)
    (result,) = serve_waiting(chat_pair, [{"prompt": ids, "params": params(8)}], block_size=4, batching="off")
    usage = result["done"].usage.dflash
    assert calls[0]["tree_budget"] is None and usage["tree_budget"] is None
    assert usage["rows_verified"] == 4 * (usage["cycles"] - usage["plain_cycles"])


def test_the_batched_path_decodes_plainly_and_says_so(chat_pair, calls):
    model, _, tokenizer = chat_pair
    ids = [chat_ids(tokenizer, p) for p in (PROMPT, "w20 w21", "w30")]
    results = serve_waiting(chat_pair, [{"prompt": i, "params": params(10)} for i in ids], tree_budget=12,
                            batching="always")  # fmt: skip
    for i, r in zip(ids, results):
        usage = r["done"].usage.dflash
        assert usage["path"] == "batched" and usage["tree_budget"] is None and usage["rows_verified"] == 0
        assert r["reply"].content == mlx_lm_greedy(model, tokenizer, i, 10)[0]
    assert calls == []


def test_a_tree_budget_the_server_cannot_serve_is_refused_at_start(chat_pair):
    model, draft, tokenizer = chat_pair
    with pytest.raises(ValueError, match="draft trees need a DFlash drafter"):
        Service(model, None, tokenizer, ServerConfig(lookup=True, tree_budget=8))
    with pytest.raises(ValueError, match=r"cannot verify draft trees over its KV caches .*--tree-budget auto"):
        Service(model, draft, tokenizer, ServerConfig(tree_budget=8, max_kv_size=64))
    with pytest.raises(ValueError, match="tree_budget must be"):
        Service(model, draft, tokenizer, ServerConfig(tree_budget=0))


def test_auto_over_caches_without_trees_serves_blocks(chat_pair, calls):
    model, _, tokenizer = chat_pair
    ids = chat_ids(tokenizer, PROMPT)
    (result,) = serve_waiting(chat_pair, [{"prompt": ids, "params": params(8)}], tree_budget="auto", max_kv_size=64,
                              batching="off")  # fmt: skip
    assert calls[0]["tree_budget"] is None and result["done"].usage.dflash["tree_budget"] is None
    assert result["reply"].content == mlx_lm_greedy(model, tokenizer, ids, 8)[0]


def test_usage_over_http_has_the_tree_fields(chat_pair):
    model, draft, tokenizer = chat_pair
    with serving(model, draft, tokenizer, tree_budget=12, batching="off") as url:
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
        openai = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        anthropic = httpx.post(f"{url}/v1/messages", json=body, timeout=60).json()
    for usage in (openai["usage"]["dflash"], anthropic["usage"]["dflash"]):
        assert usage["tree_budget"] == 12 and usage["rows_verified"] > 0
    assert (
        openai["choices"][0]["message"]["content"] == mlx_lm_greedy(model, tokenizer, chat_ids(tokenizer, PROMPT), 8)[0]
    )
