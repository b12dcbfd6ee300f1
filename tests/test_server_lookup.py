"""The server drafting by prompt lookup: beside the drafter, and alone for a
model without one; replies are the target's own greedy text either way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_server_batch import chat_ids, mlx_lm_greedy, params, serve_waiting
from test_server_fixtures import chat_pair  # noqa: F401

from dflash_mlx.server.config import ServerConfig
from dflash_mlx.server.service import Service


@pytest.mark.parametrize("lookup, alone", [(True, False), ("auto", False), (True, True)])
def test_lookup_replies_are_the_targets_greedy_text(chat_pair, lookup, alone):
    model, draft, tokenizer = chat_pair
    pair = (model, None if alone else draft, tokenizer)
    ids = chat_ids(tokenizer, "w12 w13 w14 w12 w13 w14 w12 w13")
    (result,) = serve_waiting(pair, [{"prompt": ids, "params": params(16)}], lookup=lookup, batching="off")
    text, tokens, _ = mlx_lm_greedy(model, tokenizer, ids, 16)
    assert result["reply"].content == text and result["done"].usage.completion_tokens == tokens
    usage = result["done"].usage.dflash
    assert usage["path"] == "dflash" and usage["lookup_hits"] >= 0


def test_a_server_without_a_drafter_needs_lookup(chat_pair):
    model, _, tokenizer = chat_pair
    with pytest.raises(ValueError, match=r"no drafter was given; .*--lookup on"):
        Service(model, None, tokenizer, ServerConfig())


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--batching", "sometimes"], "--batching must be auto, off or always, got 'sometimes'."),
        (["--max-batch", "0"], "--max-batch must be 1 or more, got 0."),
        (["--lookup", "maybe"], "--lookup must be on, off or auto, got 'maybe'."),
    ],
)
def test_serve_refuses_bad_batching_and_lookup_flags(flags, words):
    run = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli.app", "serve", *flags],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=60,
    )
    assert run.returncode == 1 and words in " ".join(run.stderr.split()), run.stderr


def test_an_openai_stream_that_fails_ends_with_its_error_and_no_done():
    import asyncio

    from dflash_mlx.server.errors import APIError
    from dflash_mlx.server.job import Failed, Progress
    from dflash_mlx.server.openai_api import completion_stream

    async def events():
        yield Progress(0, 4096)
        yield Failed(APIError(500, "the decode failed."))

    async def collect():
        return [chunk async for chunk in completion_stream(None, events(), include_usage=False)]

    chunks = asyncio.run(collect())
    assert chunks[0] == ": prefill 0/4096\n\n"
    assert len(chunks) == 2 and "the decode failed." in chunks[1] and "[DONE]" not in "".join(chunks)
