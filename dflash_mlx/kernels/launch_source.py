"""What a custom kernel's source looks like when it is handed to MLX.

MLX's CUDA backend names a custom kernel's compiled module by a hash of its
whole generated source (header, parameters, body), worked out in
``CustomKernel::eval_gpu``, so at every launch: 0.28 us a kilobyte on an
H100 (benchmarks/launch_cost.py, BENCHMARKS.md session 18), paid ~100 times
a cycle of a small pair, whose cycle is bound by its launches. So every
kernel's factory is wrapped (``compacting``): sources lose their comments,
indentation and blank lines, and on CUDA a header keeps only the items its
source calls. The kernels' Python keeps the comments; the device never
needed them.
"""

from __future__ import annotations

import re

COMPACT_SOURCES = True  # (benchmarks turn it off to measure what it saves)


def compact(text: str) -> str:
    """Kernel source without comments, indentation or blank lines: what the
    backend compiles is the same, and MLX's CUDA backend hashes a custom
    kernel's whole source at every launch (its module name, in
    CustomKernel::eval_gpu), so the source's length is host time spent on
    every launch of a cycle bound by its launches (BENCHMARKS.md, session
    18). A ``//`` inside a string literal stays."""
    if not COMPACT_SOURCES:
        return text
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
    """A compact header's top-level items as (the name it defines, its text):
    a ``#define`` (its continuation lines with it), a typedef, a function or
    a template's declaration or definition (to its closing brace). None: an
    item whose name is not read (an ``#include``, anything else), kept."""
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
    """What of ``header`` a kernel's ``body`` calls, directly or through
    what it keeps (every item whose name is unread stays): MLX hashes the
    header with the body at every launch (compact), and one header serves
    several kernels. Items keep their order."""
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
    """``factory`` handed compact sources and, on CUDA, only the part of the
    header each source uses (``compact``, ``used_header``; NVRTC checks that
    on any machine, scripts/check_cuda_kernels.py, where nothing here
    compiles Metal's)."""

    def build(*, source: str, header: str = "", **kw):
        source, header = compact(source), compact(header)
        if COMPACT_SOURCES and backend == "cuda":
            header = used_header(header, source)
        return factory(source=source, header=header, **kw)

    return build
