"""Kernel self-checks that passed on this machine, remembered so that later
processes skip them.

A variant's self-check (serving.check_once) that passes is kept in
``$DFLASH_MLX_HOME/checks/``, one file a machine (backend, device, MLX
version, OS); a later process trusts it for the same kernel and check key
and builds the kernel object as a pass leaves it (MLX compiles a variant at
its first launch) without running the check's cases. A kernel is known by
its name and a hash of the sources and headers its object is built from
(names and VERSIONs included) and of the Python files that build, launch
and check it, so an edit to any of them checks again.

Only passes are kept: a failure may be transient, so the next process checks
again, and a check that fails forgets the pass kept for it. A file that is
damaged or from another machine is ignored with one warning. A stand-in
kernel whose builder takes no ``factory`` (tests) is never remembered.
``DFLASH_MLX_AUTO_MEMORY=off`` keeps nothing; ``dflash-mlx doctor --recheck``
forgets this machine's passes and checks every variant again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import platform
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType

from ..home import home, remembers, write_json
from . import decisions

FORMAT = "dflash-mlx kernel checks"
VERSION = 1
PACKAGE = __name__.split(".")[0]  # whose Python files a kernel's hash reads


def machine() -> dict[str, str]:
    """decisions.machine(), the OS release (an OS update brings another Metal
    compiler, which may round a kernel otherwise) and mlx-lm's version (some
    checks compare against its kernels)."""
    return {**decisions.machine(), "os": platform.platform(), "mlx-lm": _version("mlx-lm")}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


class Running:
    """The check serving.check_once runs now: its kernel's name, its key, the
    module defining it; ``recalled`` once its pass came from the store."""

    def __init__(self, kernel: str, key: str, module: str):
        self.kernel, self.key, self.module = kernel, key, module
        self.recalled = False


_running: ContextVar[Running | None] = ContextVar("dflash_mlx_running_check", default=None)


@contextmanager
def running(kernel: str | None, key, check: Callable) -> Iterator[Running | None]:
    """Name the check ``check()`` runs inside this block for ``checked`` (no
    ``kernel``: nothing is remembered)."""
    if kernel is None:
        yield None
        return
    now = Running(kernel, repr(key), getattr(check, "__module__", "") or "")
    token = _running.set(now)
    try:
        yield now
    finally:
        _running.reset(token)


def checked(where: str, kernels: tuple[dict, dict], check: Callable, save: Callable, restore: Callable):
    """``check()``, the self-check running now on backend ``where``, or its
    pass remembered on this machine: ``restore(fields)`` (None where the
    fields no longer fit: checked again), the kernel object then built into
    ``made`` as a pass leaves it. ``kernels``: (made, builders). A pass is
    kept as ``save(result)``; a failure forgets it."""
    made, builders = kernels
    now, store = _running.get(), current()
    source = fingerprint(builders.get(where), where, now.module) if now and store.path else None
    if source is not None:
        fields = store.get(now.kernel, source, now.key)
        result = restore(fields) if fields is not None else None
        if result is not None:
            try:
                if where not in made:
                    made[where] = builders[where](where)
            except Exception:  # (the check names a build error)
                pass
            else:
                now.recalled = True
                return result
    result = check()
    if source is not None:
        store.keep(now.kernel, source, now.key, save(result) if result.ok else None)
    return result


_fingerprints: dict[tuple, str | None] = {}


def fingerprint(builder, where: str, check_module: str) -> str | None:
    """A hash of the sources and headers ``builder(where)`` builds its kernels
    from (its factory's every argument) and of the files of the builder's
    module, the check's module and ours they import; None where the builder
    takes no ``factory`` or builds nothing (a stand-in)."""
    key = (builder, where, check_module)
    if key not in _fingerprints:
        made = []
        try:
            builder(where, factory=lambda **kw: made.append(kw) or (lambda **launch: None))
        except Exception:
            made = []
        _fingerprints[key] = _hashed(made, getattr(builder, "__module__", ""), check_module) if made else None
    return _fingerprints[key]


def _hashed(made: list[dict], *module_names: str) -> str:
    digest = hashlib.sha256()
    for kw in made:
        digest.update(json.dumps(kw, sort_keys=True, default=str).encode())
    for path in sorted(source_files(*module_names)):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:32]


def source_files(*module_names: str) -> set[Path]:
    """The files of these modules and of every module of ours they import, directly or not."""
    modules: set[ModuleType] = set()
    waiting = [sys.modules.get(name) for name in module_names]
    while waiting:
        module = waiting.pop()
        if module is None or module in modules or module.__name__.split(".")[0] != PACKAGE:
            continue
        modules.add(module)
        for value in vars(module).values():
            waiting.append(value if isinstance(value, ModuleType) else sys.modules.get(_module_name(value)))
    return {Path(m.__file__) for m in modules if getattr(m, "__file__", None)}


def _module_name(value) -> str:
    name = getattr(value, "__module__", None)
    return name if isinstance(name, str) else ""


def fields_of(result) -> dict:
    """A result dataclass's fields, as kept."""
    return dataclasses.asdict(result)


def rebuilt(cls, fields: dict):
    """``cls(**fields)`` where ``fields`` are exactly its fields, each of its
    annotated type (str, int, float, bool); else None."""
    own = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(cls)}
    if set(fields) != set(own) or any(type(fields[n]).__name__ != own[n] for n in own):
        return None
    return cls(**fields)


_recalled: list = []  # (the results themselves: an id is never reused while they are kept)


def note(result, now: Running | None) -> None:
    """Mark ``result`` as recalled where ``now``'s pass came from the store."""
    if now is not None and now.recalled:
        _recalled.append(result)


def recalled(result) -> bool:
    """Whether ``result`` is a pass remembered from an earlier process, not checked in this one."""
    return any(r is result for r in _recalled)


def replaced(result, **changes):
    """``dataclasses.replace(result, **changes)``, recalled if ``result`` was."""
    copy = dataclasses.replace(result, **changes)
    if recalled(result):
        _recalled.append(copy)
    return copy


class PassedChecks:
    """One machine's remembered passes, read from and written to ``path`` (None: none kept)."""

    def __init__(self, path: Path | None, on: dict[str, str]):
        self.path, self.machine = path, on
        # (kernel, check key) -> (its fingerprint, the result's fields)
        self.passed: dict[tuple[str, str], tuple[str, dict]] = self._read(path) if path is not None else {}

    def get(self, kernel: str, source: str, key: str) -> dict | None:
        found = self.passed.get((kernel, key))
        return found[1] if found is not None and found[0] == source else None

    def keep(self, kernel: str, source: str, key: str, fields: dict | None) -> None:
        """Remember a pass's ``fields`` (None: forget the entry, a failure), over
        what other processes kept in the file since it was read (unlocked: two
        writing at once may lose an entry, which is then checked again)."""
        if self.path is None:
            return
        known = self._read(self.path, quiet=True)
        if fields is None:
            if known.pop((kernel, key), None) is None:
                self.passed = known
                return
        else:
            known[(kernel, key)] = (source, fields)
        self.passed = known
        entries = [{"kernel": k, "key": c, "source": s, "result": f} for (k, c), (s, f) in known.items()]
        write_json(self.path, {"format": FORMAT, "version": VERSION, "machine": self.machine, "passed": entries})

    def _read(self, path: Path, quiet: bool = False) -> dict:
        def ignored(why: str) -> dict:
            if not quiet:
                warnings.warn(
                    f"dflash_mlx: ignoring the kernel checks remembered in {path}: {why}; they will be checked again.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return {}

        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            return ignored(f"it is not readable JSON ({type(e).__name__})")
        if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
            return ignored("it is not a kernel checks file of this version")
        if state.get("machine") != self.machine:
            return ignored(f"it was checked on another machine, OS or MLX ({state.get('machine')})")
        entries = state.get("passed")
        names = ("kernel", "key", "source")
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and all(isinstance(e.get(n), str) for n in names) and isinstance(e.get("result"), dict)
            for e in entries
        ):
            return ignored("an entry is malformed")
        return {(e["kernel"], e["key"]): (e["source"], e["result"]) for e in entries}


def path_here() -> Path | None:
    """This machine's file (None where nothing is remembered: DFLASH_MLX_AUTO_MEMORY=off)."""
    if not remembers():
        return None
    here = machine()
    key = hashlib.sha256(json.dumps(here, sort_keys=True).encode()).hexdigest()[:16]
    return home() / "checks" / f"{here['backend']}-{key}.json"


_current: PassedChecks | None = None


def current() -> PassedChecks:
    """This process's remembered passes, read once from this machine's file."""
    global _current
    if _current is None:
        _current = PassedChecks(path_here(), machine())
    return _current


def reset() -> None:
    """Read the file again at the next ``current()`` (tests, a new process)."""
    global _current
    _current = None
    _fingerprints.clear()
    _recalled.clear()


def forget() -> Path | None:
    """Forget this machine's remembered passes, so that every check runs again
    (``dflash-mlx doctor --recheck``); the file removed, if any."""
    path = path_here()
    reset()
    if path is None or not path.exists():
        return None
    path.unlink(missing_ok=True)
    return path
