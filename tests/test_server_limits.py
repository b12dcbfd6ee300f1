"""`dflash-mlx serve` against an attacker (issue 35): request-supplied chat
templates, slow rendering, unbounded queues and bodies, input that used to
crash a handler, parameters that used to be dropped, and requests a web page
could make (a text/plain POST, a foreign Host). Each gets a 4xx with one
sentence naming the fix, and the server keeps serving."""

from __future__ import annotations

import json
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from test_server import anthropic_client, openai_client, prompt_ids
from test_server_fixtures import SCRIPTED_TEMPLATE, WORDS, chat_pair, scripted_pair, serving, word_tokenizer  # noqa: F401

from dflash_mlx import generate
from dflash_mlx.generation import GenerationResponse
from dflash_mlx.server.decoder import dflash_figures
from dflash_mlx.server.hosts import AllowedHosts

JSON = {"Content-Type": "application/json"}
USER = [{"role": "user", "content": "w7 w8"}]
LONG = 3000  # tokens: far more than a test waits for


@pytest.fixture(scope="module")
def server(chat_pair):
    with serving(*chat_pair) as url:
        yield url


def post(url: str, path: str, body=None, raw: bytes | None = None, headers=JSON, timeout: float = 60) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


def refused(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert all(w in error["message"] for w in words), error
    assert "Traceback" not in response.text and error["message"].endswith(".")
    return error


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


# -- 1: templates ------------------------------------------------------------------------
def test_a_request_template_is_refused_and_memory_stays_flat(server):
    before = peak_rss_mb()
    for template in (
        "{% set s='a'*200000000 %}{{ s|length }}",
        "{% for i in range(2000) %}{% for j in range(2000) %}{{ i * j }}{% endfor %}{% endfor %}",
    ):
        start = time.monotonic()
        response = post(
            server, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"chat_template": template}}
        )
        error = refused(response, 400, "chat_template", "enable_thinking")
        assert error["param"] == "chat_template_kwargs.chat_template" and time.monotonic() - start < 1
    assert peak_rss_mb() - before < 50
    refused(
        post(
            server, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}
        ),
        400,
        "add_generation_prompt",
    )
    allowed = {"enable_thinking": False, "reasoning_effort": "low", "thinking": False}
    ok = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "chat_template_kwargs": allowed})
    assert ok.status_code == 200, ok.text


SLOW_TEMPLATE = (  # the server's own template, slow to render: about 4 s of pure Python on a CPU
    "{% set ns = namespace(x=0) %}{% for m in messages %}{% for i in range(400) %}{% for j in range(1000) %}"
    "{% set ns.x = ns.x + (m['content'] | length) %}{% endfor %}{% endfor %}{% endfor %}" + SCRIPTED_TEMPLATE
)


def test_health_answers_within_a_second_while_a_slow_template_renders(scripted_pair):
    model, draft, _ = scripted_pair
    slow = word_tokenizer(WORDS, "<eos>", SLOW_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "w30"}], "max_tokens": 3}
    with serving(model, draft, slow) as url, ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        reply = pool.submit(post, url, "/v1/chat/completions", body)
        waits = []
        while not reply.done():
            t = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            waits.append(time.monotonic() - t)
            time.sleep(0.05)
        took = time.monotonic() - start
        assert reply.result().status_code == 200, reply.result().text
    # Rendering on the event loop would hold every /health behind it: none could
    # be answered while it runs. Here they keep coming, each within a second
    # (the median: a loaded CI machine can stall any one request).
    assert took > 1 and len(waits) >= 5, (took, waits)
    assert sorted(waits)[len(waits) // 2] < 1, waits


def test_preparing_a_prompt_is_bounded_in_time(scripted_pair):
    model, draft, _ = scripted_pair
    slow = word_tokenizer(WORDS, "<eos>", SLOW_TEMPLATE)
    with serving(model, draft, slow, prepare_timeout_s=0.3) as url:
        start = time.monotonic()
        refused(
            post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 3}), 400, "longer than 0.3 s", "shorter"
        )
        assert time.monotonic() - start < 1
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


# -- 2: limits ---------------------------------------------------------------------------
def test_a_full_queue_is_a_503_with_retry_after(chat_pair):
    with serving(*chat_pair, max_queue=1) as url, ThreadPoolExecutor(1) as pool:
        long = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": LONG, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            assert any(line.startswith("data:") for line, _ in zip(lines, range(3)))  # decoding: the worker is busy
            waiting = pool.submit(post, url, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
            deadline = time.monotonic() + 10
            while httpx.get(f"{url}/health").json()["queued"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            full = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
            refused(full, 503, "--max-queue", "retry")
            assert int(full.headers["retry-after"]) > 0
        assert waiting.result().status_code == 200  # the queued request is served once the stream is gone


def test_bodies_past_the_limit_get_a_413(server, chat_pair):
    big = b"x" * (20 * 2**20)
    refused(post(server, "/v1/completions", raw=big), 413, "--max-body-bytes")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b"x" * 2**20

    response = httpx.post(f"{server}/v1/completions", content=chunks(), headers=JSON, timeout=60)
    refused(response, 413, "16777216 bytes")
    with serving(*chat_pair, max_body_bytes=4096) as url:
        refused(
            post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w7 " * 2000}]}), 413, "4096"
        )
        assert post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2}).status_code == 200


# -- 3 and 4: bad input, strict types, refused and unknown fields ----------------------------
def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


BAD = [
    # (what, path, body or raw bytes, status, words the message holds)
    ("a token id of 2**70", "/v1/completions", {"prompt": [2**70]}, 400, "outside the vocabulary"),
    ("a negative token id", "/v1/completions", {"prompt": [-1]}, 400, "outside the vocabulary"),
    (
        "a tool_result whose content is 5",
        "/v1/messages",
        {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": 5}]}],
        },
        400,
        "tool_result",
    ),
    (
        "a text block whose text is 5",
        "/v1/messages",
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "'text'",
    ),
    (
        "a tool call that is not an object",
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "w1", "tool_calls": [5]}, *USER]},
        400,
        "tool_calls",
    ),
    ("a lone surrogate", "/v1/completions", b'{"prompt": "w1 \\ud800", "max_tokens": 2}', 400, "surrogate"),
    ("a body nested 50,000 deep", "/v1/completions", nested(50_000), 400, "nested too deeply"),
    ('"max_tokens": "7"', "/v1/completions", {"prompt": "w1", "max_tokens": "7"}, 400, "max_tokens"),
    ('"stream": "yes"', "/v1/chat/completions", {"messages": USER, "stream": "yes"}, 400, "stream"),
    ('"prompt": [true, false]', "/v1/completions", {"prompt": [True, False]}, 400, "list of integer token ids"),
    ('"temperature": "0.5"', "/v1/chat/completions", {"messages": USER, "temperature": "0.5"}, 400, "temperature"),
    (
        "repetition_penalty",
        "/v1/chat/completions",
        {"messages": USER, "repetition_penalty": 1.1},
        400,
        "repetition_penalty",
    ),
    (
        "frequency_penalty",
        "/v1/chat/completions",
        {"messages": USER, "frequency_penalty": 0.5},
        400,
        "frequency_penalty",
    ),
    (
        "top_logprobs 21",
        "/v1/chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        400,
        "0 to 20",
    ),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "logprobs"),
    ("completion logprobs -1", "/v1/completions", {"prompt": "w1", "logprobs": -1}, 400, "0 to 20"),
    ("logit_bias", "/v1/chat/completions", {"messages": USER, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (
        "response_format json",
        "/v1/chat/completions",
        {"messages": USER, "response_format": {"type": "json_object"}},
        400,
        "structured output",
    ),
    ("an unknown field", "/v1/chat/completions", {"messages": USER, "max_token": 5}, 400, "max_token"),
    (
        "an unknown Anthropic field",
        "/v1/messages",
        {"model": "tiny", "max_tokens": 4, "messages": USER, "top_n": 2},
        400,
        "top_n",
    ),
    (
        "an unknown stream option",
        "/v1/chat/completions",
        {"messages": USER, "stream_options": {"usage": True}},
        400,
        "stream_options.usage",
    ),
    (
        "prompt + max_tokens past the context",
        "/v1/messages",
        {"model": "tiny", "max_tokens": 5000, "messages": USER},
        400,
        "exceed context limit",
    ),
    (
        "max_tokens in count_tokens",
        "/v1/messages/count_tokens",
        {"model": "tiny", "max_tokens": 5, "messages": USER},
        400,
        "max_tokens",
    ),
]


@pytest.mark.parametrize("what,path,body,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_naming_it(server, what, path, body, status, words):
    response = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    error = refused(response, status, words)
    assert error["type"] == "invalid_request_error"
    assert post(server, "/v1/completions", {"prompt": "w1", "max_tokens": 2}).status_code == 200


def test_the_clients_common_fields_are_accepted(chat_pair, server):
    client = openai_client(server)
    reply = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=4,
        n=1,
        user="u1",
        metadata={"app": "test"},
        store=False,
        seed=3,
        stop=["w99"],
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        reasoning_effort="low",
        stream=True,
        stream_options={"include_usage": True},
        parallel_tool_calls=True,
        response_format={"type": "text"},
    )
    assert list(reply)[-1].usage.completion_tokens == 4
    completion = client.completions.create(model="tiny", prompt="w1", max_tokens=3, user="u1", echo=False, best_of=1)
    assert completion.usage.completion_tokens == 3
    message = anthropic_client(server).messages.create(
        model="tiny", max_tokens=3, messages=USER, metadata={"user_id": "u1"}, stop_sequences=["w99"]
    )
    assert message.usage.output_tokens == 3


def test_min_p_reaches_sampling(chat_pair, server):
    model, draft, tokenizer = chat_pair
    ids = prompt_ids(tokenizer, USER)

    def library(seed, min_p):
        return generate(model, draft, tokenizer, ids, max_tokens=12, temperature=1.0, seed=seed, min_p=min_p)

    seeds = range(4)
    assert any(library(s, 0.5) != library(s, 0.0) for s in seeds)  # min_p matters for this pair
    client = openai_client(server)
    for s in seeds:
        reply = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=12, temperature=1.0, seed=s, extra_body={"min_p": 0.5}
        )
        assert reply.choices[0].message.content == library(s, 0.5)


def test_count_tokens_counts_the_messages_prompt(chat_pair, server):
    tokenizer = chat_pair[2]
    client = anthropic_client(server)
    counted = client.messages.count_tokens(model="tiny", system="w9", messages=USER)
    assert counted.input_tokens == len(prompt_ids(tokenizer, [{"role": "system", "content": "w9"}, *USER]))
    reply = client.messages.create(model="tiny", max_tokens=2, system="w9", messages=USER)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="tool_result"):
        client.messages.count_tokens(
            model="tiny",
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}],
        )


# -- 5: what a web page could send ------------------------------------------------------------
def test_a_text_plain_post_and_a_foreign_host_are_refused(chat_pair, server):
    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    refused(
        post(server, "/v1/chat/completions", raw=body, headers={"Content-Type": "text/plain"}), 415, "application/json"
    )
    refused(post(server, "/v1/chat/completions", raw=body, headers={}), 415, "Content-Type")
    port = server.rsplit(":", 1)[1]
    refused(
        post(server, "/v1/chat/completions", raw=body, headers={**JSON, "Host": f"rebound.example:{port}"}),
        400,
        "--allowed-host rebound.example",
    )
    refused(httpx.get(f"{server}/health", headers={"Host": "rebound.example"}), 400, "Host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LOCALHOST:{port}"):
        assert post(server, "/v1/chat/completions", raw=body, headers={**JSON, "Host": host}).status_code == 200
    assert (
        post(
            server, "/v1/chat/completions", raw=body, headers={"Content-Type": "application/json; charset=utf-8"}
        ).status_code
        == 200
    )
    with serving(*chat_pair, allowed_hosts=("box.lan",)) as url:
        assert httpx.get(f"{url}/health", headers={"Host": "box.lan:80"}).status_code == 200
        assert httpx.get(f"{url}/health", headers={"Host": "other.lan"}).status_code == 400
        assert (
            openai_client(url)
            .chat.completions.create(model="tiny", messages=USER, max_tokens=2)
            .usage.completion_tokens
            == 2
        )


def test_which_hosts_a_binding_answers_to():
    loopback = AllowedHosts("127.0.0.1")
    assert all(loopback.allows(h) for h in ("127.0.0.1:8080", "localhost", "[::1]:8080", "localhost.:80"))
    assert not any(loopback.allows(h) for h in ("evil.example", "10.0.0.5:8080", "", None, "127.0.0.1.evil.example"))
    everywhere = AllowedHosts("0.0.0.0", ("box.lan",))
    assert all(everywhere.allows(h) for h in ("192.168.1.5:8080", "[fe80::1]:80", "box.lan", "localhost"))
    assert not everywhere.allows("evil.example:8080")  # a rebinding page sends a name, never an address
    assert AllowedHosts("127.0.0.1", ("*",)).allows("anything.example")


def test_the_official_clients_still_work_through_the_checks(server):
    assert (
        openai_client(server)
        .chat.completions.create(model="tiny", messages=USER, max_tokens=2)
        .choices[0]
        .finish_reason
        == "length"
    )
    assert (
        anthropic_client(server).messages.create(model="tiny", max_tokens=2, messages=USER).stop_reason == "max_tokens"
    )
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        openai_client(server).chat.completions.create(
            model="tiny", messages=USER, extra_body={"repetition_penalty": 1.2}
        )


# -- 12: the acceptance figures count drafting cycles only ---------------------------------------
def response(block_sizes: dict[int, int], length: float, rate: float) -> GenerationResponse:
    return GenerationResponse(
        text="",
        tokens=[1],
        accepted=0,
        block_size=max(block_sizes),
        prompt_tokens=3,
        prompt_tps=1.0,
        generation_tokens=5,
        generation_tps=1.0,
        acceptance_length=length,
        acceptance_rate=rate,
        peak_memory=0.0,
        cycles=sum(block_sizes.values()),
        block_sizes=block_sizes,
    )


def test_acceptance_is_null_when_every_cycle_was_plain():
    plain = dflash_figures(response({1: 4}, 0.0, 0.0), {1})
    assert plain["acceptance_length"] is None and plain["acceptance_rate"] is None
    assert plain["plain_decoding"] and plain["plain_cycles"] == 4 and plain["cycles"] == 4
    mixed = dflash_figures(response({4: 2, 1: 1}, 2.5, 0.5), {1, 4})
    assert (mixed["acceptance_length"], mixed["acceptance_rate"], mixed["plain_cycles"]) == (2.5, 0.5, 1)
