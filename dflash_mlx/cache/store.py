"""Prompt caches kept on disk across requests and restarts, found by the
longest common token prefix.

Entries are prompt-cache files (files.py) in a folder named by the pair's
fingerprint and KV settings under the store's directory, so a new process
with the same pair finds them and another pair never reads them. The
directory as a whole is bounded in bytes; the least recently used file
(by modification time, touched on each use) goes first. An entry a newer
one extends is removed when the newer one is written. A damaged or cut
file is skipped with a warning and removed; one made for another pair or
other settings is skipped with a warning and left alone. Writes run on a
thread of their own from arrays copied when the cache is handed in, and
a file appears under its name only once whole. The writer yields to
decoding: before each tensor it waits until no generation in this process
has decoded for ``quiet`` seconds (decoding.py's gate; the quiet period spans
the gap between a reply and the next request), so a request shares the
device, the host's cores and the GIL with at most the tensor under way when
it began; a file waits ``patience`` seconds at most, so a server that is
never idle still writes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..atomic_dir import remove_dead_leftovers
from ..kv.quantized import QuantizedBufferKVCache
from ..targets.recurrent import DeltaCache
from . import files
from .decoding import decoding
from .prompt import PromptCache, common_prefix

log = logging.getLogger("dflash_mlx.cache")


@dataclass
class Entry:
    path: Path
    tokens: np.ndarray
    size: int
    earliest: int = 0  # the shortest prefix it serves (a sliding layer's window dropped the positions before)


def _folder(identity: dict[str, str], kv: tuple) -> str:
    bits, group, start = kv
    settings = "kv-full" if bits is None else f"kv{bits}-g{group}-from{start}"
    return f"{identity['fingerprint'][:20]}-{settings}"


def _tracked(root: Path) -> list[tuple[float, int, Path]]:
    """(modification time, size, path) of every entry file under ``root``."""
    found = []
    for folder in root.iterdir() if root.is_dir() else []:
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        for p in folder.glob("*.safetensors"):
            if p.name.startswith("."):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            found.append((st.st_mtime, st.st_size, p))
    return found


class PrefixStore:
    """``find`` the entry sharing the longest prefix with a prompt, ``load``
    it into a fresh cache, ``save`` a cache once a generation is over.
    ``new_cache`` makes the empty caches the pair and settings call for;
    entries shorter than ``min_tokens`` are not written, nor used; at most
    ``pending`` copies wait for the writer besides the one being written;
    one being written waits for decoding to pause (``quiet`` seconds)
    ``patience`` seconds at most, then goes on regardless."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        new_cache: Callable[[], PromptCache],
        *,
        min_tokens: int = 256,
        pending: int = 1,
        patience: float = 20.0,
        quiet: float = 0.25,
    ):
        sample = new_cache()
        if sample.max_kv_size is not None:
            raise ValueError(
                "a prefix cache on disk cannot hold bounded caches (max_kv_size); leave out one of the two."
            )
        if max_bytes <= 0:
            raise ValueError(f"the prefix cache's size must be more than 0 (--prefix-cache-gb), not {max_bytes} bytes.")
        self.new_cache, self.max_bytes, self.min_tokens = new_cache, max_bytes, max(1, min_tokens)
        self.patience, self.quiet = patience, quiet  # patience bounded: a server never idle still writes
        self.hurry = 0  # flush or close waiting: the writer stops yielding to decoding
        self.identity = files.pair_identity(sample.model, sample.draft_model)
        self.kv = files.kv_settings(sample)
        # a recurrent state cut back must be re-read from the start: only entries a prompt extends help
        self.cut_back = not any(isinstance(c, DeltaCache) for c in sample.target)
        self.root = Path(directory).expanduser()
        self.dir = self.root / _folder(self.identity, self.kv)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"the prefix cache directory {self.root} cannot be made ({e.strerror}); choose another."
            ) from None
        self.lock = threading.Lock()
        self.entries: dict[str, Entry] = {}
        self.queued: set[str] = set()
        self.warned: set[str] = set()
        self.loads = self.writes = self.refused = self.dropped = 0
        self.disk_bytes = 0
        remove_dead_leftovers(self.dir)
        self._scan()
        self._evict()
        self.jobs: queue.Queue = queue.Queue(maxsize=pending)
        self.thread = threading.Thread(target=self._write_loop, name="dflash-prefix-writer", daemon=True)
        self.thread.start()

    # -- reading ------------------------------------------------------------------
    def _scan(self) -> None:
        for p in sorted(self.dir.glob("*.safetensors")):
            if p.name.startswith("."):
                continue
            try:
                meta = files.read_header(p)
            except ValueError as e:
                self._refuse(p, e)
                continue
            made = tuple(
                int(meta[k]) if k in meta else None for k in ("kv_bits", "kv_group_size", "quantized_kv_start")
            )
            if meta.get("fingerprint") != self.identity["fingerprint"] or made != self.kv:
                self._refuse(p, files.ForeignCacheFile(f"{p} was made for another model pair or other KV settings."))
                continue
            tokens = np.array(files.token_ids(p, meta), np.int64)
            self.entries[p.name] = Entry(p, tokens, p.stat().st_size, int(meta.get("earliest", 0)))

    def _refuse(self, path: Path, error: ValueError) -> None:
        """Warn once about an entry never to be used; remove it if damaged."""
        self.refused += 1
        damaged = not isinstance(error, files.ForeignCacheFile)
        if str(path) not in self.warned:
            self.warned.add(str(path))
            fate = "removed" if damaged else "left unused"
            warnings.warn(f"the prefix cache skips an entry, {fate}: {error}", stacklevel=3)
        if damaged:
            path.unlink(missing_ok=True)

    def find(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the most of ``prompt`` but its last id (which the
        decode loop reads again), and how much; (None, 0) under min_tokens."""
        want = np.asarray(prompt[:-1], np.int64)
        best, best_len = None, 0
        with self.lock:
            for entry in self.entries.values():
                n = common_prefix(entry.tokens, want)
                if n > best_len and n >= entry.earliest and (self.cut_back or n == len(entry.tokens)):
                    best, best_len = entry, n
        return (best, best_len) if best_len >= self.min_tokens else (None, 0)

    def load(self, entry: Entry, expect: int = 0) -> PromptCache | None:
        """A fresh cache holding ``entry``, made to grow to ``expect`` ids (a
        prompt's; PromptCache.expect); None (with a warning, unless the file
        was merely evicted meanwhile) if the file cannot serve."""
        cache = self.new_cache()
        cache.expect(expect)
        try:
            files.read_prompt_cache(entry.path, cache, self.identity["fingerprint"])
        except ValueError as e:
            with self.lock:
                self.entries.pop(entry.path.name, None)
            if entry.path.exists():
                self._refuse(entry.path, e)
            return None
        _touch(entry.path)
        self.loads += 1
        return cache

    def load_longer(self, prompt: list[int], cache: PromptCache | None = None) -> PromptCache | None:
        """A cache from the store holding more of ``prompt`` than ``cache``
        would keep of it; None where none does (a conversation's own cache
        goes on)."""
        entry, n = self.find(prompt)
        held = 0
        if cache is not None:  # (what a cut back there keeps: a sliding layer may keep less)
            held = cache.keeps(common_prefix(cache.tokens, prompt[:-1])) or 0
        return self.load(entry, expect=len(prompt)) if entry is not None and n > held else None

    # -- writing ------------------------------------------------------------------
    def save(self, cache: PromptCache) -> bool:
        """Queue ``cache`` (settled, no generation running) to be written;
        False if it is short, already stored, or the writer is behind."""
        n = len(cache.tokens)
        if n < self.min_tokens or cache.max_kv_size is not None:
            return False
        tokens = np.array(cache.tokens, np.int64)
        name = f"{xxhash.xxh3_64_hexdigest(tokens.tobytes())}.safetensors"
        with self.lock:
            if name in self.entries:
                _touch(self.entries[name].path)
                return False
            if name in self.queued:
                return False
        if self.jobs.full():
            self.dropped += 1
            return False
        try:
            snap = files.snapshot(cache, identity=self.identity)
        except ValueError:  # in use by a generation: nothing settled to write
            return False
        with self.lock:
            self.queued.add(name)
        self.jobs.put((name, tokens, snap))
        return True

    def _write_loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            name, tokens, snap = job
            try:
                self._write(name, tokens, snap)
            except Exception:  # a full or read-only disk: the cache stays in memory
                log.exception("the prefix cache could not write %s", self.dir / name)
            finally:
                with self.lock:
                    self.queued.discard(name)
                # written: its views no longer make the cache's next write copy its buffers
                job = snap = None
                self.jobs.task_done()
        self.jobs.task_done()

    def _write(self, name: str, tokens: np.ndarray, snap: files.Snapshot) -> None:
        path = self.dir / name
        earliest = int(snap.meta.get("earliest", 0))
        size = files.write_snapshot(path, snap, self._pause(time.monotonic() + self.patience))
        older = []
        with self.lock:
            self.entries[name] = Entry(path, tokens, size, earliest)
            self.writes += 1
            if self.cut_back:  # entries this one extends serve nothing it does not
                older = [
                    e
                    for k, e in self.entries.items()
                    if k != name and common_prefix(e.tokens, tokens) == len(e.tokens) and e.earliest >= earliest
                ]
                for e in older:
                    del self.entries[e.path.name]
        for e in older:  # outside the lock: find, on the decode thread, takes it
            e.path.unlink(missing_ok=True)
        self._evict()

    def _pause(self, deadline: float) -> Callable[[], None]:
        """What the writer calls before each tensor of a file: wait until no
        generation has decoded for ``quiet`` seconds, ``deadline`` (then no
        more waits) or a flush."""

        def pause() -> None:
            left = deadline - time.monotonic()
            if left > 0:
                decoding.wait_idle(left, lambda: self.hurry > 0, self.quiet)

        return pause

    def _evict(self) -> None:
        """Remove the least recently used files of the whole directory (other
        pairs' too) until it holds at most max_bytes."""
        found = sorted(_tracked(self.root))
        total = sum(size for _, size, _ in found)
        for _, size, path in found:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            with self.lock:
                entry = self.entries.get(path.name)
                if entry is not None and entry.path == path:
                    del self.entries[path.name]
        self.disk_bytes = total

    def flush(self) -> None:
        """Wait until every queued write is on disk, decoding or not."""
        self._hasten(1)
        try:
            self.jobs.join()
        finally:
            self._hasten(-1)

    def close(self) -> None:
        self._hasten(1)  # for good: what is queued is written at once
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout=60)

    def _hasten(self, change: int) -> None:
        with self.lock:
            self.hurry += change
        decoding.wake()

    def __len__(self) -> int:
        return len(self.entries)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def copy_prefix(cache: PromptCache, n: int, fresh: PromptCache) -> PromptCache:
    """``fresh`` made to hold ``cache``'s first ``n`` positions, in buffers of
    its own (an attention-only, unbounded cache, settled)."""
    arrays = {}
    for k, a in files.cache_arrays(cache, n).items():
        head, _, part = k.rpartition(".")
        if part.isdigit():  # quantized parts, gathered back into their triple
            arrays[head] = arrays.get(head, ()) + (a,)
        else:
            arrays[k] = a
    t = cache.target[0]
    packed = (t.group_size, t.bits) if isinstance(t, QuantizedBufferKVCache) else None
    reply_from = cache.reply_from if n == len(cache.tokens) else None
    files.fill(fresh, arrays, cache.tokens[:n], reply_from, packed)
    return fresh
