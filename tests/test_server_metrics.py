"""GET /metrics: Prometheus' text format, and counters that move with the
requests served (a real server on 127.0.0.1, the scripted tiny pair)."""

from __future__ import annotations

import re

import httpx
from test_server import openai_client
from test_server_fixtures import scripted_pair, serving  # noqa: F401

SAMPLE = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (?P<value>\S+)'
)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, **kwargs) -> dict[tuple, float]:
    """{(name, ((label, value), ...)): value}, every line checked."""
    response = httpx.get(f"{url}/metrics", **kwargs)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples, typed = {}, set()
    for line in response.text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            parts = line.split(" ", 3)
            assert len(parts) == 4 and parts[3], line
            if parts[1] == "TYPE":
                assert parts[3] in ("counter", "gauge") and parts[2] not in typed, line
                typed.add(parts[2])
            continue
        match = SAMPLE.fullmatch(line)
        assert match, line
        name, labels = match["name"], tuple(LABEL.findall(match["labels"] or ""))
        assert name in typed, f"{name} has no # TYPE line"
        samples[name, labels] = float(match["value"])
    return samples


def test_metrics_parse_and_move_with_requests(scripted_pair):
    with serving(*scripted_pair) as url:
        before = scrape(url)
        assert before["dflash_generated_tokens_total", ()] == 0 and before["dflash_queue_depth", ()] == 0

        client = openai_client(url)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w30"}], max_tokens=50
        )
        again = client.responses.create(model="tiny", input="w30", max_output_tokens=50)
        assert httpx.post(f"{url}/v1/responses", json={"input": "w30", "bogus": 1}).status_code == 400

        after = scrape(url)
        requests = {
            dict(k[1])["endpoint"] + " " + dict(k[1])["status"]: v
            for k, v in after.items()
            if k[0] == "dflash_requests_total"
        }
        assert requests["/v1/chat/completions 200"] == 1 and requests["/v1/responses 200"] == 1
        assert requests["/v1/responses 400"] == 1 and requests["/metrics 200"] == 1
        generated = reply.usage.completion_tokens + again.usage.output_tokens
        assert after["dflash_generated_tokens_total", ()] == generated
        assert after["dflash_prompt_tokens_total", ()] == reply.usage.prompt_tokens + again.usage.input_tokens
        assert after["dflash_prompt_cached_tokens_total", ()] == again.usage.input_tokens_details.cached_tokens
        # the same prompt twice: a miss, then a hit
        assert (after["dflash_prompt_cache_misses_total", ()], after["dflash_prompt_cache_hits_total", ()]) == (1, 1)

        cycles = {int(dict(k[1])["block_size"]): v for k, v in after.items() if k[0] == "dflash_cycles_total"}
        figures = [reply.usage.model_extra["dflash"], again.usage.model_extra["dflash"]]
        assert sum(cycles.values()) == sum(f["cycles"] for f in figures)
        assert cycles.get(1, 0) == sum(f["plain_cycles"] for f in figures)
        drafting = after["dflash_drafting_cycles_total", ()]
        assert drafting == sum(n for b, n in cycles.items() if b > 1)
        proposed, accepted = after["dflash_draft_tokens_total", ()], after["dflash_accepted_tokens_total", ()]
        assert proposed == sum((b - 1) * n for b, n in cycles.items()) and 0 <= accepted <= proposed
        # the acceptance rate derived from the counters is the replies' own
        expected = 0.0
        for f in figures:
            (size,) = [b for b in f["block_sizes"] if b > 1]  # the scripted drafter's one block size
            expected += (f["acceptance_rate"] or 0) * (f["cycles"] - f["plain_cycles"]) * (size - 1)
        assert abs(accepted - expected) < 0.5
        tps = after["dflash_last_generation_tokens_per_second", ()]
        assert abs(tps - figures[1]["generation_tps"]) < 0.01
        assert after["dflash_requests_in_flight", ()] == 1  # the scrape itself
        assert after["dflash_prompt_caches", ()] >= 1


def test_metrics_need_the_api_key(scripted_pair):
    with serving(*scripted_pair, api_key="secret") as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert scrape(url, headers={"Authorization": "Bearer secret"})["dflash_queue_depth", ()] == 0
