"""Which of our kernels this machine uses, decided by measuring them.

A kernel that passed its self-check is used for a case (a class of shapes)
only where a first-use measurement on this machine found it faster than
MLX's own path; a case never measured runs MLX's. Decisions are kept per
machine (backend, device, MLX version) in ``$DFLASH_MLX_HOME/decisions/``,
so a machine measures each case once. ``DFLASH_MLX_KERNELS`` overrides the
policy: ``measure`` (the default), ``exact`` (``measure``, with exactness
first on every backend), ``on`` (every checked kernel, unmeasured) or ``off``
(MLX's own ops only).

An exact verify kernel (a verify row bit for bit the one-row step's, so that
greedy DFlash equals plain decoding) is the exception: on Metal, where it
follows MLX's own one-row kernels, exactness comes first and it serves
wherever it passed its checks, measured or not (``serves_exact``), and a
fused kernel that rounds otherwise than MLX's ops does not serve a verify.

A strategy whose default is not MLX's own path (the delta-net layers'
rollback, targets/recurrent.py) is kept here alike, ours against the
other; it reads ``measured`` and keeps its default where nothing was
measured or the policy is ``on`` or ``off``.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from ..device import backend, device_name
from ..home import home, remembers, write_json

FORMAT = "dflash-mlx kernel decisions"
VERSION = 1
POLICIES = ("measure", "exact", "on", "off")
# Backends where an exact verify kernel serves wherever it is exact: on CUDA MLX's
# one-row step often runs a library (cuBLAS, cuDNN) whose order no kernel can follow.
# Policy ``exact`` is ``measure`` with every backend among them.
EXACT_FIRST = ("metal",)
# The exact verify kernels' decisions, each kernel module adding its own: where
# exactness comes first they serve whatever their time (serves_exact).
EXACT_KERNELS: set[str] = set()
# Ours must beat MLX's by this fraction: a tie keeps MLX's own path.
MARGIN = 0.03
ROUNDS, CALLS = 7, 8


@dataclass(frozen=True)
class Decision:
    kernel: str
    case: str
    ours: float  # seconds per call
    mlx: float

    @property
    def faster(self) -> bool:
        return self.ours <= self.mlx * (1 - MARGIN)


def machine() -> dict[str, str]:
    """What a decision holds for: the backend, the device and MLX's version."""
    return {"backend": backend(), "device": device_name(), "mlx": mx.__version__}


def seconds_per_call(ours: Callable[[], object], theirs: Callable[[], object]) -> tuple[float, float]:
    """Median seconds per call of each, in alternating rounds of CALLS queued
    calls (so drift and clocks hit both alike), after one untimed call each."""
    mx.eval(ours())
    mx.eval(theirs())
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(ROUNDS):
        for fn, kept in zip((ours, theirs), times):
            tic = time.perf_counter()
            mx.eval([fn() for _ in range(CALLS)])
            kept.append((time.perf_counter() - tic) / CALLS)
    return statistics.median(times[0]), statistics.median(times[1])


class Decisions:
    """One machine's decisions, read from and written to ``path`` (None: kept in memory)."""

    def __init__(self, path: Path | None, policy: str = "measure", on: dict[str, str] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"DFLASH_MLX_KERNELS={policy!r} is not a policy; use one of: {', '.join(POLICIES)}.")
        self.exact_everywhere = policy == "exact"
        self.path, self.policy = path, "measure" if policy == "exact" else policy
        self.machine = on if on is not None else machine()
        self.known: dict[tuple[str, str], Decision] = {}
        if path is not None:
            self.known = self._read(path)

    def uses(self, kernel: str, case: str) -> bool:
        """Whether ``kernel`` serves ``case`` here; never measures (safe inside a trace)."""
        if self.policy != "measure":
            return self.policy == "on"
        found = self.known.get((kernel, case))
        return found is not None and found.faster

    def exact_first(self, where: str) -> bool:
        """Whether on backend ``where`` a verify's rounding must be the one-row
        step's wherever a kernel can make it so (EXACT_FIRST, policy ``measure``)."""
        return self.policy == "measure" and (self.exact_everywhere or where in EXACT_FIRST)

    def serves_exact(self, kernel: str, case: str, where: str) -> bool:
        """``uses`` for an exact verify kernel on backend ``where``: exactness
        first where ``where`` is in EXACT_FIRST, unless the policy is ``off``."""
        return self.exact_first(where) or self.uses(kernel, case)

    def measured(self, kernel: str, case: str) -> Decision | None:
        """This case's measurement under ``measure``; None where never measured
        or a policy overrides (a strategy then keeps its own default)."""
        return self.known.get((kernel, case)) if self.policy == "measure" else None

    def needs(self, kernel: str, case: str) -> bool:
        """Whether ``decide`` would measure this case."""
        return self.policy == "measure" and (kernel, case) not in self.known

    def decide(self, kernel: str, case: str, ours: Callable[[], object], theirs: Callable[[], object]) -> bool:
        """``uses``, measuring ``ours`` against MLX's ``theirs`` first if this
        case was never measured here. Call it outside compiled traces."""
        if self.needs(kernel, case):
            self.record(Decision(kernel, case, *seconds_per_call(ours, theirs)))
        return self.uses(kernel, case)

    def record(self, decision: Decision) -> None:
        self.known[(decision.kernel, decision.case)] = decision
        if self.path is not None:
            entries = [asdict(d) for d in self.known.values()]
            write_json(self.path, {"format": FORMAT, "version": VERSION, "machine": self.machine, "decisions": entries})

    def all(self) -> list[Decision]:
        """Every decision, in the order first made."""
        return list(self.known.values())

    def _read(self, path: Path) -> dict[tuple[str, str], Decision]:
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            return _ignored(path, f"it is not readable JSON ({type(e).__name__})")
        if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
            return _ignored(path, "it is not a decisions file of this version")
        if state.get("machine") != self.machine:
            return _ignored(path, f"it was measured on another machine or MLX ({state.get('machine')})")
        try:
            decisions = [Decision(**d) for d in state["decisions"]]
            if not all(isinstance(d.ours, float) and isinstance(d.mlx, float) for d in decisions):
                raise TypeError("times must be numbers")
        except (KeyError, TypeError) as e:
            return _ignored(path, f"an entry is malformed ({e})")
        return {(d.kernel, d.case): d for d in decisions}


def _ignored(path: Path, why: str) -> dict:
    warnings.warn(
        f"dflash_mlx: ignoring the kernel decisions in {path}: {why}; they will be measured again.",
        RuntimeWarning,
        stacklevel=4,
    )
    return {}


_current: Decisions | None = None


def current() -> Decisions:
    """This process's decisions, read once from this machine's file."""
    global _current
    if _current is None:
        policy = os.environ.get("DFLASH_MLX_KERNELS", "measure").strip().lower() or "measure"
        here = machine()
        key = hashlib.sha256(json.dumps(here, sort_keys=True).encode()).hexdigest()[:16]
        path = home() / "decisions" / f"{here['backend']}-{key}.json" if remembers() else None
        _current = Decisions(path, policy, here)
    return _current


def reset() -> None:
    """Read the file and the policy again at the next ``current()`` (tests, doctor)."""
    global _current
    _current = None
