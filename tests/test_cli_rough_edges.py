"""The command line's rough edges (issue 35): a closed pipe, text that is not
UTF-8, acceptance over plain steps only, /think without a thinking section,
and mlx-lm's --verbose habits."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from cli_fixtures import make_tiny_pair
from test_cli import assert_user_error
from typer.testing import CliRunner

from dflash_mlx.cli.app import app

runner = CliRunner()
CLI = [sys.executable, "-m", "dflash_mlx.cli.app"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("cli-rough-edges"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input, prog_name="dflash-mlx", env={"COLUMNS": "200"})


def into_closed_pipe(*args) -> subprocess.CompletedProcess:
    """Run the real command with stdout a pipe whose reader is already gone."""
    r, w = os.pipe()
    os.close(r)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        return subprocess.run([*CLI, *map(str, args)], stdout=w, stderr=subprocess.PIPE, env=env, timeout=300)
    finally:
        os.close(w)


# -- (9) a closed pipe ----------------------------------------------------------
def test_generate_into_a_closed_pipe_ends_quietly(pair):
    result = into_closed_pipe("generate", "--model", pair.target, "--draft-model", pair.draft, "-p", "w1 w2", "-m", 64)
    stderr = result.stderr.decode()
    assert result.returncode == 141, stderr  # as a Unix tool killed by SIGPIPE
    for noise in ("error", "Broken pipe", "Exception ignored", "Traceback"):
        assert noise not in stderr, stderr


def test_help_into_a_closed_pipe_ends_quietly():
    result = into_closed_pipe("generate", "--help")
    stderr = result.stderr.decode()
    assert result.returncode in (0, 1, 141), stderr  # typer's console exits 1 as rich does
    for noise in ("error", "Broken pipe", "Exception ignored", "Traceback"):
        assert noise not in stderr, stderr


def test_models_into_a_closed_pipe_ends_quietly():
    result = into_closed_pipe("models")
    stderr = result.stderr.decode()
    assert result.returncode == 141, stderr
    for noise in ("error", "Broken pipe", "Exception ignored", "Traceback"):
        assert noise not in stderr, stderr


# -- (10) text that is not UTF-8 ------------------------------------------------
@pytest.mark.parametrize("flag", ["--prompt", "--system-prompt", "--prefill-response"])
def test_generate_refuses_text_that_is_not_utf8(pair, flag):
    args = ["generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1"]
    result = run(*args, flag, "w1 \udcff")  # how Python hands over argv byte 0xff
    assert_user_error(result, f"{flag} is not UTF-8 text", "byte 0xff", "pass UTF-8 text")


def test_non_utf8_argv_from_a_real_shell(pair):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LC_ALL": "C.UTF-8"}
    args = [*CLI, "generate", "--model", str(pair.target), "--draft-model", str(pair.draft), "-p", b"w1 \xff"]
    result = subprocess.run(args, capture_output=True, env=env, timeout=300)
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert "error: --prompt is not UTF-8 text (byte 0xff at character 3)" in stderr
    assert "TypeError" not in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("command", ["chat", "cache-prompt"])
def test_other_commands_refuse_a_system_prompt_that_is_not_utf8(pair, command):
    result = run(command, "--model", pair.target, "--system-prompt", "\udcfe")
    assert_user_error(result, "--system-prompt is not UTF-8 text", "byte 0xfe")


# -- (12) acceptance over plain steps; /think ------------------------------------
def test_no_drafting_cycles_have_no_acceptance_length(pair):
    # one token comes from the prompt's forward alone: no cycle drafted
    result = run("generate", "--model", pair.target, "--draft-model", pair.draft, "-p", "w1 w2", "-m", 1)
    assert result.exit_code == 0, result.output
    stats = " ".join(result.stderr.split())
    assert "acceptance length - (no drafting cycles)" in stats, stats
    assert "acceptance length 0.00" not in stats and "acceptance rate" not in stats


def test_chat_stats_without_drafting_cycles(pair):
    result = run("chat", "--model", pair.target, "--draft-model", pair.draft, "-m", 1, input="w1\n/stats\n")
    assert result.exit_code == 0, result.output
    assert "no drafting cycles yet" in result.stdout
    assert "τ 0.00" not in result.stdout


def test_think_without_a_thinking_section_stays_off(pair):
    result = run("chat", "--model", pair.target, "--draft-model", pair.draft, "-m", 4, input="/think\n/think\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("no thinking section; /think changes nothing") == 2
    assert "thinking on" not in result.stdout and "thinking off" not in result.stdout


# -- (14) mlx-lm's --verbose -----------------------------------------------------
MLX_LM_LINES = [
    r"^Prompt: \d+ tokens, \d+\.\d{3} tokens-per-sec$",
    r"^Generation: 8 tokens, \d+\.\d{3} tokens-per-sec$",
    r"^Peak memory: \d+\.\d{3} GB$",
]


@pytest.mark.parametrize("value", ["True", "T", "true"])
def test_verbose_true_prints_mlx_lm_closing_lines(pair, value):
    args = ["generate", "--model", pair.target, "--draft-model", pair.draft, "-p", "w1 w2", "-m", 8]
    result = run(*args, "--verbose", value)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()[-3:]
    for pattern, line in zip(MLX_LM_LINES, lines):
        assert re.match(pattern, line), (pattern, result.stderr)
    assert "prompt:" in result.stderr  # the rest of --verbose is on too


@pytest.mark.parametrize("value", ["False", "F", "--verbose=false"])
def test_verbose_false_is_quiet(pair, value):
    args = ["generate", "--model", pair.target, "--draft-model", pair.draft, "-p", "w1 w2", "-m", 8]
    result = run(*args, *(["--verbose", value] if not value.startswith("--") else [value]))
    assert result.exit_code == 0, result.output
    assert "Peak memory:" not in result.stderr and "prompt:" not in result.stderr
    assert "peak memory" in result.stderr  # the usual stats line


# -- serve: what uvicorn would only say after the load, or not at all -------------
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--log-level", "loud"], "--log-level must be one of critical, error, warning, info, debug, trace"),
        (["--api-key", ""], "--api-key is empty"),
        (["--api-key", "  "], "--api-key is empty"),
    ],
)
def test_serve_refuses_flags_before_loading(flags, message):
    result = run("serve", "--model", "/nonexistent/target", *flags)
    assert_user_error(result, message)


def test_serve_refuses_a_port_in_use(pair):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("serve", "--model", pair.target, "--draft-model", pair.draft, "--port", port)
    assert_user_error(result, f"port {port} on 127.0.0.1 is in use; choose another --port")


# -- --split, which only mlx.launch reads ------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "cache-prompt", "serve"])
def test_split_typo_is_refused_on_one_machine_too(command):
    result = run(command, "--model", "/nonexistent/target", "--split", "tensr")
    assert_user_error(result, "--split must be pipeline, tensor or auto, got 'tensr'.")


# -- --extra-eos-token as an id ------------------------------------------------------
@pytest.mark.parametrize("token", ["64", "1000000", "-1"])  # the tiny vocabulary is 64 tokens
def test_extra_eos_token_id_outside_the_vocabulary(pair, token):
    result = run(
        "generate", "--model", pair.target, "--draft-model", pair.draft, "-p", "w1", "--extra-eos-token", token
    )
    assert_user_error(result, f"--extra-eos-token '{token}' is not a token of this tokenizer")


# -- cache-prompt's output, checked before the load ----------------------------------
def test_cache_prompt_into_a_directory(pair, tmp_path):
    args = ["cache-prompt", "--model", pair.target, "--draft-model", pair.draft, "-p", "w1 w2"]
    result = run(*args, "--prompt-cache-file", tmp_path)
    assert_user_error(result, f"--prompt-cache-file {tmp_path} is a directory; name a file in it")
    (tmp_path / "notes.txt").write_text("mine")
    result = run(*args, "--prompt-cache-file", tmp_path / "notes.txt" / "prefix.safetensors")
    assert_user_error(result, f"lies under {tmp_path / 'notes.txt'}, which is a file; choose another path.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_convert_under_a_file(pair, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    out = tmp_path / "notes.txt" / "drafter"
    result = run("convert", "--hf-path", pair.draft, "--mlx-path", out)
    assert_user_error(result, f"--mlx-path {out} lies under {tmp_path / 'notes.txt'}, which is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# -- doctor ----------------------------------------------------------------------------
@pytest.mark.parametrize("seconds", ["-1", "nan"])  # both skipped the probe as if 0 (inf ran it for ever)
def test_doctor_refuses_seconds_that_are_no_duration(seconds):
    result = run("doctor", "--seconds", seconds)
    assert_user_error(result, f"--seconds must be a finite number, 0 or more (0 skips the probe), got {seconds}.")
