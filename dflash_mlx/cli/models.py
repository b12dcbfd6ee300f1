"""`dflash-mlx models`: the known target -> drafter pairs, which run today,
and what is cached."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from .console import console, user_errors
from .options import Verbose

EXAMPLES = """\
Examples:

$ dflash-mlx models

$ dflash-mlx models --cached

$ dflash-mlx models --json
"""

_CACHED = {
    (True, True): "[green]both[/]",
    (True, False): "[yellow]target[/]",
    (False, True): "[yellow]drafter[/]",
    (False, False): "[dim]-[/]",
}


def models_command(
    cached: Annotated[
        bool, typer.Option("--cached", help="Only pairs whose target and drafter are both in the local cache.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    verbose: Verbose = False,
):
    """List the known target -> drafter pairs, which run today, and which are downloaded.

    The first row is the built-in pair (--model builtin, or no --model). A
    target marked as running needs no --draft-model: its first drafter here
    is the default (others are named with --draft-model). The others wait
    for an adapter for their model family.
    """
    with user_errors(verbose):
        from dflash_mlx import builtin, loading

        rows = []
        here = builtin.available()
        if here or not cached:
            rows.append(
                {
                    "target": "builtin",
                    "drafter": "builtin",
                    "format": "Z Lab DFlash",
                    "runs": here,
                    "why_not": None if here else "its weights are not installed with this copy of dflash-mlx.",
                    "target_cached": here,
                    "drafter_cached": here,
                    "builtin": True,
                }
            )
        for target, drafter in loading.known_pairs():
            t, d = loading.is_cached(target), loading.is_cached(drafter)
            if cached and not (t and d):
                continue
            why_not = loading.why_not_runs(target)
            rows.append(
                {
                    "target": target,
                    "drafter": drafter,
                    "format": loading.drafter_format(drafter),
                    "runs": why_not is None,
                    "why_not": why_not,
                    "target_cached": t,
                    "drafter_cached": d,
                    "builtin": False,
                }
            )
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        table = Table(title="known DFlash pairs", title_style="bold")
        table.add_column("target")
        table.add_column("drafter")
        table.add_column("format")
        table.add_column("runs")
        table.add_column("cached", justify="center")
        for r in rows:
            runs = "[green]yes[/]" if r["runs"] else f"[dim]no: {r['why_not']}[/]"
            target = f"{r['target']} [cyan](built-in, offline)[/]" if r["builtin"] else r["target"]
            table.add_row(target, r["drafter"], r["format"], runs, _CACHED[r["target_cached"], r["drafter_cached"]])
        console.print(table)
        if not any(not r["builtin"] for r in rows):
            console.print("[dim]no Hub pair is fully cached yet; `dflash-mlx chat --model <target>` downloads one.[/]")
