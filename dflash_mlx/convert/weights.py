"""Published DFlash drafter checkpoints (Z Lab's, speculators', transformers
assistants': draft/formats.py) -> MLX directories in Z Lab's layout that
``load_draft`` reads (config.json, safetensors, a model card). Written beside
the destination and renamed into place, so a failed conversion leaves no
output behind.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_mlx.atomic_dir import partial_dir, replace_dir
from dflash_mlx.draft import formats
from dflash_mlx.draft.dflash import DFlashDraft, DraftConfig, pair_problems
from dflash_mlx.draft.dflash2 import draft_model
from dflash_mlx.loading import (
    DRAFT_FILES,
    is_drafter_config,
    known_pairs,
    load_draft,
    read_config,
    read_draft,
    resolve,
    revision_of,
)

DTYPES = ("float16", "bfloat16", "float32")

# mode -> (allowed bits, allowed group sizes, mlx-lm's default (group_size, bits))
Q_MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]] = {
    "affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128), (64, 4)),
    "mxfp4": ((4,), (32,), (32, 4)),
    "nvfp4": ((4,), (16,), (16, 4)),
    "mxfp8": ((8,), (32,), (32, 8)),
}


@dataclass
class Quantization:
    group_size: int
    bits: int
    mode: str

    def as_config(self) -> dict:
        """The record mlx-lm writes into config.json."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def quantization_options(
    quantize: bool, q_bits: int | None, q_group_size: int | None, q_mode: str | None
) -> Quantization | None:
    """Validate the quantization flags; None when not quantizing."""
    q_mode = q_mode or "affine"
    if not quantize:
        given = [f for f, v in (("--q-bits", q_bits), ("--q-group-size", q_group_size)) if v is not None]
        if q_mode != "affine":
            given.append("--q-mode")
        if given:
            raise ValueError(f"{', '.join(given)} only apply when quantizing; add -q/--quantize or drop them.")
        return None
    if q_mode not in Q_MODES:
        raise ValueError(f"unknown quantization mode {q_mode!r}; use --q-mode one of {', '.join(Q_MODES)}.")
    bits_ok, groups_ok, (default_group, default_bits) = Q_MODES[q_mode]
    bits = default_bits if q_bits is None else q_bits
    group = default_group if q_group_size is None else q_group_size
    if bits not in bits_ok:
        raise ValueError(
            f"{q_mode} quantization cannot use {bits} bits; use --q-bits {' or '.join(map(str, bits_ok))}."
        )
    if group not in groups_ok:
        raise ValueError(
            f"{q_mode} quantization cannot use group size {group}; use --q-group-size "
            f"{' or '.join(map(str, groups_ok))}."
        )
    return Quantization(group, bits, q_mode)


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use --dtype {', '.join(DTYPES)}.")


def target_problems(cfg: DraftConfig, target: str | Path) -> list[str]:
    """What keeps the drafter ``cfg`` from serving ``target`` (a directory or
    Hub repo id); only the target's config.json is read."""
    tcfg = read_config(resolve(target, allow_patterns=["config.json"]), role="target")
    if is_drafter_config(tcfg):
        raise ValueError(f"--target {target} is a DFlash drafter; pass the target model it drafts for.")
    text = tcfg.get("text_config") if isinstance(tcfg.get("text_config"), dict) else tcfg
    fields = ("hidden_size", "vocab_size", "num_hidden_layers")
    missing = [f for f in fields if f not in text]
    if missing:
        raise ValueError(
            f"the target's config.json lacks {', '.join(missing)}, so it is not a language model; "
            "pass the target model's directory or repo id."
        )
    bad = next((f for f in fields if isinstance(text[f], bool) or not isinstance(text[f], int) or text[f] < 1), None)
    if bad:
        raise ValueError(
            f"the target's config.json has {bad} = {text[bad]!r}, but it must be a positive integer; "
            "re-download the target."
        )
    # The mask token is bounded by the embedding table, which may exceed the tokenizer.
    return pair_problems(cfg, text["hidden_size"], text["vocab_size"], text["num_hidden_layers"])


def _first_missing_ancestor(path: Path) -> Path | None:
    missing = None
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing = p
    return missing


def _card(
    out: Path,
    source: str,
    *,
    revision: str | None,
    dtype: str,
    quant: Quantization | None,
    target: str | None,
    upload_repo: str | None,
    from_hub: bool,
    source_format: str = formats.ZLAB,
) -> str:
    from dflash_mlx import __version__

    name = upload_repo or out.name
    source_link = f"[{source}](https://huggingface.co/{source})" if from_hub else f"`{source}`"
    rev = f" at revision `{revision}`" if revision else ""
    qtext = (
        f"{quant.bits}-bit {quant.mode} quantization, group size {quant.group_size} "
        "(Linear layers only; norms kept unquantized)"
        if quant
        else "no quantization"
    )
    meta = [
        "---",
        "library_name: mlx",
        "pipeline_tag: text-generation",
        "tags:",
        "- mlx",
        "- dflash",
        "- dflash-mlx",
        "- speculative-decoding",
    ]
    if from_hub:
        meta.append(f"base_model: {source}")
    meta.append("---")
    use_target = target or "<target model>"
    return (
        "\n".join(meta)
        + f"""

# {name}

A DFlash block-diffusion drafter in MLX format, converted with dflash-mlx
{__version__} from {source_link}{rev} ({source_format} format).

- dtype: {dtype}
- {qtext}
- converted: {datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}

The drafter proposes blocks of tokens that its target model verifies; output
stays exactly the target's.

```python
from dflash_mlx import load, generate

model, draft, tokenizer = load("{use_target}", draft="{upload_repo or out}")
print(generate(model, draft, tokenizer, "The capital of France is", max_tokens=64))
```
"""
    )


def _write(
    tmp: Path,
    model: DFlashDraft,
    config: dict,
    card: str,
) -> None:
    from mlx_lm.utils import save_config, save_model

    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    (tmp / "README.md").write_text(card)


def upload(path: Path, repo_id: str) -> None:
    """Create (if needed) the Hub repo ``repo_id`` and upload ``path`` to it."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", exist_ok=True)
        api.upload_folder(
            folder_path=str(path),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload DFlash drafter converted with dflash-mlx",
        )
    except Exception as e:  # network, auth and validation errors alike
        raise ValueError(
            f"the upload to {repo_id} failed ({type(e).__name__}: {e}); the converted drafter is in "
            f"{path}; log in with `hf auth login` and upload it with `hf upload {repo_id} {path}`."
        ) from e


def convert(
    hf_path: str | Path,
    mlx_path: str | Path = "mlx_model",
    *,
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_mode: str = "affine",
    target: str | Path | None = None,
    upload_repo: str | None = None,
    force: bool = False,
    log: Callable[[str], None] = lambda msg: None,
) -> Path:
    """Convert the drafter at ``hf_path`` (directory or Hub repo id; any
    format of draft/formats.py) to an MLX directory at ``mlx_path``; returns
    that path.

    ``dtype`` defaults to the dtype the checkpoint's tensors are stored in. Raises
    ValueError naming the fix for anything a user can get wrong."""
    check_dtype(dtype)
    quant = quantization_options(quantize, q_bits, q_group_size, q_mode)
    out = Path(mlx_path).expanduser()
    if out.exists() or out.is_symlink():
        if not force:
            raise ValueError(f"{out} already exists; choose another --mlx-path or pass --force to replace it.")
        if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
            raise ValueError(
                f"{out} is a directory that holds no model (no config.json), so --force will not replace "
                "it; choose another --mlx-path."
            )

    log(f"Reading {hf_path}")
    src = resolve(hf_path, allow_patterns=DRAFT_FILES)
    if out.resolve() == src.resolve() or out.resolve() in src.resolve().parents:
        raise ValueError(f"--mlx-path {out} would replace the source checkpoint; choose another directory.")
    raw = read_config(src)
    if raw.get("quantization"):
        raise ValueError(
            f"{hf_path} is already a quantized MLX drafter; convert from the original Z Lab checkpoint instead."
        )
    _, cfg, weights = read_draft(src)
    # d2t: a reduced vocabulary's token offsets, integers by nature.
    not_float = sorted(k for k, v in weights.items() if k != "d2t" and not mx.issubdtype(v.dtype, mx.floating))
    if not_float:
        raise ValueError(
            f"tensors {', '.join(not_float[:4])} are not floating point, so this is not a Z Lab drafter "
            "checkpoint; pass the original checkpoint."
        )

    if target is not None:
        log(f"Checking the pair against {target}")
        problems = target_problems(cfg, target)
        if problems:
            raise ValueError(
                f"the drafter does not fit --target {target}: "
                + "; ".join(problems)
                + ". Use the drafter published for this target."
            )

    # Default to the stored dtype: config.json's torch_dtype can disagree with the file.
    stored = str(weights["fc.weight"].dtype).split(".")[-1]
    dtype_name = dtype or (stored if stored in DTYPES else "float32")
    mx_dtype = getattr(mx, dtype_name)
    model = draft_model(cfg)
    model.load_weights([(k, v.astype(mx_dtype) if k != "d2t" else v) for k, v in weights.items()])
    source_format = formats.drafter_format(raw)
    # Other formats are written in Z Lab's layout, what load_draft reads back.
    layout = raw if source_format in (formats.ZLAB, formats.ZLAB2) else formats.zlab_config(raw)
    config = {k: v for k, v in layout.items() if k not in ("_name_or_path", "quantization_config")}
    if "torch_dtype" in config or "dtype" not in config:
        config["torch_dtype"] = dtype_name
    if "dtype" in config:
        config["dtype"] = dtype_name

    if quant:
        from mlx_lm.utils import quantize_model

        log(f"Quantizing to {quant.bits} bits ({quant.mode}, group size {quant.group_size})")
        with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints its own summary
            model, config = quantize_model(model, config, quant.group_size, quant.bits, mode=quant.mode)
        if not any(isinstance(m, (nn.QuantizedLinear,)) for _, m in model.named_modules()):
            raise ValueError(
                f"no layer of this drafter has an input size divisible by group size {quant.group_size}; "
                "choose a smaller --q-group-size."
            )
    mx.eval(model.parameters())

    src_id = str(hf_path)
    from_hub = not Path(src_id).expanduser().is_dir()
    card_target = str(target) if target else next((t for t, d in known_pairs() if d == src_id), None)
    card = _card(
        out,
        src_id if from_hub else str(src.resolve()),
        revision=revision_of(src),
        dtype=dtype_name,
        quant=quant,
        target=card_target,
        upload_repo=upload_repo,
        from_hub=from_hub,
        source_format=source_format or formats.ZLAB,
    )

    created, tmp = _first_missing_ancestor(out.parent), None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = partial_dir(out)
        log(f"Writing {out}")
        _write(tmp, model, config, card)
        load_draft(tmp)  # what we wrote must load as is
        replace_dir(tmp, out)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        if isinstance(e, OSError):
            raise ValueError(
                f"cannot write {out} ({e.strerror or e}); check that its directory is writable and the disk has room."
            ) from e
        raise

    size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    log(f"Wrote {out} ({size / 2**20:.1f} MiB, {dtype_name}{', quantized' if quant else ''})")
    if upload_repo:
        log(f"Uploading to {upload_repo}")
        upload(out, upload_repo)
    return out
