"""`dflash-mlx serve` under load and abuse: concurrent clients, clients that
leave, bad requests, and the command itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server_fixtures import chat_pair, free_port, serving  # noqa: F401

from dflash_mlx import generate

LONG = 3000  # tokens: about a minute of decoding for the tiny pair on a CPU


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    )


@pytest.fixture(scope="module")
def keyed_server(chat_pair):
    with serving(*chat_pair, api_key="sekret") as url:
        yield url


def post(url: str, path: str, body=None, key: str | None = "sekret", timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=timeout)


def wait_idle(url: str, within_s: float) -> float:
    """Seconds until the worker is idle with nothing queued; fails after ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        health = httpx.get(f"{url}/health").json()
        if not health["busy"] and health["queued"] == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    pytest.fail(f"the worker was still busy {within_s} s after its client left")


def test_eight_concurrent_clients_all_answered_correctly(chat_pair, keyed_server):
    model, draft, tokenizer = chat_pair
    prompts = [f"w{10 + i} w{20 + i}" for i in range(8)]
    expected = [generate(model, draft, tokenizer, chat_ids(tokenizer, p), max_tokens=8) for p in prompts]
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="sekret", max_retries=0, timeout=120)

    def ask(prompt):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == expected


def test_a_client_cut_off_mid_stream_frees_the_worker(keyed_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": LONG, "stream": True}
    with httpx.stream(
        "POST", f"{keyed_server}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekret"}, timeout=60
    ) as response:
        data = 0
        for line, _ in zip(response.iter_lines(), range(40)):  # (prefill progress may come first, as comments)
            data += line.startswith("data:")
            if data == 3:
                break
        assert data == 3
    assert wait_idle(keyed_server, within_s=5) < 5
    start = time.monotonic()
    short = post(
        keyed_server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4},
    )
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - start < 10


def test_a_client_that_gives_up_waiting_frees_the_worker(keyed_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w7 w6"}], "max_tokens": LONG}
    with pytest.raises(httpx.ReadTimeout):
        post(keyed_server, "/v1/chat/completions", body, timeout=1.5)
    assert wait_idle(keyed_server, within_s=5) < 5


BAD_REQUESTS = [
    # (what, path, body or raw bytes, key, status, words the message names)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', "sekret", 400, "not valid JSON"),
    ("a JSON list", "/v1/chat/completions", b"[1, 2]", "sekret", 400, "JSON object"),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "w1"}]},
        "sekret",
        404,
        "gpt-9",
    ),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, "sekret", 400, "messages"),
    ("no messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, "sekret", 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "w1"}]}, "sekret", 400, "role"),
    (
        "negative temperature",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w1"}], "temperature": -1},
        "sekret",
        400,
        "temperature",
    ),
    (
        "top_p of 0",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w1"}], "top_p": 0},
        "sekret",
        400,
        "top_p",
    ),
    (
        "negative top_k",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w1"}], "top_k": -2},
        "sekret",
        400,
        "top_k",
    ),
    (
        "max_tokens of 0",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 0},
        "sekret",
        400,
        "max_tokens",
    ),
    (
        "a string seed",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w1"}], "seed": "x"},
        "sekret",
        400,
        "seed",
    ),
    ("n of 2", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "n": 2}, "sekret", 400, "n=1"),
    (
        "an image",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "sekret",
        400,
        "text",
    ),
    (
        "prompt past the context",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w7 " * 4200}]},
        "sekret",
        400,
        "context",
    ),
    ("ids outside the vocabulary", "/v1/completions", {"prompt": [5, 99999]}, "sekret", 400, "vocabulary"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, "sekret", 400, "prompt"),
    (
        "anthropic without max_tokens",
        "/v1/messages",
        {"model": "tiny", "messages": [{"role": "user", "content": "w1"}]},
        "sekret",
        400,
        "max_tokens",
    ),
    (
        "anthropic unknown model",
        "/v1/messages",
        {"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "w1"}]},
        "sekret",
        404,
        "claude-x",
    ),
    (
        "missing API key",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w1"}]},
        None,
        401,
        "API key",
    ),
    (
        "wrong API key",
        "/v1/messages",
        {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "w1"}]},
        "nope",
        401,
        "wrong",
    ),
    ("unknown endpoint", "/v1/embeddings", {"input": "w1"}, "sekret", 404, "/v1/embeddings"),
]


def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_stays_up(keyed_server):
    for what, path, body, key, status, words in BAD_REQUESTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        headers["Content-Type"] = "application/json"
        response = httpx.post(f"{keyed_server}{path}", headers=headers, timeout=60, **kwargs)
        assert response.status_code == status, (what, response.text)
        error = response.json()["error"]
        assert words in error["message"] and error["type"], (what, error)
    assert httpx.get(f"{keyed_server}/v1/chat/completions").status_code == 405
    assert httpx.get(f"{keyed_server}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
    good = post(
        keyed_server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 3},
    )
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"


def test_the_openai_client_sees_the_errors(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="sekret", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], temperature=-0.5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "w1"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="wrong", max_retries=0).models.list()


def test_serve_command_runs_the_builtin_pair_on_loopback():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_mlx.cli.app", "serve", "--port", str(port), "--max-tokens", "6"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "dflash-mlx serve did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["builtin"]
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "builtin", "messages": [{"role": "user", "content": "def add(a, b):"}]},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 6
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read()


def test_serve_command_refuses_bad_flags():
    env = {**os.environ, "COLUMNS": "200"}
    for flags, words in (
        (["--port", "0"], "--port"),
        (["--prompt-cache-bytes", "lots"], "--prompt-cache-bytes"),
        (["--chat-template-args", "{bad"], "--chat-template-args"),
        (["--temp", "-1"], "temp"),
        (["--kv-bits", "4", "--max-kv-size", "64"], "--max-kv-size and --kv-bits cannot be combined"),
        (["--max-queue", "0"], "--max-queue must be 1 or more"),
        (["--max-body-bytes", "lots"], "--max-body-bytes must be a size"),
        (["--min-p", "2"], "min-p"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "dflash_mlx.cli.app", "serve", *flags],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert run.returncode == 1 and words in run.stderr, (flags, run.stderr)
