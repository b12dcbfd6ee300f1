"""--lookup on the commands, and --draft-model none: prompt lookup from the
command line gives the target's own greedy text, with or without a drafter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cli_fixtures import make_tiny_pair
from test_cli import assert_user_error, run

import dflash_mlx
from dflash_mlx.cli.status import block_text
from dflash_mlx.tiny import greedy_reference


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("lookup-models"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def greedy_text(pair, prompt: str, n: int) -> str:
    model, _, tokenizer = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    ids = tokenizer.encode(prompt)
    return tokenizer.decode(greedy_reference(model, ids, n))


@pytest.mark.parametrize("lookup", ["on", "auto", "off"])
def test_generate_with_lookup_prints_the_targets_greedy_text(pair, lookup):
    prompt = "w1 w2 w3 w1 w2 w3 w1 w2"
    r = run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", prompt, "-m", "12",
            "--lookup", lookup)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == greedy_text(pair, prompt, 12).strip()


def test_draft_model_none_drafts_by_lookup_alone(pair):
    prompt = "w1 w2 w3 w1 w2 w3 w1 w2"
    r = run("generate", "--model", pair.target, "--draft-model", "none", "--prompt", prompt, "-m", "12",
            "--lookup", "on")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == greedy_text(pair, prompt, 12).strip()


def test_lookup_refuses_bad_values_and_a_missing_drafter(pair):
    assert_user_error(
        run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1", "--lookup", "maybe"),
        "--lookup must be on, off or auto, got 'maybe'.",
    )
    assert_user_error(
        run("generate", "--model", pair.target, "--draft-model", "none", "--prompt", "w1"),
        "no drafter was given", "--lookup on",
    )  # fmt: skip


def test_the_status_says_why_auto_ran_plain_and_what_was_looked_up():
    plain = SimpleNamespace(block_sizes={1: 60, 16: 3}, cycles=63, lookup_hits=0,
                            auto_reason="plain: blocks cost more than they commit")  # fmt: skip
    assert block_text(plain, "auto") == "block auto 16, 60 plain steps (blocks cost more than they commit)"
    drafting = SimpleNamespace(block_sizes={1: 2, 16: 30}, cycles=32, lookup_hits=5, auto_reason="drafting")
    assert block_text(drafting, "auto") == "block auto 16, 2 plain steps, 5 looked up"


def test_an_auto_reply_says_what_auto_did(pair):
    model, draft, tokenizer = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    last = None
    for last in dflash_mlx.stream_generate(model, draft, tokenizer, "w1 w2", max_tokens=8):
        pass
    assert isinstance(last.auto_reason, str) and last.auto_reason
    for last in dflash_mlx.stream_generate(model, draft, tokenizer, "w1 w2", max_tokens=8, block_size=4):
        pass
    assert last.auto_reason is None


def test_a_prompt_cache_without_a_drafter_serves_lookup_alone_across_turns(pair):
    model, _, tokenizer = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    cache = dflash_mlx.make_prompt_cache(model, None)
    ids = tokenizer.encode("w1 w2 w3 w1 w2")
    for turn in range(2):
        got = [t for r in dflash_mlx.stream_generate(model, None, tokenizer, ids, max_tokens=8, lookup=True,
                                                        prompt_cache=cache) for t in r.tokens]  # fmt: skip
        assert got == greedy_reference(model, ids, 8), turn
        ids = ids + got + tokenizer.encode(" w3")


def test_chat_runs_with_lookup_alone(pair):
    r = run("chat", "--model", pair.target, "--draft-model", "none", "--lookup", "on", "-m", "6", input="w1 w2\n")
    assert r.exit_code == 0, r.output
    assert "error" not in r.output.lower()
