"""Several clients at once: requests waiting together served batched through
mlx-lm's BatchGenerator (each reply still the target's own greedy text), a
lone one through DFlash, the choice following the measurements, the paths
in /metrics; and keep-alives with the prefill's progress before the first
token of a streamed long prompt, on every API."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from test_server import WEATHER_TOOL
from test_server_fixtures import ID, chat_pair, kv_pair, scripted_pair, serving  # noqa: F401
from test_server_metrics import scrape

from dflash_mlx.server.config import ServerConfig
from dflash_mlx.server.job import Done, GenerationParams, Job, Progress
from dflash_mlx.server.path_choice import PathChoice
from dflash_mlx.server.reply import Delta
from dflash_mlx.server.service import Service
from dflash_mlx.server.templates import rendered_chat


def mlx_lm_greedy(model, tokenizer, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, tokens, finish reason) of mlx-lm's own greedy decoding."""
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        out.append(token)
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(out[:-1]), len(out), "stop"
    return tokenizer.decode(out), len(out), "length"


def chat_ids(tokenizer, text: str) -> list[int]:
    return rendered_chat(tokenizer, [{"role": "user", "content": text}], None, {})[0]


def params(max_tokens: int, temperature: float = 0.0, seed=None, logprobs=None) -> GenerationParams:
    return GenerationParams(max_tokens, temperature, 1.0, 0, 0.0, seed, logprobs)


def serve_waiting(pair, requests: list[dict], choice: PathChoice | None = None, **config) -> list[dict]:
    """Every request queued before the worker starts (so all of them wait
    together), then served; each one's events, merged reply and Done."""
    model, draft, tokenizer = pair

    async def main():
        service = Service(model, draft, tokenizer, ServerConfig(**config))
        if choice is not None:
            service.choice.dflash_tps, service.choice.batched_tps = choice.dflash_tps, dict(choice.batched_tps)
        jobs = [Job(**r) for r in requests]
        for job in jobs:
            service.worker.submit(job)
        service.worker.start()
        try:
            results = []
            for job in jobs:
                events = [e async for e in job.events()]
                whole = Delta()
                for e in events:
                    if isinstance(e, Delta):
                        whole = whole.merge(e)
                done = events[-1]
                assert isinstance(done, Done), done
                results.append({"events": events, "reply": whole.merge(done.delta), "done": done})
            return results
        finally:
            await asyncio.to_thread(service.worker.stop)

    return asyncio.run(main())


def path(result: dict) -> str:
    return result["done"].usage.dflash.get("path", "dflash")


# -- batched output ---------------------------------------------------------------------
def test_requests_waiting_together_are_batched_and_each_is_mlx_lm_greedy(chat_pair):
    model, _, tokenizer = chat_pair
    prompts = [" ".join(f"w{4 + (i * 7 + j) % 40}" for j in range(3 + 5 * i)) for i in range(5)]
    lengths = [24, 9, 17, 24, 5]
    ids = [chat_ids(tokenizer, p) for p in prompts]
    results = serve_waiting(
        chat_pair, [{"prompt": i, "params": params(n)} for i, n in zip(ids, lengths)], batching="always"
    )
    assert [path(r) for r in results] == ["batched"] * 5
    assert max(r["done"].usage.dflash["batch_size"] for r in results) == 5
    for i, n, r in zip(ids, lengths, results):
        text, tokens, finish = mlx_lm_greedy(model, tokenizer, i, n)
        assert r["reply"].content == text
        assert r["done"].usage.completion_tokens == tokens and r["done"].finish_reason == finish
        assert r["done"].usage.prompt_tokens == len(i)


def test_batched_replies_match_the_dflash_path_field_for_field(scripted_pair):
    """Thinking, tool calls, stop strings, max_tokens and log-probs: served
    batched, a reply is what DFlash serving it alone sends."""
    _, _, tokenizer = scripted_pair
    think, _ = rendered_chat(tokenizer, [{"role": "user", "content": "w30"}], None, {"enable_thinking": True})
    tools, _ = rendered_chat(tokenizer, [{"role": "user", "content": "weather?"}], [WEATHER_TOOL], {})
    requests = [
        {"prompt": think, "params": params(50, logprobs=2), "structured": True},
        {"prompt": think, "params": params(50), "structured": True, "stops": ["w16"]},
        {"prompt": think, "params": params(4), "structured": True},
        {"prompt": tools, "params": params(50), "structured": True, "tools": [WEATHER_TOOL]},
        {"prompt": [ID["w13"]], "params": params(50, logprobs=0)},
    ]
    batched = serve_waiting(scripted_pair, requests, batching="always")
    alone = serve_waiting(scripted_pair, requests, batching="off")
    assert [path(r) for r in batched] == ["batched"] * 5 and [path(r) for r in alone] == ["dflash"] * 5
    for b, a in zip(batched, alone):
        assert b["reply"].content == a["reply"].content and b["reply"].reasoning == a["reply"].reasoning
        assert [(c["name"], c["arguments"]) for c in b["reply"].tool_calls] == [
            (c["name"], c["arguments"]) for c in a["reply"].tool_calls
        ]
        assert b["done"].finish_reason == a["done"].finish_reason
        assert b["done"].stop_sequence == a["done"].stop_sequence
        assert b["done"].usage.completion_tokens == a["done"].usage.completion_tokens
        assert [e.token for e in b["reply"].logprobs] == [e.token for e in a["reply"].logprobs]
        for x, y in zip(b["reply"].logprobs, a["reply"].logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-3)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert batched[1]["done"].stop_sequence == "w16" and "w16" not in batched[1]["reply"].content
    assert batched[2]["done"].finish_reason == "length"
    assert batched[3]["done"].finish_reason == "tool_calls"


def test_seeded_sampling_stays_on_dflash_and_unseeded_sampling_batches(chat_pair):
    _, _, tokenizer = chat_pair
    ids = chat_ids(tokenizer, "w5 w6 w7")
    requests = [
        {"prompt": ids, "params": params(12, temperature=0.8, seed=3)},
        {"prompt": ids, "params": params(12, temperature=0.8)},
        {"prompt": ids, "params": params(12, temperature=0.8)},
    ]
    results = serve_waiting(chat_pair, requests, batching="always")
    assert [path(r) for r in results] == ["dflash", "batched", "batched"]
    seeded = serve_waiting(chat_pair, requests[:1], batching="off")
    assert results[0]["reply"].content == seeded[0]["reply"].content
    assert all(r["done"].usage.completion_tokens <= 12 for r in results)
    # in arrival order: the batch takes none past a request it cannot serve
    in_order = serve_waiting(chat_pair, [requests[1], requests[0], requests[2]], batching="always")
    assert [path(r) for r in in_order] == ["batched", "dflash", "batched"]
    assert [r["done"].usage.dflash.get("batch_size") for r in in_order] == [1, None, 1]


# -- the choice -----------------------------------------------------------------------
def test_choice_follows_the_measurements():
    choice = PathChoice()
    assert not choice.batch(1) and not choice.batch(0)
    assert choice.batch(2)  # nothing measured yet: try it
    choice.observe_dflash(100.0)
    assert choice.batch(2)  # batching not measured yet
    choice.observe_batched(2, 80.0)
    assert not choice.batch(2)
    assert choice.batch(3) and choice.batch(4)  # at most 80 * 3 / 2, 80 * 4 / 2: could win
    choice.observe_batched(4, 90.0)
    assert not choice.batch(4) and not choice.batch(3)  # bounded by 90 from size 4
    assert choice.batch(8)  # up to 180
    choice.observe_batched(4, 200.0)  # a moving average: 0.7 * 90 + 0.3 * 200
    assert choice.batched_estimate(4) == pytest.approx(123.0) and choice.batch(4)
    assert not choice.batch(1)  # a lone request: DFlash unless plain decoding measured faster
    choice.observe_batched(1, 90.0)
    assert not choice.batch(1)
    choice.observe_batched(1, 300.0)
    assert choice.batched_estimate(1) > 100.0 and choice.batch(1)
    assert not PathChoice(mode="off").batch(8)
    always = PathChoice(mode="always")
    always.observe_dflash(1e9)
    assert always.batch(2) and always.batch(1) and not always.batch(0)
    with pytest.raises(ValueError, match="batching must be one of"):
        PathChoice(mode="sometimes")


def test_the_worker_serves_by_the_measured_choice(chat_pair):
    _, _, tokenizer = chat_pair
    requests = [{"prompt": chat_ids(tokenizer, f"w{9 + i}"), "params": params(6)} for i in range(3)]
    slow_batch = PathChoice(dflash_tps=1000.0, batched_tps={n: 10.0 for n in range(2, 9)})
    assert [path(r) for r in serve_waiting(chat_pair, requests, slow_batch)] == ["dflash"] * 3
    fast_batch = PathChoice(dflash_tps=10.0, batched_tps={2: 1000.0})
    assert [path(r) for r in serve_waiting(chat_pair, requests, fast_batch)] == ["batched"] * 3
    assert [path(r) for r in serve_waiting(chat_pair, requests[:1])] == ["dflash"]  # a lone request
    assert [path(r) for r in serve_waiting(chat_pair, requests[:1], batching="always")] == ["batched"]


def test_the_choice_sizes_a_batch_by_the_clients_lately_together():
    """A lone request of a busy server is one of many: its clients come back
    as their replies end, so the batch is weighed at their number."""
    rates = {1: 50.0, 2: 80.0, 4: 150.0, 8: 250.0}
    choice = PathChoice(dflash_tps=100.0, batched_tps=dict(rates))
    assert choice.clients() == 0 and choice.size(1) == 1
    assert not choice.batch(1)  # a lone request on a quiet server: DFlash
    assert not choice.batch(2)  # two waiting, nobody else: 80 against 100
    choice.observe_clients(4)
    assert choice.clients() == 4 and choice.size(1) == 4 and choice.size(6) == 6
    assert choice.batch(1) and choice.batch(2)  # a batch of four: 150 against 100
    choice.observe_clients(3)
    assert choice.clients() == 4  # the most together within the window
    choice.observe_clients(20)
    assert choice.size(1) == 8  # at most max_batch
    quiet = PathChoice(dflash_tps=100.0, batched_tps=dict(rates))
    quiet.observe_clients(4, at=time.monotonic() - quiet.window_s - 30)
    assert quiet.clients() == 0 and not quiet.batch(1)  # long ago: a lone request is DFlash's
    slow = PathChoice(dflash_tps=100.0, batched_tps={1: 50.0, 2: 60.0, 4: 70.0, 8: 80.0})
    slow.observe_clients(8)
    assert not slow.batch(1) and not slow.batch(8)  # DFlash measured faster at every size


def test_the_batch_wins_within_the_margin_and_is_retried_after_declines():
    choice = PathChoice(dflash_tps=100.0, batched_tps={2: 95.0, 3: 80.0})
    assert choice.batch(2)  # within 10% of DFlash: noise decides, and the batch starts both at once
    assert not choice.batch_wins(3)  # 80: DFlash clearly faster
    n = choice.retry_after
    decisions = [choice.batch(3) for _ in range(2 * n)]
    assert decisions == ([False] * (n - 1) + [True]) * 2  # measured again now and then
    choice.batch(3)
    assert choice.declined == 1 and choice.batch(2) and choice.declined == 0  # a batch resets the count
    assert not any(choice.batch(1) for _ in range(3 * n))  # a lone request on a quiet server is never retried
    assert not any(PathChoice(mode="off").batch(4) for _ in range(3 * n))
    assert PathChoice(mode="always", dflash_tps=1e9).batch_wins(1)


def test_a_running_batch_admits_more_only_while_the_batch_wins(chat_pair):
    """Requests arriving while a batch runs join it while the measurements
    favour the batch at the size it would grow to; else it runs down and
    DFlash serves them."""
    model, draft, tokenizer = chat_pair

    async def admitted(dflash_tps: float, batched_tps: dict) -> tuple[int, int]:
        service = Service(model, draft, tokenizer, ServerConfig(max_batch=4))
        worker, choice = service.worker, service.choice
        choice.dflash_tps, choice.batched_tps = dflash_tps, batched_tps
        worker.submit(Job(chat_ids(tokenizer, "w5"), params(4)))
        first = worker._take_batchable(4)  # a batch's first request: the choice was made
        for i in range(3):
            worker.submit(Job(chat_ids(tokenizer, f"w{6 + i}"), params(4)))
        joined = worker._take_batchable(3)  # one running, room for three
        return len(first), len(joined)

    assert asyncio.run(admitted(100.0, {4: 200.0})) == (1, 3)
    assert asyncio.run(admitted(100.0, {4: 50.0})) == (1, 0)


def test_a_clients_next_request_does_not_count_its_last_as_company(chat_pair):
    """One client, one request after another, each served batched: its
    finished request is not in the server with its next one."""
    model, draft, tokenizer = chat_pair

    async def main():
        service = Service(model, draft, tokenizer, ServerConfig(batching="always"))
        service.choice.window_s = 600.0  # every observation still counts
        service.worker.start()
        try:
            paths = []
            for i in range(3):
                job = Job(chat_ids(tokenizer, f"w{5 + i}"), params(4))
                service.worker.submit(job)
                paths.append([e async for e in job.events()][-1].usage.dflash["path"])
            return paths, service.choice.clients()
        finally:
            await asyncio.to_thread(service.worker.stop)

    assert asyncio.run(main()) == (["batched"] * 3, 1)


def test_a_lone_request_joins_the_batch_only_while_several_clients_were_in_lately(chat_pair):
    model, draft, tokenizer = chat_pair
    ids = chat_ids(tokenizer, "w9 w10")

    def lone(together: int, ago_s: float, batched_alone: float | None = None, preparing: int = 0) -> str:
        async def main():
            service = Service(model, draft, tokenizer, ServerConfig())
            choice = service.choice
            choice.window_s = 600.0  # no test timing: "lately" is what the test says
            choice.dflash_tps, choice.batched_tps = 100.0, {2: 1000.0}
            if batched_alone is not None:
                choice.batched_tps[1] = batched_alone
            choice.observe_clients(together, at=time.monotonic() - ago_s)
            service.preparing = preparing  # requests whose prompts are being rendered
            job = Job(ids, params(6))
            service.worker.submit(job)
            service.worker.start()
            try:
                return [e async for e in job.events()][-1].usage.dflash.get("path", "dflash")
            finally:
                await asyncio.to_thread(service.worker.stop)

        return asyncio.run(main())

    assert lone(together=3, ago_s=1.0) == "batched"  # several clients were in: they come back
    assert lone(together=3, ago_s=3600.0) == "dflash"  # long ago: a lone request is DFlash's
    assert lone(together=1, ago_s=1.0) == "dflash"  # one client at a time
    assert lone(together=1, ago_s=3600.0, preparing=3) == "batched"  # the first of a burst on an idle server
    assert lone(together=1, ago_s=1.0, batched_alone=1000.0) == "batched"  # plain measured faster alone


def test_quantized_or_bounded_caches_turn_batching_off(kv_pair):
    pair = kv_pair[2]
    assert Service(*pair, ServerConfig()).worker.batcher is not None
    for config in (ServerConfig(kv_bits=4, kv_group_size=32), ServerConfig(max_kv_size=32), ServerConfig(max_batch=1)):
        service = Service(*pair, config)
        assert service.worker.batcher is None and not service.choice.batch(4)
    with pytest.raises(ValueError, match="max_batch must be 1 or more"):
        Service(*pair, ServerConfig(max_batch=0))
    with pytest.raises(ValueError, match="batching must be one of"):
        Service(*pair, ServerConfig(batching="yes"))


# -- over HTTP ------------------------------------------------------------------------
def stream_lines(url: str, endpoint: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{endpoint}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        return list(response.iter_lines())


def test_over_http_concurrent_clients_batch_a_lone_one_does_not_and_metrics_show_it(chat_pair):
    model, _, tokenizer = chat_pair
    prompts = [f"w{11 + i} w{30 - i}" for i in range(4)]
    with serving(*chat_pair) as url:
        lone = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "w5"}], "max_tokens": 24},
            timeout=60,
        ).json()
        assert lone["usage"]["dflash"]["path"] == "dflash"  # DFlash's own figures
        assert lone["usage"]["completion_tokens"] >= 8  # enough to measure DFlash's speed
        # a long DFlash reply (greedy, no EOS in sight) keeps the worker busy while the four queue up
        assert mlx_lm_greedy(model, tokenizer, [3, 4, 5], 400)[2] == "length"

        def ask(prompt):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 10}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(4) as pool:
            body = {"prompt": [3, 4, 5], "max_tokens": 3000, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as held:
                lines = held.iter_lines()
                next(lines)
                futures = [pool.submit(ask, p) for p in prompts]
                for i, _ in enumerate(lines):  # read on: the held reply goes on while its client reads
                    if i % 20 == 0 and httpx.get(f"{url}/health").json()["queued"] == 4:
                        break
        replies = [f.result() for f in futures]  # the held stream closed: its job cancelled
        for prompt, reply in zip(prompts, replies):
            assert reply["usage"]["dflash"].get("path") == "batched", [r["usage"] for r in replies]
            text, tokens, _ = mlx_lm_greedy(model, tokenizer, chat_ids(tokenizer, prompt), 10)
            assert reply["choices"][0]["message"]["content"] == text
            assert reply["usage"]["completion_tokens"] == tokens
        metrics = scrape(url)
    assert metrics["dflash_path_requests_total", (("path", "batched"),)] == 4
    assert metrics["dflash_path_requests_total", (("path", "dflash"),)] == 2
    assert metrics["dflash_path_generated_tokens_total", (("path", "batched"),)] == sum(
        r["usage"]["completion_tokens"] for r in replies
    )
    assert metrics["dflash_path_tokens_per_second", (("path", "dflash"), ("batch_size", "1"))] > 0
    assert any(k[0] == "dflash_path_tokens_per_second" and ("path", "batched") in k[1] for k in metrics)


def test_a_client_leaving_a_batch_frees_its_place(chat_pair):
    model, _, tokenizer = chat_pair
    with serving(*chat_pair, batching="always") as url:
        with ThreadPoolExecutor(2) as pool:

            def leave_early():
                body = {"prompt": [3, 4, 5], "max_tokens": 3000, "stream": True}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                    data = (line for line in response.iter_lines() if line.startswith("data:"))
                    return sum(1 for _ in zip(data, range(3)))

            def stay():
                body = {"messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 40}
                return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()

            left, stayed = pool.submit(leave_early), pool.submit(stay)
            assert left.result() >= 3
            reply = stayed.result()
        text, _, _ = mlx_lm_greedy(model, tokenizer, chat_ids(tokenizer, "w7 w8"), 40)
        assert reply["choices"][0]["message"]["content"] == text
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["busy"]:
            assert time.monotonic() < deadline, "the worker kept decoding for a client that left"
            time.sleep(0.02)


# -- prefill progress -----------------------------------------------------------------
LONG_PROMPT = " ".join(f"w{4 + i % 40}" for i in range(120))

STREAMS = [
    # (endpoint, body, a line that carries the reply's first text)
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 4},
        '"content": "w',
    ),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, '"text": "w'),
    (
        "/v1/messages",
        {"model": "tiny", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 4},
        "content_block_delta",
    ),
    ("/v1/responses", {"input": LONG_PROMPT, "max_output_tokens": 4}, "response.output_text.delta"),
]


def keep_alives_before_first_text(lines: list[str], first_text: str) -> list[str]:
    first = next(i for i, line in enumerate(lines) if first_text in line)
    return [line for line in lines[:first] if line.startswith(": prefill ") or line == "event: ping"]


@pytest.mark.parametrize("endpoint,body,first_text", STREAMS, ids=[s[0] for s in STREAMS])
def test_a_long_streamed_prompt_gets_keep_alives_before_its_first_token(chat_pair, endpoint, body, first_text):
    with serving(*chat_pair, prefill_step_size=16) as url:
        lines = stream_lines(url, endpoint, body)
        whole = httpx.post(f"{url}{endpoint}", json=body, timeout=60)
    alive = keep_alives_before_first_text(lines, first_text)
    progress = [line for line in alive if line.startswith(": prefill ")]
    assert progress and progress[0].startswith(": prefill 0/")
    total = int(progress[0].split("/")[1])
    assert total > 100
    if endpoint == "/v1/messages":
        assert "event: ping" in alive
    assert whole.status_code == 200 and ": prefill" not in whole.text  # not streamed: no keep-alives


def test_batched_prefill_reports_its_progress(chat_pair):
    _, _, tokenizer = chat_pair
    ids = chat_ids(tokenizer, LONG_PROMPT)
    requests = [{"prompt": ids, "params": params(3)}, {"prompt": ids[:40], "params": params(3)}]
    results = serve_waiting(chat_pair, requests, batching="always", prefill_step_size=16)
    progress = [(e.done, e.total) for e in results[0]["events"] if isinstance(e, Progress)]
    assert progress[0] == (0, len(ids)) and len(progress) >= len(ids) // 16
    assert all(a[0] < b[0] < len(ids) for a, b in zip(progress, progress[1:]))
    first_text = next(i for i, e in enumerate(results[0]["events"]) if isinstance(e, Delta))
    assert all(isinstance(e, Progress) for e in results[0]["events"][: len(progress)])
    assert first_text >= len(progress)
    assert json.dumps(results[1]["done"].usage.dflash)  # a short prompt's reply, batched beside it


# -- families -------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_5"])
def test_batched_greedy_equals_mlx_lm_across_families(family):
    """Dense, sliding-window and hybrid (delta-net) targets: prompts of
    different lengths batched together, each reply mlx-lm's greedy text."""
    from family_models import family_config, make_family_target

    from dflash_mlx.server.batch import BatchDecoder, can_batch
    from dflash_mlx.tiny import make_target, make_tokenizer, target_config

    vocab = 48
    if family == "qwen3":
        model = make_target(target_config(vocab=vocab), seed=2)
    else:
        model = make_family_target(family_config(family, vocab=vocab), seed=2)
    tokenizer = make_tokenizer(vocab)
    assert can_batch(model)
    prompts = [[(7 * i + 3 * j) % (vocab - 2) + 1 for j in range(n)] for i, n in enumerate((5, 19, 11, 30))]

    async def main():
        jobs = [Job(p, params(14)) for p in prompts]
        batcher = BatchDecoder(model, tokenizer, PathChoice(), max_batch=4, prefill_step_size=8)
        await asyncio.to_thread(batcher.run, jobs, lambda room: [])
        results = []
        for job in jobs:
            results.append([e async for e in job.events()])
        return results

    for prompt, events in zip(prompts, asyncio.run(main())):
        done = events[-1]
        reply = Delta()
        for e in events:
            if isinstance(e, Delta):
                reply = reply.merge(e)
        text, tokens, finish = mlx_lm_greedy(model, tokenizer, prompt, 14)
        assert reply.merge(done.delta).content == text
        assert (done.usage.completion_tokens, done.finish_reason) == (tokens, finish)


def test_metrics_show_the_batch_size_the_choice_weighs():
    from dflash_mlx.server.cache_pool import PromptCachePool
    from dflash_mlx.server.metrics import Metrics

    choice = PathChoice()
    choice.observe_clients(3)
    choice.observe_clients(5)
    choice.observe_clients(2)
    text = Metrics().render(0, PromptCachePool(lambda: None), choice)
    assert "\ndflash_path_clients 5\n" in text
    choice.observe_clients(7, at=0.0)  # long before the window: forgotten
    assert "\ndflash_path_clients 5\n" in Metrics().render(0, PromptCachePool(lambda: None), choice)


def test_a_batch_counts_as_decoding_for_the_prefix_caches_writer(chat_pair):
    """The prefix cache's writer waits while anything decodes (cache/decoding.py's
    gate): a batch enters the gate for its run and leaves it after, failed or not."""
    from dflash_mlx.cache.decoding import decoding

    model, draft, tokenizer = chat_pair
    seen = []

    async def main() -> int:
        service = Service(model, draft, tokenizer, ServerConfig(max_batch=2, batching="always"))
        before = decoding.running

        def more(room: int) -> list:
            seen.append(decoding.running - before)
            return []

        served = service.worker.batcher.run([Job(chat_ids(tokenizer, "w5"), params(4))], more)
        seen.append(decoding.running - before)
        return served

    assert asyncio.run(main()) == 1
    assert seen[:-1] and set(seen[:-1]) == {1} and seen[-1] == 0


def test_a_request_holds_the_prefix_caches_writer_from_its_preparing_on(chat_pair, monkeypatch):
    """The writer waits for a request's whole stay, not only its decoding: while
    its prompt is prepared, and while the worker copies a kept prefix and
    prefills it, the gate is held; after, it is free again."""
    from dflash_mlx.cache.decoding import decoding
    from dflash_mlx.server.decoder import Decoder

    model, draft, tokenizer = chat_pair
    seen = {}
    real_run = Decoder.run

    def run(self, job):
        seen["serving"] = decoding.running - seen["before"]
        return real_run(self, job)

    monkeypatch.setattr(Decoder, "run", run)

    async def main() -> None:
        service = Service(model, draft, tokenizer, ServerConfig())
        seen["before"] = decoding.running
        seen["preparing"] = await service.off_loop(lambda: decoding.running) - seen["before"]
        service.worker._run_dflash(Job(chat_ids(tokenizer, "w5"), params(4)))
        seen["after"] = decoding.running - seen["before"]

    asyncio.run(main())
    assert (seen["preparing"], seen["serving"], seen["after"]) == (1, 1, 0)


def next_request_while_kept(pair, earlier) -> tuple[str, int]:
    """``earlier(worker)`` submits a request and returns once its client is
    done with it; then, while the server still keeps that request's cache,
    an unrelated request: the path that served it and the clients counted."""
    import threading

    model, draft, tokenizer = pair

    async def main():
        service = Service(model, draft, tokenizer, ServerConfig())  # DFlash's speed not measured yet
        service.choice.window_s = 600.0
        pool = service.worker.decoder.pool
        give_back, sent = pool.give_back, threading.Event()

        def kept_late(cache, prompt_length):
            sent.wait(30)  # the next request arrives before the cache is kept
            give_back(cache, prompt_length)

        pool.give_back = kept_late
        service.worker.start()
        try:
            await earlier(service.worker)
            follow = Job(chat_ids(tokenizer, "w20 w21"), params(4))
            service.worker.submit(follow)
            sent.set()
            done = [e async for e in follow.events()][-1]
            return path({"done": done}), service.choice.clients()
        finally:
            await asyncio.to_thread(service.worker.stop)

    return asyncio.run(main())


def test_a_request_sent_while_the_last_ones_cache_is_kept_is_still_one_client(chat_pair):
    """A client that sends its next request the moment its reply arrives,
    while the server still keeps the last one's cache: one client, its new
    conversation served by DFlash, not batched as a second client's."""
    paths = []

    async def answered(worker):
        job = Job(chat_ids(chat_pair[2], "w5 w6 w7 w8"), params(4))
        worker.submit(job)
        paths.append(path({"done": [e async for e in job.events()][-1]}))

    assert next_request_while_kept(chat_pair, answered) == ("dflash", 1)
    assert paths == ["dflash"]


def test_a_request_cancelled_while_its_cache_is_kept_is_not_company(chat_pair):
    """A client that stops its reply (it goes away) and sends its next
    request at once is one client too."""

    async def stopped(worker):
        job = Job(chat_ids(chat_pair[2], "w5 w6"), params(200))
        worker.submit(job)
        await job.events().__anext__()  # it is decoding
        job.cancel()

    assert next_request_while_kept(chat_pair, stopped) == ("dflash", 1)
