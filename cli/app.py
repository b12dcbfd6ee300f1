"""The `dflash-mlx` Typer app."""

import typer

app = typer.Typer(help="Lossless DFlash speculative decoding on MLX.", no_args_is_help=True)


@app.command()
def version():
    """Print the installed version."""
    from dflash_mlx import __version__

    typer.echo(__version__)


def main():
    app()
