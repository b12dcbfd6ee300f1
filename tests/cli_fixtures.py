"""Tiny model directories for the CLI tests, and a small terminal emulator
that turns what a pseudo-terminal received into the lines a user would see."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from tiny import (
    draft_config,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
    write_target,
    write_zlab_draft,
)

VOCAB = 64

# A template over the tiny word-level vocabulary (unknown words would all
# map to w0): w1 opens a system turn, w2 a user turn, w3 the assistant's,
# w4 ends a turn and w5 is the thinking switch.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w1 {% elif m['role'] == 'user' %}w2 {% else %}w3 {% endif %}"
    "{{ m['content'] }} w4 "
    "{% endfor %}"
    "{% if add_generation_prompt %}w3{% if enable_thinking %} w5{% endif %}{% endif %}"
)


@dataclass
class TinyPair:
    target: Path  # no chat template
    chat_target: Path  # same weights, with TEMPLATE
    draft: Path
    other_draft: Path  # a drafter for a different target (hidden size)


def make_tiny_pair(root: Path) -> TinyPair:
    tcfg = target_config(vocab=VOCAB)
    model = make_target(tcfg, seed=0)
    write_target(root / "target", tcfg, model, make_tokenizer(VOCAB))
    tok = make_tokenizer(VOCAB)
    tok._tokenizer.chat_template = TEMPLATE
    write_target(root / "chat-target", tcfg, model, tok)
    dcfg = draft_config(tcfg, block_size=6)
    write_zlab_draft(root / "draft", dcfg, random_draft_weights(dcfg, seed=1))
    ocfg = draft_config(target_config(vocab=VOCAB, hidden=32))
    write_zlab_draft(root / "other-draft", ocfg, random_draft_weights(ocfg, seed=2))
    mx.clear_cache()
    return TinyPair(root / "target", root / "chat-target", root / "draft", root / "other-draft")


# -- a terminal, just enough of one ------------------------------------------------
_ESCAPE = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z@])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Za-z0-9]|\x1b[78=>]")


def screen_lines(raw: str) -> list[str]:
    """Replay terminal output (cursor moves, line erases, CR/LF) onto an
    unbounded screen and return its lines: what the user ends up seeing."""
    lines = [""]
    row = col = 0

    def put(ch: str) -> None:
        nonlocal col
        line = lines[row].ljust(col)
        lines[row] = line[:col] + ch + line[col + 1 :]
        col += 1

    pos = 0
    while pos < len(raw):
        m = _ESCAPE.match(raw, pos)
        if m:
            pos = m.end()
            params, final = m.group(1), m.group(2)
            if final is None:
                continue
            n = int(params) if params and params.isdigit() else None
            if final == "A":
                row = max(0, row - (n or 1))
            elif final == "B":
                row += n or 1
                while row >= len(lines):
                    lines.append("")
            elif final == "C":
                col += n or 1
            elif final == "D":
                col = max(0, col - (n or 1))
            elif final == "G":
                col = (n or 1) - 1
            elif final == "K":
                if n == 2:
                    lines[row] = ""
                elif n == 1:
                    lines[row] = " " * col + lines[row][col:]
                else:
                    lines[row] = lines[row][:col]
            continue
        ch = raw[pos]
        pos += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            while row >= len(lines):
                lines.append("")
        elif ch == "\b":
            col = max(0, col - 1)
        elif ch == "\x07" or ch < " ":
            continue
        else:
            put(ch)
    return [line.rstrip() for line in lines]
