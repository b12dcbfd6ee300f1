"""mlx-lm's sampling and template flags (issue 35): --xtc-probability,
--xtc-threshold, --min-tokens-to-keep and --use-default-chat-template."""

from __future__ import annotations

import pytest
from cli_fixtures import make_tiny_pair
from test_cli import assert_user_error
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.app import app
from dflash_mlx.cli.prompt_input import use_default_template
from dflash_mlx.prompts import apply_chat_template

runner = CliRunner()
XTC = ("--xtc-probability", "--xtc-threshold", "--min-tokens-to-keep")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("cli-mlx-flags"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(*args):
    return runner.invoke(app, [str(a) for a in args], prog_name="dflash-mlx", env={"COLUMNS": "200"})


def gen(pair, *args):
    return run("generate", "--model", pair.target, "--draft-model", pair.draft, *args)


def test_the_flags_are_on_every_command_that_samples():
    for command in ("generate", "chat", "bench"):
        out = run(command, "-h").output
        for flag in (*XTC, "--use-default-chat-template"):
            assert flag in out, (command, flag)
    serve = run("serve", "-h").output
    assert "--use-default-chat-template" in serve  # mlx-lm's server has no XTC defaults either
    assert "--xtc-probability" not in serve


def test_xtc_and_min_tokens_to_keep_reach_the_sampler(pair):
    model, draft, tok = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    sampling = dict(temperature=1.0, min_p=0.05, seed=3, max_tokens=24)
    xtc = dict(xtc_probability=1.0, xtc_threshold=0.05, min_tokens_to_keep=4)
    want = dflash_mlx.generate(model, draft, tok, "w1 w2", **sampling, **xtc)
    assert want != dflash_mlx.generate(model, draft, tok, "w1 w2", **sampling)
    flags = ["--temp", 1.0, "--min-p", 0.05, "--seed", 3, "-m", 24]
    result = gen(
        pair, "--prompt", "w1 w2", *flags, "--xtc-probability", 1.0, "--xtc-threshold", 0.05, "--min-tokens-to-keep", 4
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == want.strip()


@pytest.mark.parametrize(
    "flag,value,sentence",
    [
        ("--xtc-probability", 1.5, "--xtc-probability must be in [0, 1]"),
        ("--xtc-probability", -0.1, "--xtc-probability must be in [0, 1]"),
        ("--xtc-threshold", 0.6, "--xtc-threshold must be in [0, 0.5]"),
        ("--min-tokens-to-keep", 0, "--min-tokens-to-keep must be a positive integer"),
    ],
)
def test_bad_values_are_one_sentence(pair, flag, value, sentence):
    assert_user_error(gen(pair, "--prompt", "w1", flag, value), sentence)
    for command in ("chat", "bench"):
        assert_user_error(run(command, "--model", pair.target, "--draft-model", pair.draft, flag, value), sentence)


def test_library_names_the_bad_argument():
    model, draft, tok = dflash_mlx.load("builtin")
    with pytest.raises(ValueError, match=r"xtc_threshold must be in \[0, 0.5\]"):
        dflash_mlx.generate(model, draft, tok, "hi", xtc_threshold=0.7)
    with pytest.raises(ValueError, match="min_tokens_to_keep must be"):
        dflash_mlx.generate(model, draft, tok, "hi", min_tokens_to_keep=0)


def test_use_default_chat_template_on_a_template_less_tokenizer(pair):
    model, draft, tok = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    assert not tok.has_chat_template
    use_default_template(tok, False)
    assert not tok.has_chat_template
    use_default_template(tok, True)
    assert tok.has_chat_template
    messages = [{"role": "user", "content": "w3 w4"}]
    assert tok.apply_chat_template(messages, tokenize=False).startswith("<|im_start|>user\nw3 w4<|im_end|>")
    ids = apply_chat_template(tok, messages)
    want = dflash_mlx.generate(model, draft, tok, ids, max_tokens=16)
    result = gen(pair, "--prompt", "w3 w4", "-m", 16, "--use-default-chat-template")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == want.strip()
    assert "no chat template" not in result.stderr
    plain = gen(pair, "--prompt", "w3 w4", "-m", 16)
    assert "no chat template" in plain.stderr


def test_use_default_chat_template_keeps_a_template_of_its_own(pair):
    _, _, tok = dflash_mlx.load(str(pair.chat_target), draft=str(pair.draft))
    template = tok.chat_template
    use_default_template(tok, True)
    assert tok.chat_template == template
