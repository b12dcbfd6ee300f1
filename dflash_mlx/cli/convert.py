"""`dflash-mlx convert`: a Z Lab drafter checkpoint to an MLX directory
(the converter is dflash_mlx.weights_convert)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from ..atomic_dir import file_in_the_way
from .console import UserError, console, user_errors
from .options import Verbose

EXAMPLES = """\
Examples:

$ dflash-mlx convert --hf-path z-lab/Qwen3-8B-DFlash-b16 --mlx-path Qwen3-8B-DFlash-b16-4bit -q --target Qwen/Qwen3-8B

$ dflash-mlx convert --hf-path ./Qwen3-8B-DFlash-b16 --mlx-path ./Qwen3-8B-DFlash-fp16 --dtype float16

The output loads with dflash_mlx.load or --draft-model; an existing one is replaced only with --force.
"""


def convert_command(
    *,
    hf_path: str = typer.Option(
        ...,
        "--hf-path",
        help="DFlash drafter in any published format (Z Lab, speculators, transformers assistant): Hub repo id or local directory.",
    ),
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
        None,
        "--target",
        help="Target model (repo id, directory or 'builtin') to check the pair against before writing.",
    ),
    upload_repo: Optional[str] = typer.Option(None, "--upload-repo", help="Hub repo to upload the result to."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
    verbose: Verbose = False,
):
    """Convert a Z Lab DFlash drafter checkpoint to MLX format."""
    with user_errors(verbose, interrupted="interrupted; nothing was written."):
        from dflash_mlx.convert.weights import convert

        from .pair import model_or_builtin

        if target == "builtin":
            target = model_or_builtin(target)
        _check_destination(Path(mlx_path).expanduser())
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
            log=lambda msg: console.print(Text(msg, style="dim")),
        )
        _usual_mode(Path(path))
    console.print(Text(f"Converted {hf_path} -> {path}", style="green"))


def _check_destination(out: Path) -> None:
    """Before the checkpoint is read or downloaded: no directory can be made under a file."""
    there = file_in_the_way(out)
    if there is not None:
        raise UserError(f"--mlx-path {out} lies under {there}, which is a file; choose another --mlx-path.")


def _usual_mode(path: Path) -> None:
    """The converter writes under a private temporary directory (mode 0700);
    give the result the mode a new directory gets here (0755 with the usual umask)."""
    mask = os.umask(0)
    os.umask(mask)
    if path.is_dir():
        path.chmod(0o777 & ~mask)
