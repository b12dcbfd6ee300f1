"""Where output goes, and how a user's mistake ends: one red sentence.

Streamed text goes to stdout (``console``); notes, progress, stats and errors
to stderr (``err``). Every command runs inside ``user_errors``, and the app
turns Typer's usage errors into the same sentence (``print_error``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.text import Text

try:  # typer >= 0.2x carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions


class UserError(Exception):
    """A mistake the user can fix; shown as one red sentence."""


def note(message: str) -> None:
    err.print(Text(message, style="dim"), soft_wrap=True)


# A silenced rank's error is said after this long, if it still runs: mlx.launch
# stops every rank once one fails, so rank 0's own error, said at once, comes first.
SILENCED_ERROR_DELAY_S = 3.0


def print_error(message: str) -> None:
    if err.quiet:  # a rank other than the first (speak_on_first_rank_only)
        time.sleep(SILENCED_ERROR_DELAY_S)
        err.quiet = False
    err.print(Text(f"error: {message}", style="bold red"), soft_wrap=True)


def _sentence(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror}{where}; check the path and its permissions."
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, KeyError):
        msg = f"missing key {msg}"
    return msg


BROKEN_PIPE = 141  # the status of a Unix tool killed by SIGPIPE


def silence_stdout() -> None:
    """stdout's reader has gone (``| head``): point stdout at /dev/null so
    that Python's flush at exit does not complain about it again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (CliRunner)
        pass


class _Console(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout()
        raise SystemExit(BROKEN_PIPE)


console = _Console(highlight=False)
err = _Console(stderr=True, highlight=False)


def speak_on_first_rank_only(group) -> None:
    """Under ``mlx.launch`` (``group``: distributed.world()), silence every
    rank but the first: the ranks run alike, one of them prints."""
    if group is None or group.rank() == 0:
        return
    console.quiet = err.quiet = True
    silence_stdout()


def refuse_across_ranks(group, **given) -> None:
    """Under ``mlx.launch`` (``group``: distributed.world()), refuse each
    option that runs on one machine only; ``given``: its flag -> its value
    (None: left out)."""
    if group is None:
        return
    for flag, value in given.items():
        if value is not None:
            raise UserError(f"{flag} cannot be used across ranks yet; leave it out under mlx.launch.")


@contextmanager
def sigint_handled(handler):
    """Ctrl-C goes to ``handler`` until the block ends (off the main thread,
    where no handler can be set, it stays as it was)."""
    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextmanager
def user_errors(verbose: bool = False, interrupted: str = "interrupted") -> Iterator[None]:
    """Turn what users can cause into one red sentence and exit code 1 (a
    traceback only with --verbose); Ctrl-C prints ``interrupted`` and exits 130."""
    try:
        yield
    except (typer.Exit, typer.Abort, click_exceptions.ClickException):
        raise
    except KeyboardInterrupt:
        err.print(Text(f"\n{interrupted}", style="yellow"), soft_wrap=True)
        raise typer.Exit(130)
    except BrokenPipeError:  # quiet, as Unix tools end in a closed pipe
        silence_stdout()
        raise typer.Exit(BROKEN_PIPE)
    except Exception as e:
        if verbose:
            traceback.print_exc(file=sys.stderr)
        message = _sentence(e)
        if not isinstance(e, (UserError, ValueError, OSError, KeyError)):  # a bug, not a user mistake
            rerun = "" if verbose else " (rerun with --verbose for the traceback)"
            message = f"unexpected {type(e).__name__}: {message}{rerun}"
        print_error(message)
        raise typer.Exit(1)
