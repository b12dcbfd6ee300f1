"""The built-in pair by name across the CLI: `convert --target builtin` checks
against the packaged target (no Hub), `models` lists the pair first, and the
note for a left-out --model names the drafter actually loaded."""

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx import builtin
from dflash_mlx.cli.app import app
from dflash_mlx.tiny import draft_config, random_draft_weights, write_zlab_draft

pytestmark = pytest.mark.skipif(not builtin.available(), reason="the built-in pair is not installed")


def run(*args, **kw):
    return CliRunner().invoke(app, [str(a) for a in args], prog_name="dflash-mlx", env={"COLUMNS": "300"}, **kw)


def builtin_target_config() -> dict:
    return json.loads((builtin.TARGET / "config.json").read_text())


def test_convert_target_builtin_checks_against_the_packaged_target(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tcfg = builtin_target_config()
    fits = draft_config(tcfg, layers=1, block_size=4, taps=[2])
    src = write_zlab_draft(tmp_path / "zlab", fits, random_draft_weights(fits, seed=3))
    result = run("convert", "--hf-path", src, "--mlx-path", tmp_path / "out", "--target", "builtin")
    assert result.exit_code == 0, result.output
    assert "cannot download" not in result.output and (tmp_path / "out" / "config.json").is_file()
    assert f"Checking the pair against {builtin.TARGET}" in " ".join(result.stdout.split())

    other = draft_config({**tcfg, "vocab_size": 512}, layers=1, block_size=4, taps=[2])
    src = write_zlab_draft(tmp_path / "zlab-other", other, random_draft_weights(other, seed=4))
    result = run("convert", "--hf-path", src, "--mlx-path", tmp_path / "out2", "--target", "builtin")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "cannot download" not in said, result.output
    assert f"the drafter does not fit --target {builtin.TARGET}" in said and not (tmp_path / "out2").exists()


def test_models_lists_the_builtin_pair_first(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    rows = json.loads(run("models", "--json").stdout)
    assert rows[0] == {
        "target": "builtin",
        "drafter": "builtin",
        "format": "Z Lab DFlash",
        "runs": True,
        "why_not": None,
        "target_cached": True,
        "drafter_cached": True,
        "builtin": True,
    }
    assert not any(r["builtin"] for r in rows[1:])
    cached = json.loads(run("models", "--cached", "--json").stdout)
    assert [r["target"] for r in cached] == ["builtin"]
    table = run("models").stdout.splitlines()
    first = next(i for i, line in enumerate(table) if "builtin" in line or "z-lab/" in line)
    assert "builtin (built-in, offline)" in table[first]
    none = run("models", "--cached").stdout
    assert "builtin (built-in, offline)" in none and "no Hub pair is fully cached yet" in none


def test_the_note_names_the_drafter_actually_loaded(tmp_path):
    tcfg = builtin_target_config()
    mine = draft_config(tcfg, layers=1, block_size=4, taps=[2])
    draft = write_zlab_draft(tmp_path / "mine", mine, random_draft_weights(mine, seed=5))
    given = run("generate", "--draft-model", draft, "-p", "def f():", "--ignore-chat-template", "-m", 3)
    assert given.exit_code == 0, given.output
    said = " ".join(given.stderr.split())
    assert f"no --model given: using the built-in pair's target with the drafter {draft}" in said
    assert "4-layer DFlash drafter" not in said
    default = run("generate", "-p", "def f():", "--ignore-chat-template", "-m", 3)
    assert default.exit_code == 0 and f"no --model given: using the {builtin.NAME}" in " ".join(default.stderr.split())
