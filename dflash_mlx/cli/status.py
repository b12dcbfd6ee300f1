"""The one-line summaries of a DFlash GenerationResponse: generate's stats
line and chat's live status line."""

from __future__ import annotations


def block_text(r, block_size: int | str | None = None) -> str:
    """The block a reply used: the fixed one, or what auto chose over its
    cycles ("auto 8-16, mostly 16"), and how many cycles were plain target
    steps (from ``block_sizes``)."""
    sizes = {b: n for b, n in (getattr(r, "block_sizes", None) or {}).items() if b > 1}
    if block_size in (None, "auto"):
        text = "block auto"
        if sizes:
            lo, hi, mostly = min(sizes), max(sizes), max(sizes, key=lambda b: (sizes[b], b))
            text += f" {lo}" if lo == hi else f" {lo}-{hi}, mostly {mostly}"
    else:
        text = f"block {block_size}"
    plain = (getattr(r, "block_sizes", None) or {}).get(1, 0)
    if plain:
        text += f", {plain} plain step{'s' if plain != 1 else ''}"
        reason = getattr(r, "auto_reason", None)
        if block_size in (None, "auto") and reason and reason.startswith("plain") and 2 * plain > r.cycles:
            text += f" ({reason.removeprefix('plain: ')})"
    hits = getattr(r, "lookup_hits", 0)
    if hits:
        text += f", {hits} looked up"
    return text


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


def stats_line(r, block_size: int | str | None = None, limit: str | None = None) -> str:
    """The stats line ``generate`` prints after the reply. ``limit``: what cut
    the reply when it ended for length (e.g. '--max-tokens 256')."""
    acceptance = (
        f"acceptance length {r.acceptance_length:.2f} · acceptance rate {r.acceptance_rate:.1%}"
        if drafted(r)
        else "acceptance length - (no drafting cycles)"
    )
    line = (
        f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s · {_generated(r)} · {block_text(r, block_size)} · "
        f"{acceptance} · peak memory {r.peak_memory:.2f} GB"
    )
    if r.finish_reason == "length" and limit:
        line += f" · cut at {limit}"
    return line


def status_text(r, block_size: int | str | None = None, final: bool = False) -> str:
    """The chat status line (``final``: the line left under a finished reply)."""
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
