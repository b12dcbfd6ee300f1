"""The `dflash-mlx` Typer app."""

from __future__ import annotations

import sys

import typer
import typer.core
from rich.text import Text

from .bench import EXAMPLES as BENCH_EXAMPLES
from .bench import bench_command
from .cache_prompt import EXAMPLES as CACHE_PROMPT_EXAMPLES
from .cache_prompt import cache_prompt_command
from .chat import EXAMPLES as CHAT_EXAMPLES
from .chat import chat_command
from .console import BROKEN_PIPE, err, print_error, silence_stdout
from .console import click_exceptions as cx
from .convert import EXAMPLES as CONVERT_EXAMPLES
from .convert import convert_command
from .doctor import EXAMPLES as DOCTOR_EXAMPLES
from .doctor import doctor_command
from .generate import EXAMPLES as GENERATE_EXAMPLES
from .generate import generate_command
from .models import EXAMPLES as MODELS_EXAMPLES
from .models import models_command
from .serve import EXAMPLES as SERVE_EXAMPLES
from .serve import serve_command
from .train import EXAMPLES as TRAIN_EXAMPLES
from .train import train_command


def _bare_flags(params: list) -> list:
    """On/off flags show no ``<bool>`` value in --help."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


_BOOL_WORDS = {"true": True, "t": True, "false": False, "f": False}


def mlx_lm_verbose(args: list[str]) -> list[str]:
    """Accept mlx-lm's ``--verbose True|False`` (and ``--verbose=F``) for the
    ``--verbose`` flag: the value is turned into the flag or its absence."""
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out += args[i:]
            break
        name, eq, value = a.partition("=")
        if name == "--verbose" and not eq and i + 1 < len(args) and args[i + 1].lower() in _BOOL_WORDS:
            value, i = args[i + 1], i + 1
        if name == "--verbose" and value.lower() in _BOOL_WORDS:
            out += ["--verbose"] if _BOOL_WORDS[value.lower()] else []
        else:
            out.append(a)
        i += 1
    return out


class _Command(typer.core.TyperCommand):
    def get_params(self, ctx):
        return _bare_flags(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    def get_params(self, ctx):
        return _bare_flags(super().get_params(ctx))

    """Usage mistakes (a bad flag value, an unknown option) end like every
    other user error: one red sentence on stderr and exit code 1."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = mlx_lm_verbose(sys.argv[1:] if args is None else list(args))
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except cx.NoArgsIsHelpError:  # typer has printed the help already
            rv = 0
        except cx.UsageError as e:
            hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
            print_error(f"{e.format_message().rstrip('.')}{hint}.")
            rv = 1
        except cx.ClickException as e:
            print_error(e.format_message())
            rv = e.exit_code
        except typer.Abort:
            err.print(Text("aborted", style="yellow"))
            rv = 1
        except BrokenPipeError:  # outside a command's user_errors: --help | head
            silence_stdout()
            rv = BROKEN_PIPE
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv


app = typer.Typer(
    cls=_Group,
    help="Lossless DFlash speculative decoding on MLX: a small block-diffusion drafter proposes, "
    "the target verifies, the output is exactly the target's.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Run 'dflash-mlx COMMAND --help' (or -h) for a command's flags and examples. "
    "Leaving out --model uses the small built-in pair shipped with dflash-mlx.",
)


def _print_version(value: bool) -> None:
    if value:
        from dflash_mlx import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the installed version and exit.", callback=_print_version, is_eager=True
    ),
):
    """Lossless DFlash speculative decoding on MLX: a small block-diffusion drafter proposes, the
    target verifies, the output is exactly the target's."""
    from dflash_mlx import use_fast_blas

    use_fast_blas()  # before a command imports MLX


app.command("generate", cls=_Command, epilog=GENERATE_EXAMPLES)(generate_command)
app.command("chat", cls=_Command, epilog=CHAT_EXAMPLES)(chat_command)
app.command("bench", cls=_Command, epilog=BENCH_EXAMPLES)(bench_command)
app.command("cache-prompt", cls=_Command, epilog=CACHE_PROMPT_EXAMPLES)(cache_prompt_command)
app.command("models", cls=_Command, epilog=MODELS_EXAMPLES)(models_command)
app.command("serve", cls=_Command, epilog=SERVE_EXAMPLES)(serve_command)
app.command("convert", cls=_Command, epilog=CONVERT_EXAMPLES)(convert_command)
app.command("train", cls=_Command, epilog=TRAIN_EXAMPLES)(train_command)
app.command("doctor", cls=_Command, epilog=DOCTOR_EXAMPLES)(doctor_command)


@app.command(cls=_Command, epilog="Example:\n\n  dflash-mlx version")
def version():
    """Print the installed version."""
    from dflash_mlx import __version__

    typer.echo(__version__)


def main():
    app()


if __name__ == "__main__":
    main()
