"""Helpers shared by the converter and loading tests: tiny drafter checkpoints
in the Z Lab layout, fake Hugging Face caches, drafter logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from tiny import draft_config, make_target, random_draft_weights, target_config, write_zlab_draft
from typer.testing import CliRunner

from dflash_mlx.cli.app import app
from dflash_mlx.targets import adapt

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, ["convert", *map(str, args)])


def assert_clean_failure(result, *fragments: str) -> None:
    """Non-zero exit, no traceback, one message holding every fragment."""
    text = result.output
    assert result.exit_code != 0, text
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in text, text
    flat = " ".join(text.split())
    for f in fragments:
        assert f in flat, f"{f!r} not in {flat!r}"


def leftovers(parent: Path, name: str) -> list[str]:
    """Anything a conversion to parent/name left behind (output or temp)."""
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


TCFG = target_config()


def zlab_draft(path: Path, tcfg: dict = TCFG, weights=None, cfg=None, **extra) -> Path:
    """A tiny bf16 Z Lab drafter checkpoint for ``tcfg``."""
    cfg = cfg or draft_config(tcfg, **extra)
    weights = weights if weights is not None else random_draft_weights(cfg)
    return write_zlab_draft(path, cfg, weights)


def shard(path: Path, n: int = 2) -> Path:
    """Split a one-file checkpoint into ``n`` shards with an index."""
    weights = mx.load(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: weights[k] for k in names[i::n]}
        mx.save_safetensors(str(path / fname), part, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


_TARGETS: dict = {}


def tiny_target(tcfg: dict = TCFG):
    key = json.dumps(tcfg, sort_keys=True)
    if key not in _TARGETS:
        _TARGETS[key] = adapt(make_target(tcfg))
    return _TARGETS[key]


def draft_logits(draft, tcfg: dict = TCFG, ctx: int = 12, seed: int = 3) -> mx.array:
    """Float32 logits of one block after ``ctx`` random context positions,
    the drafter bound to the tiny target of ``tcfg``."""
    target = tiny_target(tcfg)
    draft.bind(target)
    cfg = draft.config
    mx.random.seed(seed)
    taps = mx.random.normal((1, ctx, len(cfg.target_layer_ids) * cfg.hidden_size))
    block = mx.array([[5] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    out = draft(block, taps, draft.make_cache())
    return out.astype(mx.float32)


def max_rel_err(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def hub_cache(root: Path, repo_id: str, src: Path, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Put the files of ``src`` into a huggingface_hub cache at ``root`` as the
    snapshot ``revision`` of ``repo_id`` (refs/main pointing at it)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    shutil.copytree(src, snap, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snap
