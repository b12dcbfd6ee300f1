"""The `dflash-mlx convert` command (registered by the CLI app as
``app.command("convert")(convert_command)``). Heavy imports happen inside."""

from __future__ import annotations

from typing import Optional

import typer


def convert_command(
    hf_path: str = typer.Option(..., "--hf-path", help="Z Lab drafter: Hub repo id or local directory."),
    mlx_path: str = typer.Option("mlx_model", "--mlx-path", help="Output directory."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="float16, bfloat16 or float32 (default: the checkpoint's own)."
    ),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the drafter's linear layers."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Bits per weight (mlx-lm default for the mode)."),
    q_group_size: Optional[int] = typer.Option(
        None, "--q-group-size", help="Quantization group size (mlx-lm default for the mode)."
    ),
    q_mode: str = typer.Option("affine", "--q-mode", help="affine, mxfp4, nvfp4 or mxfp8."),
    target: Optional[str] = typer.Option(
        None, "--target", help="Target model (repo id or directory) to check the pair against before writing."
    ),
    upload_repo: Optional[str] = typer.Option(None, "--upload-repo", help="Hub repo to upload the result to."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
):
    """Convert a Z Lab DFlash drafter checkpoint to MLX format."""
    from rich.console import Console
    from rich.text import Text

    err = Console(stderr=True)
    out = Console()
    try:
        from dflash_mlx.weights_convert.convert import convert

        path = convert(
            hf_path,
            mlx_path,
            dtype=dtype,
            quantize=quantize,
            q_bits=q_bits,
            q_group_size=q_group_size,
            q_mode=q_mode,
            target=target,
            upload_repo=upload_repo,
            force=force,
            log=lambda msg: out.print(Text(msg, style="dim")),
        )
    except ValueError as e:
        err.print(Text(f"error: {e}", style="bold red"), soft_wrap=True)
        raise typer.Exit(1)
    except OSError as e:  # reading a file the user cannot read, and the like
        where = f" {e.filename}" if e.filename else ""
        err.print(Text(f"error: cannot read{where} ({e.strerror or e}); check the path and its permissions.", style="bold red"), soft_wrap=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        err.print(Text("interrupted; nothing was written.", style="bold red"), soft_wrap=True)
        raise typer.Exit(130)
    out.print(Text(f"Converted {hf_path} -> {path}", style="green"))
