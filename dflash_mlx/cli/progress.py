"""Progress on stderr: Hub downloads and long prefills, as transient rich bars."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .console import err, sigint_handled


def hub_progress_class(progress: Progress) -> type:
    """A tqdm class for huggingface_hub's ``tqdm_class`` whose bars are tasks
    of ``progress``, a rich Progress the caller runs: rich shows one live
    display at a time, and a snapshot download opens several bars."""
    from tqdm.std import tqdm as std_tqdm

    class HubBar(std_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["gui"] = True  # tqdm draws nothing itself; display() feeds rich
            super().__init__(*args, **kwargs)
            self.task = None if self.disable else progress.add_task(self.desc or "", total=self.total)

        def display(self, *args, **kwargs):
            if getattr(self, "task", None) is not None:
                progress.update(self.task, completed=self.n, total=self.total, description=self.desc or "")

        def clear(self, *args, **kwargs):
            pass

        def close(self):
            if getattr(self, "task", None) is not None:
                progress.remove_task(self.task)
                self.task = None
            super().close()

    return HubBar


@contextmanager
def interrupts_deferred():
    """Ctrl-C held back until the block ends, then handled as it would have
    been: a rich live display stopped halfway through starting or stopping
    leaves its console's stacks broken. (The handler is swapped, not the
    thread's signal mask: Python runs handlers on the main thread whichever
    thread the signal reached.)"""
    old = signal.getsignal(signal.SIGINT)
    if not callable(old):
        yield
        return
    pressed = []
    try:
        with sigint_handled(lambda *args: pressed.append(args)):
            yield
    finally:
        if pressed:
            old(*pressed[0])


class PrefillProgress:
    """prompt_progress callback: a transient rich bar on stderr, shown only
    when the new part of the prompt takes more than one prefill step."""

    def __init__(self):
        self.bar = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        with interrupts_deferred():
            self._show(done, total)

    def _show(self, done: int, total: int) -> None:
        if self.bar is None:
            if done >= total:
                return
            self.bar = Progress(
                TextColumn("[dim]prefill"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=err,
                transient=True,
            )
            self.task = self.bar.add_task("prefill", total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        with interrupts_deferred():
            if self.bar is not None:
                self.bar.stop()
                self.bar = None
