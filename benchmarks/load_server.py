"""`dflash-mlx serve` under load: requests/s, time to first token, tok/s a client, errors (must be 0).

Reported in BENCHMARKS.md, "`dflash-mlx serve` under load", and docs/server.md.

    python benchmarks/load_server.py --clients 8 --requests 4 --max-tokens 64
    python benchmarks/load_server.py --url http://127.0.0.1:8080 --model-name builtin   # a server already running

N clients each send M streamed chat requests one after another over loopback
(the held-out chat prompts, greedy). Without ``--url`` the built-in pair is
served from this process, and the same prompts decoded directly give the
server / direct ratio. The server decodes one request at a time, so the time
to first token includes the wait in the queue.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import httpx

PROMPTS = Path(__file__).parent / "prompts" / "held_out.json"


def stream_one(client: httpx.Client, url: str, body: dict) -> dict:
    """One streamed chat request: time to first token, tokens, duration."""
    start = time.perf_counter()
    first = None
    tokens = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and any(
                c["delta"].get("content") or c["delta"].get("reasoning_content") for c in chunk["choices"]
            ):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tokens": tokens, "decode_s": end - first, "total_s": end - start}


def run_client(index: int, url: str, args, prompts: list[str], results: list, errors: list, deadline: float) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(timeout=args.timeout, headers=headers) as client:
        for r in range(args.requests):
            if time.perf_counter() > deadline:
                errors.append(f"client {index}: out of time before request {r}")
                return
            prompt = prompts[(index * args.requests + r) % len(prompts)]
            body = {
                "model": args.model_name,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                results.append({"client": index, **stream_one(client, url, body)})
            except Exception as e:  # counted, reported, and the load goes on
                errors.append(f"client {index} request {r}: {type(e).__name__}: {e}")


def drive(url: str, args) -> dict:
    prompts = json.loads(PROMPTS.read_text())["chat"]
    results, errors = [], []
    deadline = time.perf_counter() + args.timeout
    threads = [
        threading.Thread(target=run_client, args=(i, url, args, prompts, results, errors, deadline))
        for i in range(args.clients)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return summarize(results, errors, wall, args)


def mx_device() -> str:
    import mlx.core as mx

    return str(mx.default_device())


def summarize(results: list[dict], errors: list[str], wall: float, args) -> dict:
    per_client = []
    for c in range(args.clients):
        mine = [r for r in results if r["client"] == c]
        decode = sum(r["decode_s"] for r in mine)  # after each reply's first token, so that one is not counted
        per_client.append(sum(max(r["tokens"] - 1, 0) for r in mine) / decode if decode > 0 else 0.0)
    ttft = sorted(r["ttft"] for r in results) or [0.0]
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, MLX {mx_device()}",
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "completed": len(results),
        "errors": len(errors),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 3),
        "tokens_per_s_total": round(sum(r["tokens"] for r in results) / wall, 1),
        "ttft_s_median": round(statistics.median(ttft), 3),
        "ttft_s_max": round(ttft[-1], 3),
        "tokens_per_s_per_client_mean": round(statistics.mean(per_client), 1) if per_client else 0.0,
        "error_messages": errors[:5],
    }


def direct_tokens_per_s(pair, prompts: list[str], max_tokens: int) -> float:
    """The same chat prompts through stream_generate in this process, one
    after another, no HTTP: what the server's total tokens/s compares with."""
    from dflash_mlx import stream_generate

    model, draft, tokenizer = pair
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        for r in stream_generate(model, draft, tokenizer, ids, max_tokens=max_tokens):
            pass
        tokens += r.generation_tokens
    return tokens / (time.perf_counter() - start)


def local_server(args):
    """The pair served from a thread of this process, on a free loopback port."""
    import socket

    from dflash_mlx import load
    from dflash_mlx.server import ServerConfig, create_app, running_in_thread

    model, draft, tokenizer = load(args.model or "builtin", draft=args.draft_model)
    args.pair = (model, draft, tokenizer)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(model_name=args.model_name, max_tokens=args.max_tokens, block_size=args.block_size)
    return running_in_thread(create_app(model, draft, tokenizer, config), port=port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="A running server; without it the pair is served in this process.")
    parser.add_argument("--model", help="Target for the in-process server (default: the built-in pair).")
    parser.add_argument("--draft-model")
    parser.add_argument("--model-name", default="builtin", help="The model id to send.")
    parser.add_argument("--block-size", type=lambda s: s if s == "auto" else int(s))
    parser.add_argument("--api-key")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3, help="Requests per client, one after another.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--timeout", type=float, default=600, help="Seconds for the whole run; requests left then count as errors."
    )
    args = parser.parse_args()

    server = nullcontext(args.url.rstrip("/")) if args.url else local_server(args)
    with server as url:
        report = drive(url, args)
    if not args.url:  # the same first requests without the server, for the ratio
        prompts = json.loads(PROMPTS.read_text())["chat"][: args.clients]
        direct = direct_tokens_per_s(args.pair, prompts, args.max_tokens)
        report["direct_tokens_per_s"] = round(direct, 1)
        report["server_vs_direct"] = round(report["tokens_per_s_total"] / direct, 3)
    print(json.dumps(report, indent=2))
    if report["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
