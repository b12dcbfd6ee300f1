"""The built-in pair's text: the running Python's standard library sources.

Every machine with Python has it offline. Files are split into training and
held-out sets by a hash of their path relative to the stdlib root, so the split
is the same on every machine and Python version (a file held out on 3.11 is
held out on 3.12). Used by scripts/build_builtin.py and benchmarks/bench_builtin.py.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from pathlib import Path

MAX_FILE_BYTES = 300_000  # skips generated tables (unicode data, pydoc topics)
HELD_OUT_PERCENT = 8


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def stdlib_files(held_out: bool = False) -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's .py files, sorted by path."""
    root = stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel or p.stat().st_size > MAX_FILE_BYTES:
            continue
        if is_held_out(rel) != held_out:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def python_files(root: Path, limit: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(path, text) of the .py files under ``root`` (any directory: an
    installed package tree, say), at most ``limit`` of them picked at random.
    Only for the drafter's training prompts: text the target never saw, which
    the target answers the way it answers a user's new code."""
    paths = [p for p in sorted(Path(root).rglob("*.py")) if p.is_file() and 200 < p.stat().st_size <= MAX_FILE_BYTES]
    if limit is not None and len(paths) > limit:
        paths = sorted(random.Random(seed).sample(paths, limit))
    out = []
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((p.as_posix(), text))
    return out


def functions(text: str) -> list[tuple[str, str, str]]:
    """(signature line, first docstring paragraph, source) of documented
    top-level and method functions in a module's text."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno is None:
                continue
            src_lines = lines[node.lineno - 1 : node.end_lineno]
            indent = len(src_lines[0]) - len(src_lines[0].lstrip())
            src = "\n".join(l[indent:] for l in src_lines)
            if len(src) > 3000:
                continue
            summary = doc.strip().split("\n\n")[0].strip()
            out.append((src_lines[0].strip().rstrip(":"), summary, src))
    return out


def chat_request(signature: str, summary: str) -> str:
    return f"Write the Python function `{signature}`.\n{summary}"


def code_prompts(files: list[tuple[str, str]], n: int, seed: int, min_lines: int = 4, max_lines: int = 16) -> list[str]:
    """``n`` code prefixes: a run of whole lines ending at a line start inside
    a file, for the model to continue."""
    rng = random.Random(seed)
    usable = [t for _, t in files if t.count("\n") > max_lines + 8]
    out = []
    while len(out) < n:
        lines = rng.choice(usable).splitlines(keepends=True)
        end = rng.randrange(max_lines, len(lines) - 4)
        start = end - rng.randint(min_lines, max_lines)
        prefix = "".join(lines[start:end])
        if prefix.strip() and len(prefix) < 1200:
            out.append(prefix)
    return out


def mixed_prompts(files: list[tuple[str, str]], n: int, seed: int) -> list[str]:
    """``n`` prefixes the target cannot have memorized: runs of 2-6 lines from
    2-3 different files, joined, the last one cut inside a line. The target's
    answers to these look like its answers to unseen code, which is what the
    drafter must learn (verbatim continuations of training files do not)."""
    rng = random.Random(seed)
    usable = [t for _, t in files if t.count("\n") > 24]
    out = []
    while len(out) < n:
        parts = []
        for _ in range(rng.randint(2, 3)):
            lines = rng.choice(usable).splitlines(keepends=True)
            start = rng.randrange(0, len(lines) - 8)
            parts.append("".join(lines[start : start + rng.randint(2, 6)]))
        text = "".join(parts)
        text = text[: len(text) - rng.randint(0, min(20, len(parts[-1]) - 1))]
        if text.strip() and len(text) < 1200:
            out.append(text)
    return out
