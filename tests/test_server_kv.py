"""`dflash-mlx serve` with the KV cache settings (--kv-bits, --kv-group-size,
--quantized-kv-start, --max-kv-size): every prompt cache of the pool is made
with them, so greedy replies equal `generate` with the same settings, turn
after turn; a bounded cache lets a conversation run past the context (not one
request's new prompt tokens); the pool's
byte bound counts what the caches really hold; bad settings are refused."""

from __future__ import annotations

import httpx
import pytest
from test_server import openai_client, prompt_ids
from test_server_fixtures import KV_PAIR_CONTEXT, kv_pair, serving  # noqa: F401
from typer.testing import CliRunner

from dflash_mlx import generate, make_prompt_cache
from dflash_mlx.server.cache_pool import cache_bytes

FIRST = [{"role": "user", "content": "w7 w8 w9 w10 w11 w12"}]


def cli(*args: str):
    from dflash_mlx.cli.app import app

    return CliRunner().invoke(app, list(args), prog_name="dflash-mlx", env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1"})


def cli_generate(kv_pair, text: str, max_tokens: int, *kv: str) -> str:
    """What `dflash-mlx generate` writes for one user message, with these KV flags."""
    target, draft, _ = kv_pair
    result = cli(
        "generate", "--model", str(target), "--draft-model", str(draft), "-p", text, "-m", str(max_tokens), *kv
    )
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def api_turns(pair, *turns: tuple[list[dict], int], **kv) -> list[str]:
    """The API's replies to each (messages, max_tokens) in turn, all with one
    cache made by make_prompt_cache with ``kv`` (what a chat keeps across turns)."""
    model, draft, tokenizer = pair
    cache = make_prompt_cache(model, draft, **kv)
    return [
        generate(model, draft, tokenizer, prompt_ids(tokenizer, m), max_tokens=n, prompt_cache=cache) for m, n in turns
    ]


def ask(client, messages, max_tokens):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)


def next_turn(messages: list[dict], reply: str, text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": text}]


@pytest.mark.parametrize("bits,start", [(8, 0), (4, 0), (4, 12)])
def test_a_quantized_server_answers_what_generate_does_turn_after_turn(kv_pair, bits, start):
    pair = kv_pair[2]
    kv = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
    first_want = api_turns(pair, (FIRST, 30), **kv)[0]
    if bits == 4:  # the setting matters here: proof that it reached the pool's caches
        assert first_want != api_turns(pair, (FIRST, 30))[0]
    if start == 0:
        flags = ["--kv-bits", str(bits), "--kv-group-size", "32", "--quantized-kv-start", str(start)]
        assert cli_generate(kv_pair, FIRST[0]["content"], 30, *flags) == first_want.strip()

    with serving(*pair, **kv) as url:
        client = openai_client(url)
        first = ask(client, FIRST, 30)
        assert first.choices[0].message.content == first_want
        streamed = client.chat.completions.create(model="tiny", messages=FIRST, max_tokens=30, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == first_want
        second_turn = next_turn(FIRST, first_want, "w20 w21")
        second = ask(client, second_turn, 12)
    # the follow-up continued the first turn's cache, and equals the API keeping its cache across the turns
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].message.content == api_turns(pair, (FIRST, 30), (second_turn, 12), **kv)[1]


def test_a_bounded_server_runs_past_the_context_as_generate_does(kv_pair):
    pair = kv_pair[2]
    M, n = 12, 60  # FIRST's prompt (9 tokens) + 60 > the context of 64
    want = api_turns(pair, (FIRST, n), max_kv_size=M)[0]
    assert cli_generate(kv_pair, FIRST[0]["content"], n, "--max-kv-size", str(M)) == want.strip()
    long_prompt = [{"role": "user", "content": " ".join(f"w{10 + i % 50}" for i in range(KV_PAIR_CONTEXT + 10))}]

    with serving(*pair) as url:  # unbounded: the context limits the reply, and a prompt that fills it is refused
        client = openai_client(url)
        cut = client.chat.completions.create(
            model="tiny", messages=FIRST, temperature=0
        )  # the server's default, shortened
        assert cut.usage.completion_tokens == KV_PAIR_CONTEXT - cut.usage.prompt_tokens
        asked = httpx.post(f"{url}/v1/chat/completions", json={"messages": FIRST, "max_tokens": n}, timeout=60)
        assert asked.status_code == 400 and asked.json()["error"]["param"] == "max_tokens"
        assert f"9 + {n} > {KV_PAIR_CONTEXT}" in asked.json()["error"]["message"]
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": long_prompt, "max_tokens": 4}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"

    with serving(*pair, max_kv_size=M) as url:
        client = openai_client(url)
        first = ask(client, FIRST, n)
        assert first.choices[0].message.content == want
        assert first.usage.completion_tokens == n and first.choices[0].finish_reason == "length"
        # the same prompt again (a regenerated reply) cannot cut back the wrapped cache: it gets a fresh one
        again = ask(client, FIRST, n)
        assert again.choices[0].message.content == want and again.usage.prompt_tokens_details.cached_tokens == 0
        second_turn = next_turn(FIRST, want, "w20 w21")
        second = ask(client, second_turn, 8)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert second.choices[0].message.content == api_turns(pair, (FIRST, n), (second_turn, 8), max_kv_size=M)[1]
        # the conversation runs past the context, but one request may not read a context's worth of new
        # tokens: that would hold the worker for as long as the body is large
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": long_prompt, "max_tokens": 6}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        assert "no kept cache holds" in refused.json()["error"]["message"]


def test_the_pool_counts_the_bytes_quantized_and_bounded_caches_hold(kv_pair):
    model, draft, tokenizer = pair = kv_pair[2]
    ids = prompt_ids(tokenizer, FIRST)

    def held(n, **kv):
        cache = make_prompt_cache(model, draft, **kv)
        generate(model, draft, tokenizer, ids, max_tokens=n, prompt_cache=cache)
        assert cache_bytes(cache) == sum(a.nbytes for a in cache.arrays())  # every buffer, scales and biases included
        return cache_bytes(cache)

    quantized, plain = held(30, kv_bits=8, kv_group_size=32, quantized_kv_start=0), held(30)
    assert quantized < plain
    assert held(300, max_kv_size=12) == held(600, max_kv_size=12)  # a bounded cache stops growing

    # a byte bound between the two: the quantized server keeps its cache, the plain one cannot
    bound = (quantized + plain) // 2
    for kv, kept in (({"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}, 1), ({}, 0)):
        with serving(*pair, prompt_cache_bytes=bound, **kv) as url:
            ask(openai_client(url), FIRST, 30)
            assert httpx.get(f"{url}/health").json()["prompt_caches"] == kept, kv


def test_serve_refuses_bad_kv_settings_in_one_sentence(kv_pair):
    target, draft, _ = kv_pair
    for flags, words in [
        (["--kv-bits", "4", "--max-kv-size", "64"], "--max-kv-size and --kv-bits cannot be combined"),
        (["--kv-bits", "7"], "--kv-bits must be one of 2, 3, 4, 5, 6, 8, got 7."),
        (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be one of 32, 64, 128"),
        (["--kv-bits", "4", "--quantized-kv-start", "-1"], "--quantized-kv-start must be 0 or more"),
        (["--max-kv-size", "4"], "--max-kv-size must be more than 4"),
        # known only once the pair is loaded: the library's sentence in the flags' words
        (["--kv-bits", "4"], "--kv-group-size 64 does not divide the target's head dimension 32."),
    ]:
        # (port 1: a refusal that failed would not start a server that waits)
        result = cli("serve", "--model", str(target), "--draft-model", str(draft), "--port", "1", *flags)
        said = " ".join(result.stderr.split())
        assert result.exit_code == 1 and words in said, (flags, result.output)
        assert "Traceback" not in result.output and "serving" not in said


def test_serve_refuses_a_block_past_the_trained_one_in_one_sentence(kv_pair, monkeypatch):
    """As generate and chat do once the pair is loaded (the drafter was trained with blocks of 4)."""
    import dflash_mlx.server

    def run(*args, **kwargs):  # a refusal that failed ends here, not in a server that waits
        raise RuntimeError("the server was started")

    monkeypatch.setattr(dflash_mlx.server, "run", run)
    target, draft, _ = kv_pair
    result = cli("serve", "--model", str(target), "--draft-model", str(draft), "--port", "1", "--block-size", "9")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1 and said == (
        "error: --block-size 9 is larger than the block the drafter was trained "
        "for (4), whose drafts past it are noise; use at most 4, or 'auto'."
    ), result.output
    assert "Traceback" not in result.output and "serving" not in said
    generated = cli("generate", "--model", str(target), "--draft-model", str(draft), "-p", "w1", "--block-size", "9")
    assert generated.exit_code == 1 and " ".join(generated.stderr.split()) == said  # the same sentence
