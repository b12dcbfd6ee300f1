"""The one-line summaries of a DFlash GenerationResponse: generate's stats
line and chat's live status line."""

from __future__ import annotations


def _sizes_text(r, kind: str, setting: int | str | None) -> str:
    """``kind`` ("block" or "tree") and its fixed size, or what auto chose
    over the reply's cycles ("block auto 8-16, mostly 16")."""
    sizes = {b: n for b, n in (getattr(r, "block_sizes", None) or {}).items() if b > 1}
    if setting not in (None, "auto"):
        return f"{kind} {setting}"
    text = f"{kind} auto"
    if sizes:
        lo, hi, mostly = min(sizes), max(sizes), max(sizes, key=lambda b: (sizes[b], b))
        text += f" {lo}" if lo == hi else f" {lo}-{hi}, mostly {mostly}"
    return text


def _steps_text(r, setting: int | str | None) -> str:
    """How many cycles were plain target steps (and, under auto, why), and how many were looked up."""
    text = ""
    plain = (getattr(r, "block_sizes", None) or {}).get(1, 0)
    if plain:
        text += f", {plain} plain step{'s' if plain != 1 else ''}"
        reason = getattr(r, "auto_reason", None)
        if setting in (None, "auto") and reason and reason.startswith("plain") and 2 * plain > r.cycles:
            text += f" ({reason.removeprefix('plain: ')})"
    hits = getattr(r, "lookup_hits", 0)
    if hits:
        text += f", {hits} looked up"
    return text


def block_text(r, block_size: int | str | None = None) -> str:
    """The block a reply used: the fixed one, or what auto chose over its
    cycles ("auto 8-16, mostly 16"), and how many cycles were plain target
    steps (from ``block_sizes``)."""
    return _sizes_text(r, "block", block_size) + _steps_text(r, block_size)


def rows_per_cycle(r) -> float:
    """Target rows verified per drafting cycle (a tree's nodes, or a block's rows)."""
    drafting = r.cycles - (getattr(r, "block_sizes", None) or {}).get(1, 0)
    return getattr(r, "rows_verified", 0) / drafting if drafting > 0 else 0.0


def tree_text(r, tree_budget: int | str) -> str:
    """The trees a reply verified: "tree 24: 5.10 tokens/cycle, 23.0 rows
    verified/cycle" (auto: the sizes it chose), then its plain steps."""
    head = _sizes_text(r, "tree", tree_budget)
    if not drafted(r):
        return f"{head}: no drafting cycles{_steps_text(r, tree_budget)}"
    figures = f"{r.acceptance_length:.2f} tokens/cycle, {rows_per_cycle(r):.1f} rows verified/cycle"
    return f"{head}: {figures}{_steps_text(r, tree_budget)}"


def _generated(r) -> str:
    """Tokens, and their rate only once there is one to measure (the first
    token's response has none: its time is the prompt's)."""
    n = r.generation_tokens
    if n <= 1 or not r.generation_tps:
        return f"generated {n} token{'s' if n != 1 else ''}"
    return f"generated {n} tokens, {r.generation_tps:.1f} tok/s"


def drafted(r) -> bool:
    """Whether any cycle drafted: acceptance is undefined over plain steps alone."""
    sizes = getattr(r, "block_sizes", None)
    return sizes is None or any(n for b, n in sizes.items() if b > 1)


def stats_line(r, block_size: int | str | None = None, limit: str | None = None, *, tree_budget=None) -> str:
    """The stats line ``generate`` prints after the reply. ``limit``: what cut
    the reply when it ended for length (e.g. '--max-tokens 256');
    ``tree_budget``: --tree-budget's value (None: blocks)."""
    if tree_budget is not None:
        rate = f" · acceptance rate {r.acceptance_rate:.1%}" if drafted(r) else ""
        drafting = f"{tree_text(r, tree_budget)}{rate}"
    elif drafted(r):
        drafting = (
            f"{block_text(r, block_size)} · acceptance length {r.acceptance_length:.2f} · "
            f"acceptance rate {r.acceptance_rate:.1%}"
        )
    else:
        drafting = f"{block_text(r, block_size)} · acceptance length - (no drafting cycles)"
    line = (
        f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s · {_generated(r)} · {drafting} · "
        f"peak memory {r.peak_memory:.2f} GB"
    )
    if r.finish_reason == "length" and limit:
        line += f" · cut at {limit}"
    return line


def status_text(r, block_size: int | str | None = None, final: bool = False, *, tree_budget=None) -> str:
    """The chat status line (``final``: the line left under a finished reply;
    ``tree_budget``: --tree-budget's value, None for blocks)."""
    if tree_budget is not None:
        return _tree_status(r, tree_budget, final)
    block = f"auto ({r.block_size})" if block_size == "auto" else (block_size or r.block_size)
    if r.cycles == 0 and not final:
        return f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.0f} tok/s · block {block}"
    if final:
        lead = f"{r.generation_tokens} tokens · "
        block = block_text(r, block_size).removeprefix("block ")
    else:
        lead = ""
    rate = f"{r.generation_tps:.1f} tok/s · " if r.generation_tokens > 1 and r.generation_tps else ""
    acceptance = f"τ {r.acceptance_length:.2f} · accept {r.acceptance_rate:.0%}" if drafted(r) else "τ - · accept -"
    return f"{lead}{rate}{acceptance} · block {block} · {r.peak_memory:.2f} GB"


def _tree_status(r, tree_budget: int | str, final: bool) -> str:
    """``status_text`` with trees: while streaming the tree's size (under auto
    the last cycle's rows) and tokens per cycle; finished, ``tree_text``."""
    tree = f"tree auto ({r.block_size})" if tree_budget == "auto" else f"tree {tree_budget}"
    if r.cycles == 0 and not final:
        return f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.0f} tok/s · {tree}"
    rate = f"{r.generation_tps:.1f} tok/s · " if r.generation_tokens > 1 and r.generation_tps else ""
    accept = f"accept {r.acceptance_rate:.0%}" if drafted(r) else "accept -"
    if final:
        return f"{r.generation_tokens} tokens · {rate}{tree_text(r, tree_budget)} · {accept} · {r.peak_memory:.2f} GB"
    tau = f"{r.acceptance_length:.2f} tokens/cycle" if drafted(r) else "- tokens/cycle"
    return f"{rate}{tree}: {tau} · {accept} · {r.peak_memory:.2f} GB"
