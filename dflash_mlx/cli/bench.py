"""`dflash-mlx bench`: plain mlx-lm decoding vs DFlash, same prompts, one run."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from dflash_mlx.prompts import read_prompts

from . import options
from .console import UserError, console, err, user_errors
from .option_groups import Kv, Pair, Sampling, Template, check_drafter_block, check_trees, flags, takes_groups
from .pair import model_or_builtin
from .prompt_input import prompt_ids

EXAMPLES = """\
Examples:

$ dflash-mlx bench --model Qwen/Qwen3-8B

$ dflash-mlx bench --model ./qwen3-8b --draft-model ./qwen3-8b-dflash --prompts prompts.txt -m 512 --repeat 3

$ dflash-mlx bench --model Qwen/Qwen3-8B --prompts mt_bench.jsonl --block-size 8 --json > results.json

--prompts takes one prompt per line, or JSONL with a "prompt" (or "messages", "question", "instruction", "input", "text", "turns") field;
MT-Bench's "turns" are asked in order, each after the reply to the one before. Without --model the built-in pair runs.
"""

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test.",
    "A train leaves at 9:40 and arrives at 13:05 after covering 290 km. What is its average speed? Show the steps.",
    "Explain how a hash table handles collisions, in three short paragraphs.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
]


def _run(generate, *extra: str) -> dict:
    """The text and figures of the reply ``generate()`` streams, with ``extra``
    ones taken from its last response; the peak memory is the reply's own."""
    import mlx.core as mx

    mx.reset_peak_memory()
    text, last = [], None
    for last in generate():
        text.append(last.text)
    figures = dict(tokens=last.generation_tokens, tps=last.generation_tps, prompt_tps=last.prompt_tps)
    return dict(figures, peak_memory=last.peak_memory, text="".join(text), **{k: getattr(last, k) for k in extra})


def _per_cycle(run: dict) -> dict:
    """``run`` with the target rows each drafting cycle verified (a tree's
    nodes, a block's rows) and the draft depth it accepted, on average."""
    drafting = run["cycles"] - run["block_sizes"].get(1, 0)
    return dict(
        run,
        rows_per_cycle=run["rows_verified"] / drafting if drafting else 0.0,
        accepted_depth=run["acceptance_length"] - 1 if drafting else 0.0,
    )


def _short(text: str, n: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


@takes_groups
def bench_command(
    *,
    pair: Pair = flags(Pair),
    prompts: Annotated[
        Optional[Path], typer.Option("--prompts", help="Prompts file: one per line, or JSONL.", show_default=False)
    ] = None,
    sampling: Sampling = flags(Sampling, seed=0),
    repeat: Annotated[int, typer.Option("--repeat", help="Runs per prompt and method; tok/s is the mean.")] = 1,
    system_prompt: options.SystemPrompt = None,
    template: Template = flags(Template, "use_default_chat_template", "ignore_chat_template", "enable_thinking"),
    kv: Kv = flags(Kv),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the results as JSON on stdout instead of a table.")
    ] = False,
    verbose: options.Verbose = False,
):
    """Compare plain mlx-lm decoding of the target with DFlash on the same prompts.

    Both run in this process on the same weights, after a short warm-up; the
    table shows tok/s for both, the speedup, acceptance length and rate, and
    peak memory. At --temp 0 it also checks that both produced the same text.
    """
    with user_errors(verbose):
        generation = sampling.check(drafter=pair.draft_model != "none")
        block_size, seed, max_tokens = generation["block_size"], sampling.seed, sampling.max_tokens
        tree_budget = generation["tree_budget"]
        kv.check()
        if repeat < 1:
            raise UserError(f"--repeat must be a positive integer, got {repeat}.")
        items = read_prompts(prompts) if prompts is not None else [{"prompt": p} for p in DEFAULT_PROMPTS]
        import mlx.core as mx
        from mlx_lm.generate import stream_generate as lm_stream_generate
        from mlx_lm.sample_utils import make_sampler

        from dflash_mlx import stream_generate
        from dflash_mlx.draft.precision import bits_of

        target_name = model_or_builtin(pair.model, pair.draft_model)
        target, draft, tokenizer = pair.load(target_name)
        check_drafter_block(block_size, draft)
        template.prepare(tokenizer)
        if pair.model is None or pair.model == "builtin":
            target_name, draft_name = "builtin", pair.draft_model or "builtin"
        else:
            from dflash_mlx.loading import find_drafter

            draft_name = pair.draft_model or find_drafter(target_name)
        notes = iter([False])  # the template notes once, for the first prompt

        def encode(prompt):
            return prompt_ids(
                tokenizer,
                prompt,
                system_prompt=system_prompt,
                quiet=next(notes, True),
                **template.prompt_settings({}),
            )

        eos = list(tokenizer.eos_token_ids)
        sampler = make_sampler(**sampling.sampler(), xtc_special_tokens=tokenizer.encode("\n") + eos)
        trees = check_trees(tree_budget, target, draft, kv.cache(target, draft))  # refuses a target it cannot serve

        def plain(ids, n, run):
            if seed is not None:
                mx.random.seed(seed + run)
            # the same cache for mlx-lm
            return _run(lambda: lm_stream_generate(target, tokenizer, ids, max_tokens=n, sampler=sampler, **asdict(kv)))

        def dflash(ids, n, run):
            args = dict(generation, seed=None if seed is None else seed + run, prompt_cache=kv.cache(target, draft))
            stats = ("acceptance_length", "acceptance_rate", "block_size", "rows_verified", "cycles", "block_sizes")
            return _per_cycle(
                _run(lambda: stream_generate(target, draft, tokenizer, ids, max_tokens=n, **args), *stats)
            )

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        results = []
        with Progress(
            TextColumn("[dim]{task.description}"), BarColumn(), MofNCompleteColumn(), console=err, transient=True
        ) as bar:
            warm = min(max_tokens, 16)
            task = bar.add_task("warm-up", total=2)
            first = items[0]
            ids = encode(first.get("prompt") or first["messages"])
            plain(ids, warm, 0)
            bar.advance(task)
            dflash(ids, warm, 0)
            bar.advance(task)
            task = bar.add_task("bench", total=2 * repeat * sum(len(item.get("turns", [0])) for item in items))
            for item in items:
                # MT-Bench's turns: each asked after the reply to the one before (DFlash's reply, which at
                # --temp 0 is the target's own).
                messages = list(item.get("messages", []))
                for turn in item.get("turns", [item.get("prompt")]):
                    if turn is not None:
                        messages.append({"role": "user", "content": turn})
                    ids = encode(messages)
                    runs_plain, runs_dflash = [], []
                    for run in range(repeat):
                        runs_plain.append(plain(ids, max_tokens, run))
                        bar.advance(task)
                        runs_dflash.append(dflash(ids, max_tokens, run))
                        bar.advance(task)
                    greedy = sampling.temp == 0
                    results.append(_summarise(messages[-1]["content"], ids, runs_plain, runs_dflash, greedy))
                    messages.append({"role": "assistant", "content": runs_dflash[0]["text"]})

        summary = _overall(results)
        block = block_size or draft.config.block_size
        if as_json:
            out = {
                "model": target_name,
                "draft_model": draft_name,
                "draft_bits": None if draft is None else (bits_of(draft) or 16),
                "device": str(mx.default_device()),
                "max_tokens": max_tokens,
                "repeat": repeat,
                **sampling.sampler(),
                "block_size": block,
                "tree_budget": trees,
                "results": results,
                "summary": summary,
            }
            typer.echo(json.dumps(out, indent=2))
            return
        setting = f"block {block}" if trees is None else f"tree {trees}"
        greedy = sampling.temp == 0
        _table(results, summary, f"{target_name} · {setting}", str(mx.default_device()), greedy, trees is not None)


def _summarise(text, ids, runs_plain, runs_dflash, greedy: bool) -> dict:
    def mean(runs, key):
        return statistics.fmean(r[key] for r in runs)

    plain_tps, dflash_tps = mean(runs_plain, "tps"), mean(runs_dflash, "tps")
    row = {
        "prompt": text,
        "prompt_tokens": len(ids),
        "plain_tokens": runs_plain[0]["tokens"],
        "dflash_tokens": runs_dflash[0]["tokens"],
        "plain_tps": plain_tps,
        "dflash_tps": dflash_tps,
        "speedup": dflash_tps / plain_tps if plain_tps else 0.0,
        "acceptance_length": mean(runs_dflash, "acceptance_length"),
        "acceptance_rate": mean(runs_dflash, "acceptance_rate"),
        "rows_per_cycle": mean(runs_dflash, "rows_per_cycle"),
        "accepted_depth": mean(runs_dflash, "accepted_depth"),
        "plain_peak_memory_gb": max(r["peak_memory"] for r in runs_plain),
        "dflash_peak_memory_gb": max(r["peak_memory"] for r in runs_dflash),
    }
    if greedy:
        row["identical"] = all(p["text"] == d["text"] for p, d in zip(runs_plain, runs_dflash))
    return row


def _overall(results: list[dict]) -> dict:
    """Token-weighted totals: all tokens over all decoding time."""
    plain_time = sum(r["plain_tokens"] / r["plain_tps"] for r in results if r["plain_tps"])
    dflash_time = sum(r["dflash_tokens"] / r["dflash_tps"] for r in results if r["dflash_tps"])
    plain_tps = sum(r["plain_tokens"] for r in results) / plain_time if plain_time else 0.0
    dflash_tps = sum(r["dflash_tokens"] for r in results) / dflash_time if dflash_time else 0.0
    out = {
        "plain_tps": plain_tps,
        "dflash_tps": dflash_tps,
        "speedup": dflash_tps / plain_tps if plain_tps else 0.0,
        "acceptance_length": statistics.fmean(r["acceptance_length"] for r in results),
        "acceptance_rate": statistics.fmean(r["acceptance_rate"] for r in results),
        "rows_per_cycle": statistics.fmean(r["rows_per_cycle"] for r in results),
        "accepted_depth": statistics.fmean(r["accepted_depth"] for r in results),
        "plain_peak_memory_gb": max(r["plain_peak_memory_gb"] for r in results),
        "dflash_peak_memory_gb": max(r["dflash_peak_memory_gb"] for r in results),
    }
    if results and "identical" in results[0]:
        out["identical"] = all(r["identical"] for r in results)
    return out


def _table(results, summary, model_name, device, greedy, trees: bool) -> None:
    """The results as a table; ``trees``: with the rows each cycle verified and the depth it accepted."""
    table = Table(title=f"mlx-lm vs DFlash · {model_name} · {device}", title_style="bold")
    table.add_column("prompt", overflow="ellipsis", max_width=42)
    table.add_column("tokens", justify="right")
    table.add_column("mlx-lm tok/s", justify="right")
    table.add_column("dflash tok/s", justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("τ", justify="right")
    table.add_column("accepted", justify="right")
    if trees:
        table.add_column("rows/cycle", justify="right")
        table.add_column("depth", justify="right")
    table.add_column("peak GB mlx-lm / dflash", justify="right")
    if greedy:
        table.add_column("same text", justify="center")

    def cells(r, name, tokens):
        row = [
            name,
            tokens,
            f"{r['plain_tps']:.1f}",
            f"{r['dflash_tps']:.1f}",
            f"[{'green' if r['speedup'] >= 1 else 'red'}]{r['speedup']:.2f}x[/]",
            f"{r['acceptance_length']:.2f}",
            f"{r['acceptance_rate']:.0%}",
        ]
        if trees:
            row += [f"{r['rows_per_cycle']:.1f}", f"{r['accepted_depth']:.2f}"]
        row.append(f"{r['plain_peak_memory_gb']:.2f} / {r['dflash_peak_memory_gb']:.2f}")
        if greedy:
            row.append("[green]yes[/]" if r["identical"] else "[red]no[/]")
        return row

    for r in results:
        table.add_row(*cells(r, escape(_short(r["prompt"])), str(r["dflash_tokens"])))
    table.add_section()
    table.add_row(*cells(summary, "[bold]all[/]", str(sum(r["dflash_tokens"] for r in results))))
    console.print(table)
