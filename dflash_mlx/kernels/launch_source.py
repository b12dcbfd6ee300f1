"""Kernel sources as handed to MLX: compacted, since MLX's CUDA backend hashes a
custom kernel's whole source at every launch (``CustomKernel::eval_gpu``)."""

from __future__ import annotations

import re


def compact(text: str) -> str:
    """Kernel source without comments, indentation or blank lines (``//`` in a string stays)."""
    lines = []
    for line in text.splitlines():
        cut = line.find("//")
        while cut >= 0 and line.count('"', 0, cut) % 2:  # (inside a string: look further)
            cut = line.find("//", cut + 2)
        line = (line if cut < 0 else line[:cut]).strip()
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


def definitions(header: str) -> list[tuple[str | None, str]]:
    """A compact header's top-level items as (the name it defines, or None for an
    item always kept, its text)."""
    items, lines, depth = [], [], 0
    for line in header.splitlines(keepends=True):
        lines.append(line)
        depth += line.count("{") - line.count("}")
        if depth > 0 or line.rstrip("\n").endswith("\\"):
            continue
        text = "".join(lines)
        lines = []
        macro = re.match(r"#define\s+(\w+)", text)
        typedef = re.match(r"typedef\b[^;]*?(\w+)\s*;", text)
        signature = re.sub(r"^template\s*<[^<>]*>\s*", "", text)
        function = re.search(r"(\w+)\s*(?:<[^<>()]*>)?\s*\(", signature) if not text.startswith("#") else None
        name = macro.group(1) if macro else typedef.group(1) if typedef else function.group(1) if function else None
        items.append((name, text))
    if lines:
        items.append((None, "".join(lines)))
    return items


def used_header(header: str, body: str) -> str:
    """The items of ``header`` that ``body`` calls, directly or through kept items, in order."""
    items = definitions(header)
    keep = [name is None for name, _ in items]
    seen = body + "".join(text for (name, text), k in zip(items, keep) if k)
    grew = True
    while grew:
        grew = False
        for i, (name, text) in enumerate(items):
            if not keep[i] and re.search(rf"\b{name}\b", seen):
                keep[i], grew, seen = True, True, seen + text
    return "".join(text for (_, text), k in zip(items, keep) if k)


def compacting(factory, backend: str):
    """``factory`` handed compact sources and, on CUDA, only the header items each source uses."""

    def build(*, source: str, header: str = "", **kw):
        source, header = compact(source), compact(header)
        if backend == "cuda":
            header = used_header(header, source)
        return factory(source=source, header=header, **kw)

    return build
