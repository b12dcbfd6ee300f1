"""The one-line summaries of a DFlash GenerationResponse: generate's stats
line and chat's live status line."""

from __future__ import annotations


def stats_line(r) -> str:
    """The stats line ``generate`` prints after the reply."""
    return (
        f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s · "
        f"generated {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s · "
        f"acceptance length {r.acceptance_length:.2f} · acceptance rate {r.acceptance_rate:.1%} · "
        f"peak memory {r.peak_memory:.2f} GB"
    )


def status_text(r, block_size: int | str | None = None, final: bool = False) -> str:
    """The chat status line (``final``: the line left under a finished reply)."""
    block = f"auto ({r.block_size})" if block_size == "auto" else (block_size or r.block_size)
    if r.cycles == 0 and not final:
        return f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.0f} tok/s · block {block}"
    lead = f"{r.generation_tokens} tokens · " if final else ""
    return (
        f"{lead}{r.generation_tps:.1f} tok/s · τ {r.acceptance_length:.2f} · accept {r.acceptance_rate:.0%} · "
        f"block {block} · {r.peak_memory:.2f} GB"
    )
