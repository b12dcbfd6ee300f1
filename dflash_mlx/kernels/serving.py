"""The rules every custom kernel follows before it serves: its self-check runs
once per variant (a failure warns once and keeps MLX's path; a pass is
remembered on this machine for later processes: passed_checks.py), and a verify
product serves a layer's shape only where its rows through that layer's own
weight equal the one-row products bit for bit, and (but on Metal, where
exactness comes first: decisions.serves_exact) it measured faster here at
the rows it serves."""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from . import decisions, passed_checks

MEASURED_ROWS = 16  # a verify of a block of 16
# A verify product is timed at a block's most rows and at a draft tree's: a
# verify of r rows takes the decision of the first class of at least r rows.
ROW_CLASSES = (MEASURED_ROWS, 32)


# A kernel and MLX's path are timed over copies of what they read (a layer's
# weights, a verify's keys and values), up to TIMED_BYTES together (more than
# a GPU's last-level cache holds), every call the next copy: each call reads
# from memory, as a forward's layers do, not what an earlier call left cached.
TIMED_BYTES = 256 << 20
MOST_COPIES = 256


def row_class(rows: int) -> int:
    return next((r for r in ROW_CLASSES if rows <= r), ROW_CLASSES[-1])


def copies_to_time(nbytes: int) -> int:
    """How many copies of inputs of ``nbytes`` together take TIMED_BYTES (at most MOST_COPIES)."""
    return min(MOST_COPIES, -(-TIMED_BYTES // max(1, nbytes)))


def _copy(a: mx.array) -> mx.array:
    return a + mx.zeros((), a.dtype)


def weight_copies(layer: nn.Module) -> list[nn.Module]:
    """``layer`` and copies of it, each holding its own arrays (copies_to_time);
    a layer of arrays alone (a copy's sub-modules would be the layer's own)."""
    if layer.children():
        raise ValueError(f"weight_copies copies a layer of arrays alone; {type(layer).__name__} holds modules.")
    layers = [layer]
    for _ in range(copies_to_time(sum(a.nbytes for _, a in tree_flatten(layer.parameters()))) - 1):
        clone = copy.copy(layer)  # (a module is a dict: a new one holding the same arrays, then its own)
        clone.update(tree_map(_copy, layer.parameters()))
        mx.eval(clone.parameters())
        layers.append(clone)
    return layers


def array_copies(*arrays: mx.array) -> list[tuple[mx.array, ...]]:
    """``arrays`` and copies of them (copies_to_time)."""
    sets = [arrays] + [tuple(map(_copy, arrays)) for _ in range(copies_to_time(sum(a.nbytes for a in arrays)) - 1)]
    mx.eval(sets)
    return sets


def timed_in_turn(ours: Callable, theirs: Callable, inputs: list) -> tuple[Callable, Callable]:
    """(ours, theirs) as decisions.decide times them: ``ours(item)`` and
    ``theirs(item)`` over ``inputs`` in one turn shared by both, a call the next
    item, so that neither side reads what the other just left in a cache."""
    turns = itertools.cycle(inputs)
    return lambda: ours(next(turns)), lambda: theirs(next(turns))


def check_once(
    checks: dict, key, check: Callable[[], object], warning: Callable[[object], str], kernel: str | None = None
):
    """``checks[key]``, running ``check()`` the first time (where ``kernel``
    names the kernel, a pass remembered on this machine stands for it:
    passed_checks.py); a failed result (``.ok`` false) warns once with
    ``warning(result)``."""
    result = checks.get(key)
    if result is None:
        with passed_checks.running(kernel, key, check) as now:
            result = check()
        passed_checks.note(result, now)
        checks[key] = result
        if not result.ok:
            warnings.warn(warning(result), RuntimeWarning, stacklevel=4)
    return result


def passed(checks: dict, key) -> bool:
    """Whether ``key``'s variant was checked and passed; never checks."""
    result = checks.get(key)
    return result is not None and result.ok


class CheckedVariants:
    """A verify product's variants checked on this machine (``checks``) and the
    layer shapes it serves (``shapes``); ``what`` names it in the warning,
    ``instead`` what runs where a variant fails."""

    def __init__(self, what: str, instead: str, decision: str):
        self.what, self.instead = what, instead
        self.checks: dict = {}
        self.shapes = LayerShapes(decision)

    def clear(self) -> None:
        self.checks.clear()
        self.shapes.clear()

    def checked(self, where: str, variant, check: Callable[[], object]):
        """The variant's self-check on backend ``where``, run once (warning once where it fails)."""
        return check_once(
            self.checks,
            (where, variant),
            check,
            lambda r: (
                f"dflash_mlx: the {r.case} {self.what} failed its self-check ({r.detail}); "
                f"using {self.instead} for it instead."
            ),
            kernel=self.what,
        )

    def serves(self, where: str, variant, n: int, rows: int = MEASURED_ROWS) -> bool:
        """Whether the variant passed its check and serves ``rows`` rows through layers of ``n`` outputs here."""
        return passed(self.checks, (where, variant)) and self.shapes.serves((where, variant, n), rows)


class LayerShapes:
    """Which (backend, variant, N) an exact verify product serves: named by
    ``decision`` in this machine's decisions."""

    def __init__(self, decision: str):
        self.decision = decision
        self.exact: dict[tuple, bool] = {}
        decisions.EXACT_KERNELS.add(decision)

    def clear(self) -> None:
        self.exact.clear()

    def case(self, variant, n: int, rows: int) -> str:
        return f"{variant.case} N={n} rows={rows}"

    def prepare(self, key: tuple, layer: nn.Module, runs: tuple[Callable, Callable, Callable], dtype) -> None:
        """Check the kernel through ``layer`` against MLX's one-row products at
        the layer's own shape, then time it against MLX's product at each of
        ROW_CLASSES once a machine. ``runs``: (MLX's product, the kernel's, the
        one-row products), each ``run(layer, x)``."""
        variant, n = key[1], key[2]
        theirs, ours, one_row = runs
        for rows in ROW_CLASSES:  # each class's own tile, through the layer's own weight
            if (key, rows) not in self.exact:
                x = mx.random.normal((rows, variant.k), key=mx.random.key(variant.k + rows)).astype(dtype)
                got = ours(layer, x)
                self.exact[(key, rows)] = got is not None and bool(mx.array_equal(got, one_row(layer, x)))
        cases = {rows: self.case(variant, n, rows) for rows in ROW_CLASSES if self.exact[(key, rows)]}
        needed = [rows for rows, case in cases.items() if decisions.current().needs(self.decision, case)]
        if not needed:
            return
        layers = weight_copies(layer)
        for rows in needed:
            x = mx.random.normal((rows, variant.k)).astype(dtype)
            timed = timed_in_turn(lambda m, x=x: ours(m, x), lambda m, x=x: theirs(m, x), layers)
            decisions.current().decide(self.decision, cases[rows], *timed)
        del layers
        mx.clear_cache()  # (the copies' memory back, not kept in MLX's buffer cache)

    def serves(self, key: tuple, rows: int = MEASURED_ROWS) -> bool:
        """Whether the shape checked out exact at ``rows``' row class and
        serves it here (decisions.serves_exact); never measures."""
        rows = row_class(rows)
        return self.exact.get((key, rows), False) and decisions.current().serves_exact(
            self.decision, self.case(key[1], key[2], rows), key[0]
        )


def bit_difference(got: mx.array, want: mx.array) -> str | None:
    """None where ``got`` equals ``want`` bit for bit; else what differs, in a few words."""
    if got.shape != want.shape:
        return f"output shape {got.shape} != {want.shape}"
    if mx.array_equal(got, want, equal_nan=True).item():
        return None
    differ = (got != want).sum().item()
    worst = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    return f"{differ} of {got.size} outputs differ at {got.shape[0]} rows, by up to {worst:.1e}"


def failure(e: Exception) -> str:
    """A build or launch error as a check's detail."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {msg[:200]}"


def first_exact(where: str, tries, kernels: tuple, pairs: Callable, result: Callable, *, passed: str):
    """A kernel's self-check on backend ``where``: for each of ``tries`` in turn
    (the roundings its backend may take, e.g. multiply-add forms), the kernel
    built once from ``kernels`` (made, builders: a dict of built ones and the
    backend's builder), and ``pairs(kernel, tried)`` yields (got, want, at):
    the kernel's output and MLX's one-row output, equal bit for bit, ``at``
    put before a difference. The first try that matches gives
    ``result(True, passed, tried)``; else the last try's failure,
    ``result(False, detail, tried)``, or ``result(False, error)`` where the
    build or a launch failed (no try compared). Inside serving.check_once a
    pass remembered on this machine stands for the tries (passed_checks.py)."""
    made, builders = kernels
    chosen = []

    def check():
        for tried in tries:
            try:
                if where not in made:
                    made[where] = builders[where](where)
                for got, want, at in pairs(made[where], tried):
                    detail = bit_difference(got, want)
                    if detail is not None:
                        break
                else:
                    chosen.append(tried)
                    return result(True, passed, tried)
                outcome = result(False, at + detail, tried)
            except Exception as e:  # a build or launch error: the kernel is not used
                outcome = result(False, failure(e))
        return outcome

    def restore(fields: dict):
        tried = fields.get("tried")  # (one of tries still, of its type: True is not 1)
        fits = any(type(t) is type(tried) and t == tried for t in tries)
        return result(True, passed, tried) if fits else None

    return passed_checks.checked(where, kernels, check, lambda r: {"tried": chosen[-1]}, restore)


def checked_here(checks: dict, where: str, report=None) -> list:
    """The results checked on backend ``where`` so far (keys lead with it), each told to ``report``."""
    results = [r for (w, *_), r in checks.items() if w == where]
    if report is not None:
        for r in results:
            report(r)
    return results
