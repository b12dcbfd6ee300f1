"""`dflash-mlx serve` under load: requests/s, time to first token, tok/s a client, errors (must be 0);
with --compare, serial DFlash, batched plain decoding and the server's automatic choice side by side;
and, with --prefix-reuse, how soon a request sharing a long prefix with an earlier one starts.

Reported in BENCHMARKS.md, "`dflash-mlx serve` under load", and docs/server.md.

    python benchmarks/load_server.py --clients 8 --requests 4 --max-tokens 64
    python benchmarks/load_server.py --url http://127.0.0.1:8080 --model-name builtin   # a server already running
    python benchmarks/load_server.py --prefix-reuse --prompt-tokens 4096
    python benchmarks/load_server.py --prefix-reuse --shape qwen3-8b --prompt-tokens 16384   # a GPU
    python benchmarks/load_server.py --compare --clients 1,4,8 --requests 3 --max-tokens 64 --repeat 3

--compare serves the pair three times per number of clients: --batching off
(serial DFlash, one request at a time), always (every request through mlx-lm's
batched plain decoding) and auto (the server's measured choice), each a fresh
server warmed up alike (one request alone, then max(clients, 2) at once, so
that auto has measured both paths, as a server that has been up a while); per
run it reports total tokens/s, each client's mean time to first token, errors,
the timed run's requests by path (from /metrics, the warm-up's left out) and
the choice's estimates at the end.

--prefix-reuse serves the pair with a prefix cache on disk (--prefix-cache-dir, a
temporary one by default) and times three requests of --prompt-tokens token ids
that share all but their last 16: the first (a miss, all prefilled), a second in
the same process, and a third in a new process over the same directory, its
files first dropped from the page cache (posix_fadvise) where the system allows.
Each process first answers an unrelated request of the same length, so no
figure pays for a process's first use of a long context's kernels (its time is
reported as ``warm_up``). A request's time is a one-token completion's, measured by the
client: queue, cache lookup and load, prefill and the first token; beside it the
path that served it and ``generation_first_token_s``, the generation's own share
(its prefill and first token, from the reply's ``usage.dflash.prompt_tps``). The built-in
pair's context is 2048 positions; for longer prompts its target is served from a
copy whose config allows the length (the same weights). With --shape the pair is
random weights at a model's shapes (benchmarks/cycle.py's), written to a
temporary directory once and loaded by both processes.

N clients each send M streamed chat requests one after another over loopback
(the held-out chat prompts, greedy), each --think-s seconds after the last
reply (0 by default; agents running tools pause so). Without ``--url`` the built-in pair is
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
            if r and args.think_s:  # a client reading its reply, or an agent running a tool
                time.sleep(args.think_s)
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
    ttft_per_client = [
        statistics.mean(r["ttft"] for r in results if r["client"] == c)
        for c in range(args.clients)
        if any(r["client"] == c for r in results)
    ]
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, MLX {mx_device()}",
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "think_s": args.think_s,
        "completed": len(results),
        "errors": len(errors),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 3),
        "tokens_per_s_total": round(sum(r["tokens"] for r in results) / wall, 1),
        "ttft_s_median": round(statistics.median(ttft), 3),
        "ttft_s_max": round(ttft[-1], 3),
        "ttft_s_per_client": [round(t, 3) for t in ttft_per_client],
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


def local_server(args, batching: str = "auto"):
    """The pair served from a thread of this process, on a free loopback port."""
    import socket

    from dflash_mlx import load
    from dflash_mlx.server import ServerConfig, create_app, running_in_thread

    if getattr(args, "pair", None) is None:
        args.pair = load(args.model or "builtin", draft=args.draft_model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(
        model_name=args.model_name,
        max_tokens=args.max_tokens,
        block_size=args.block_size,
        batching=batching,
        max_batch=args.max_batch,
    )
    return running_in_thread(create_app(*args.pair, config), port=port)


def path_counters(url: str) -> dict:
    """/metrics' requests by path and tokens/s estimates."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith("dflash_path_")}


def requests_by_path(before: dict, after: dict) -> dict:
    """Requests each path served between two path_counters readings."""
    counted = [k for k in after if k.startswith("dflash_path_requests_total")]
    return {k.split('"')[1]: int(after[k] - before.get(k, 0)) for k in counted}


def warm_up(url: str, args, concurrent: int) -> None:
    """One request alone, then ``concurrent`` at once: every path runs
    once, and the automatic choice has measured both, as on a server that
    has been up a while."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(text: str) -> None:
        body = {"model": args.model_name, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=args.timeout).raise_for_status()

    ask("Hi")
    with ThreadPoolExecutor(concurrent) as pool:
        list(pool.map(ask, [f"Count to {i + 3}." for i in range(concurrent)]))


def compare(args) -> dict:
    """Serial DFlash, batched plain and the automatic choice, per number of
    clients; with --repeat R the three take turns R times, each round in
    another order (so a machine that slows down slows all three, none
    always last), and the medians are compared."""
    import copy

    runs = []
    for clients in args.clients:
        for round_ in range(args.repeat):
            modes = ("off", "always", "auto")
            for batching in modes[round_ % 3 :] + modes[: round_ % 3]:
                run_args = copy.copy(args)
                run_args.clients = clients
                with local_server(args, batching) as url:
                    warm_up(url, args, max(clients, 2))
                    warmed = path_counters(url)
                    report = drive(url, run_args)
                    report["estimates"] = path_counters(url)
                    report["requests_by_path"] = requests_by_path(warmed, report["estimates"])
                report["batching"], report["round"] = batching, round_
                runs.append(report)
                print(
                    f"clients {clients} batching {batching:6s}: {report['tokens_per_s_total']:8.1f} tok/s total, "
                    f"TTFT per client {report['ttft_s_per_client']}, errors {report['errors']}, "
                    f"requests by path {report['requests_by_path']}",
                    flush=True,
                )
    medians, goals = {}, {}
    for clients in args.clients:
        by = {}
        for batching in ("off", "always", "auto"):
            mine = [r for r in runs if r["clients"] == clients and r["batching"] == batching]
            by[batching] = {
                "tokens_per_s_total": statistics.median(r["tokens_per_s_total"] for r in mine),
                "ttft_s_per_client": [
                    round(statistics.median(r["ttft_s_per_client"][c] for r in mine), 3) for c in range(clients)
                ],
                "errors": sum(r["errors"] for r in mine),
                "requests_by_path": [r["requests_by_path"] for r in mine],
            }
        medians[clients] = by
        best = max(by["off"]["tokens_per_s_total"], by["always"]["tokens_per_s_total"])
        goals[clients] = {
            "auto_vs_best_total": round(by["auto"]["tokens_per_s_total"] / best, 3) if best else None,
            # each round's auto against that round's better: runs minutes apart see another machine load
            "auto_vs_best_by_round": [round(r, 3) for r in by_round(runs, clients, args.repeat)],
            "auto_ttft_vs_serial_worst_client": round(
                max(a / s for a, s in zip(by["auto"]["ttft_s_per_client"], by["off"]["ttft_s_per_client"])), 3
            ),
            "errors": sum(b["errors"] for b in by.values()),
        }
    return {"machine": runs[0]["machine"], "runs": runs, "medians": medians, "goals": goals}


def by_round(runs: list[dict], clients: int, rounds: int) -> list[float]:
    """auto's total tokens/s over the better of serial DFlash and batched plain, round by round."""
    ratios = []
    for round_ in range(rounds):
        tps = {r["batching"]: r["tokens_per_s_total"] for r in runs if r["clients"] == clients and r["round"] == round_}
        best = max(tps["off"], tps["always"])
        ratios.append(tps["auto"] / best if best else 0.0)
    return ratios


def long_context_pair(args):
    """The built-in pair, its target's context raised to the prompt's length
    where it is shorter (a copy of its files)."""
    import shutil
    import tempfile

    from dflash_mlx import builtin, load

    config = json.loads((Path(builtin.TARGET) / "config.json").read_text())
    need = args.prompt_tokens + 64
    if config["max_position_embeddings"] >= need:
        return load("builtin", draft=args.draft_model)
    copy = Path(tempfile.mkdtemp(prefix="dflash-builtin-long-"))
    shutil.copytree(builtin.TARGET, copy / "target")
    config["max_position_embeddings"] = need
    (copy / "target" / "config.json").write_text(json.dumps(config))
    return load(str(copy / "target"), draft=args.draft_model or str(builtin.DRAFT))


def timed_completion(client: httpx.Client, url: str, args, prompt: list[int]) -> dict:
    start = time.perf_counter()
    body = {"model": args.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = client.post(f"{url}/v1/completions", json=body)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    usage = response.json()["usage"]
    dflash = usage.get("dflash") or {}
    timed = {
        "seconds": round(seconds, 4),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "path": dflash.get("path"),  # "batched": served by the batch, without the prefix cache
    }
    if dflash.get("prompt_tps"):  # the generation's own time to its first token; the rest is the server's
        timed["generation_first_token_s"] = round(usage["prompt_tokens"] / dflash["prompt_tps"], 4)
    return timed


def prefix_prompts(vocab: int, n: int, phase: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """A warm-up prompt of ``n`` ids its own to ``phase`` (each process warms
    up on one the store has not seen), and three prompts of ``n`` ids sharing
    all but their last 16."""
    import random

    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(n - 16)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(16)] for _ in range(3)]
    warm_rng = random.Random(phase)
    return [warm_rng.randrange(3, vocab) for _ in range(n)], *prompts


def serve_phase(args, prompts: list[list[int]]) -> tuple[list[dict], dict]:
    """Serve the pair over args.prefix_cache_dir and time ``prompts`` one
    after another; the server's prefix-cache counters."""
    import socket

    from dflash_mlx.server import ServerConfig, create_app, running_in_thread

    if args.model in (None, "builtin"):
        model, draft, tokenizer = long_context_pair(args)
    else:
        from dflash_mlx import load

        model, draft, tokenizer = load(args.model, draft=args.draft_model)
    config = ServerConfig(
        model_name=args.model_name,
        max_tokens=1,
        block_size=args.block_size,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_gb=args.prefix_cache_gb,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running_in_thread(create_app(model, draft, tokenizer, config), port=port) as url:
        with httpx.Client(timeout=args.timeout) as client:
            times = [timed_completion(client, url, args, p) for p in prompts]
            metrics = client.get(f"{url}/metrics").text
    counters = {
        line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("dflash_prefix_")
    }
    return times, counters


def drop_from_page_cache(directory: Path) -> bool:
    """Ask the kernel to forget the directory's files' pages; False where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in directory.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def disk_read_rate(directory: Path) -> float | None:
    """GB/s reading the largest entry once dropped from the page cache (what
    a restart's load is bound by); None where the cache cannot be dropped."""
    entries = sorted(directory.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    if not entries or not drop_from_page_cache(directory):
        return None
    start = time.perf_counter()
    with open(entries[-1], "rb") as f:
        while f.read(1 << 24):
            pass
    return round(entries[-1].stat().st_size / (time.perf_counter() - start) / 1e9, 3)


def prefix_reuse(args) -> dict:
    import subprocess
    import sys
    import tempfile

    from mlx_lm.utils import load_config

    from dflash_mlx import builtin

    if args.model not in (None, "builtin") and args.phase == "first":
        raise SystemExit("--prefix-reuse runs the built-in pair or --shape's; leave out --model.")
    if args.shape:
        from speed import random_pair

        args.model, args.draft_model = random_pair(args.shape, Path(tempfile.mkdtemp(prefix="dflash-pair-")))
    vocab = load_config(Path(args.model if args.model not in (None, "builtin") else builtin.TARGET))["vocab_size"]
    warm, first, second, third = prefix_prompts(vocab, args.prompt_tokens, args.phase)
    if args.phase == "restart":
        times, counters = serve_phase(args, [warm, third])
        return {"warm_up": times[0], "restart": times[1], "counters": counters}
    if args.prefix_cache_dir is None:
        args.prefix_cache_dir = tempfile.mkdtemp(prefix="dflash-prefix-cache-")
    times, counters = serve_phase(args, [warm, first, second])
    dropped = drop_from_page_cache(Path(args.prefix_cache_dir))
    command = [sys.executable, __file__, "--prefix-reuse", "--phase", "restart"]
    command += ["--prompt-tokens", str(args.prompt_tokens), "--prefix-cache-dir", args.prefix_cache_dir]
    command += ["--prefix-cache-gb", str(args.prefix_cache_gb), "--model-name", args.model_name]
    if args.shape:
        command += ["--model", args.model, "--draft-model", args.draft_model]
    if args.block_size is not None:
        command += ["--block-size", str(args.block_size)]
    restart = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    read_gb_s = disk_read_rate(Path(args.prefix_cache_dir))
    warm_up, times = times[0], times[1:]
    first_s = times[0]["seconds"]
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, MLX {mx_device()}",
        "prompt_tokens": args.prompt_tokens,
        "pair": args.shape or "builtin",
        "warm_up": warm_up,
        "warm_up_after_restart": restart["warm_up"],
        "first": times[0],
        "same_process": times[1],
        "restart": restart["restart"],
        "page_cache_dropped": dropped,
        "disk_read_gb_s": read_gb_s,
        "same_process_vs_first": round(times[1]["seconds"] / first_s, 4),
        "restart_vs_first": round(restart["restart"]["seconds"] / first_s, 4),
        "counters_first_process": counters,
        "counters_restart": restart["counters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="A running server; without it the pair is served in this process.")
    parser.add_argument("--model", help="Target for the in-process server (default: the built-in pair).")
    parser.add_argument("--draft-model")
    parser.add_argument("--model-name", default="builtin", help="The model id to send.")
    parser.add_argument("--block-size", type=lambda s: s if s == "auto" else int(s))
    parser.add_argument("--api-key")
    parser.add_argument(
        "--clients", default="4", help="Concurrent clients; with --compare a comma-separated list (1,4,8)."
    )
    parser.add_argument(
        "--batching", choices=["auto", "off", "always"], default="auto", help="The in-process server's batching."
    )
    parser.add_argument("--max-batch", type=int, default=8, help="The most requests one batch serves at once.")
    parser.add_argument("--compare", action="store_true", help="Serial DFlash, batched plain and auto side by side.")
    parser.add_argument("--repeat", type=int, default=1, help="--compare: rounds of the three, medians compared.")
    parser.add_argument("--requests", type=int, default=3, help="Requests per client, one after another.")
    parser.add_argument(
        "--think-s", type=float, default=0.0, help="Seconds a client waits after a reply before its next request."
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--timeout", type=float, default=600, help="Seconds for the whole run; requests left then count as errors."
    )
    parser.add_argument("--prefix-reuse", action="store_true", help="Time prefix reuse instead of a load.")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="--prefix-reuse: the prompts' length.")
    parser.add_argument("--prefix-cache-dir", help="--prefix-reuse: the directory (default: a temporary one).")
    parser.add_argument("--prefix-cache-gb", type=float, default=20.0)
    parser.add_argument("--shape", help="--prefix-reuse: random weights at these shapes (cycle.py's) for the pair.")
    parser.add_argument("--phase", choices=["first", "restart"], default="first", help=argparse.SUPPRESS)
    args = parser.parse_args()

    args.clients = [int(c) for c in args.clients.split(",")]
    if args.prefix_reuse:
        print(json.dumps(prefix_reuse(args), indent=2))
        return
    if args.compare:
        if args.url:
            raise SystemExit("--compare serves the pair itself; leave out --url.")
        report = compare(args)
        print(json.dumps(report, indent=2))
        if any(g["errors"] for g in report["goals"].values()):
            raise SystemExit(1)
        return
    if len(args.clients) != 1:
        raise SystemExit("give one number of clients, or several with --compare.")
    args.clients = args.clients[0]
    server = nullcontext(args.url.rstrip("/")) if args.url else local_server(args, args.batching)
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
