"""`dflash-mlx models`: the known target -> drafter pairs and what is cached."""

from __future__ import annotations

import json

import typer
from rich.table import Table
from typing_extensions import Annotated

from .common import UserError, Verbose, console, user_errors

EXAMPLES = """\
Examples:

$ dflash-mlx models

$ dflash-mlx models --cached

$ dflash-mlx models --json
"""


def models_command(
    cached: Annotated[bool, typer.Option("--cached", help="Only pairs whose target and drafter are both in the local cache.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    verbose: Verbose = False,
):
    """List the known target -> drafter pairs and which are already downloaded.

    Any target listed runs without --draft-model: its drafter is found here.
    """
    with user_errors(verbose):
        from dflash_mlx import loading

        if not hasattr(loading, "known_pairs"):
            raise UserError("this build of dflash-mlx has no model registry; pass --draft-model explicitly.")
        is_cached = getattr(loading, "is_cached", lambda repo: False)
        rows = []
        for target, drafter in loading.known_pairs():
            t, d = is_cached(target), is_cached(drafter)
            if cached and not (t and d):
                continue
            rows.append({"target": target, "drafter": drafter, "target_cached": t, "drafter_cached": d})
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        table = Table(title="known DFlash pairs", title_style="bold")
        table.add_column("target")
        table.add_column("drafter")
        table.add_column("cached", justify="center")
        for r in rows:
            mark = {(True, True): "[green]both[/]", (True, False): "[yellow]target[/]",
                    (False, True): "[yellow]drafter[/]", (False, False): "[dim]-[/]"}
            table.add_row(r["target"], r["drafter"], mark[r["target_cached"], r["drafter_cached"]])
        console.print(table)
        if not rows:
            console.print("[dim]no pair is fully cached yet; `dflash-mlx chat --model <target>` downloads one.[/]")
