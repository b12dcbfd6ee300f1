"""--tree-budget on generate, chat and bench: the setting reaches
stream_generate, the text is still the target's own greedy text, the status
lines and bench's figures say what the trees did, and bad values end in one
sentence."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from cli_fixtures import make_tiny_pair
from test_cli import assert_user_error, run

import dflash_mlx
from dflash_mlx.cli.status import stats_line, status_text, tree_text
from dflash_mlx.tiny import greedy_reference

PROMPT = "w1 w2 w3 w1 w2 w3 w1 w2"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("tree-models"))


@pytest.fixture(scope="module")
def loaded(pair):
    return dflash_mlx.load(str(pair.target), draft=str(pair.draft))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def calls(monkeypatch):
    """stream_generate as the commands call it, recording each call's
    prompt ids, keyword arguments and the tokens it produced."""
    real = dflash_mlx.stream_generate
    seen = []

    def recording(model, draft, tokenizer, prompt, **kwargs):
        call = {"model": model, "prompt": list(prompt), "kwargs": kwargs, "tokens": []}
        seen.append(call)
        for r in real(model, draft, tokenizer, prompt, **kwargs):
            call["tokens"] += r.tokens
            call["last"] = r
            yield r

    monkeypatch.setattr(dflash_mlx, "stream_generate", recording)
    return seen


def greedy_text(loaded, prompt: str, n: int) -> str:
    model, _, tokenizer = loaded
    return tokenizer.decode(greedy_reference(model, tokenizer.encode(prompt), n))


@pytest.mark.parametrize("budget, given", [("12", 12), ("auto", "auto"), ("off", None)])
def test_generate_passes_the_tree_budget_and_prints_the_targets_greedy_text(pair, loaded, calls, budget, given):
    r = run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", PROMPT, "-m", "16",
            "--tree-budget", budget)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == greedy_text(loaded, PROMPT, 16).strip()
    assert [c["kwargs"]["tree_budget"] for c in calls] == [given]
    last = calls[0]["last"]
    if given == 12:  # the drafter's blocks are 6 rows: 12 a cycle are trees
        assert "tree 12: " in r.stderr and "12.0 rows verified/cycle" in r.stderr
        assert last.rows_verified == 12 * (last.cycles - last.plain_cycles)
    elif given == "auto":
        assert "tree auto" in r.stderr and "tokens/cycle" in r.stderr
    else:
        assert "tree" not in r.stderr and "block auto" in r.stderr


def test_trees_with_lookup_accept_a_depth_and_stay_greedy(pair, loaded, calls):
    r = run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", PROMPT, "-m", "24",
            "--tree-budget", "10", "--lookup", "on")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == greedy_text(loaded, PROMPT, 24).strip()
    last = calls[0]["last"]
    assert calls[0]["kwargs"]["lookup"] is True and last.lookup_hits > 0 and last.acceptance_length > 1
    assert f"tree 10: {last.acceptance_length:.2f} tokens/cycle" in " ".join(r.stderr.split())


@pytest.mark.parametrize("value", ["0", "65", "x", "1.5", "-3"])
def test_bad_tree_budgets_end_in_one_sentence(pair, value):
    assert_user_error(
        run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1", "--tree-budget", value),
        f"--tree-budget must be an integer from 1 to 64 (rows a cycle verifies) or auto, got {value!r}.",
    )


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_trees_without_a_drafter_are_refused_before_loading(pair, command, calls):
    prompt = ["--prompt", "w1"] if command == "generate" else []
    r = run(command, "--model", pair.target, "--draft-model", "none", "--lookup", "on", *prompt,
            "--tree-budget", "8", input="w1\n")  # fmt: skip
    assert_user_error(r, "--tree-budget drafts trees with a DFlash drafter; name one with --draft-model")
    assert calls == []


@pytest.mark.parametrize("command", ["chat", "bench", "serve"])
def test_every_command_refuses_a_bad_tree_budget(pair, command):
    r = run(command, "--model", pair.target, "--draft-model", pair.draft, "--tree-budget", "many", input="w1\n")
    assert_user_error(r, "--tree-budget must be an integer from 1 to 64")


def test_a_tree_budget_the_caches_cannot_take_is_refused_and_auto_runs_blocks(pair, loaded, calls):
    base = ("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", PROMPT, "-m", "8",
            "--max-kv-size", "64")  # fmt: skip
    assert_user_error(run(*base, "--tree-budget", "8"), "cannot verify draft trees over its KV caches",
                      "(--tree-budget auto), or leave it out.")  # fmt: skip
    assert calls == []
    r = run(*base, "--tree-budget", "auto")
    assert r.exit_code == 0, r.output
    assert "--tree-budget auto verifies blocks" in " ".join(r.stderr.split())
    assert "tokens/cycle" not in r.stderr and "block auto" in r.stderr  # the stats say blocks
    assert r.stdout.strip() == greedy_text(loaded, PROMPT, 8).strip()


def test_chat_passes_the_tree_budget_and_shows_the_trees(pair, calls):
    r = run("chat", "--model", pair.chat_target, "--draft-model", pair.draft, "-m", "10", "--tree-budget", "12",
            input="w7 w8\nw9\n")  # fmt: skip
    assert r.exit_code == 0, r.output
    (banner,) = [line for line in r.output.splitlines() if line.startswith("dflash-mlx chat")]
    assert "tree 12" in banner
    assert len(calls) == 2 and all(c["kwargs"]["tree_budget"] == 12 for c in calls)
    for c in calls:  # each turn the target's own greedy reply to the whole conversation
        assert c["tokens"] == greedy_reference(c["model"], c["prompt"], 10)
    assert " ".join(r.output.split()).count("tree 12: 1.00 tokens/cycle, 12.0 rows verified/cycle") == 2


def test_bench_reports_rows_verified_and_accepted_depth(pair, tmp_path, calls):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3 w1 w2\nw5 w6\n")
    r = run("bench", "--model", pair.target, "--draft-model", pair.draft, "--prompts", prompts, "-m", "12",
            "--tree-budget", "10", "--lookup", "on", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tree_budget"] == 10 and all(c["kwargs"]["tree_budget"] == 10 for c in calls)
    assert out["summary"]["identical"] is True
    for row in out["results"]:
        assert row["rows_per_cycle"] == pytest.approx(10.0)
        assert row["accepted_depth"] == pytest.approx(row["acceptance_length"] - 1)
    assert out["summary"]["accepted_depth"] > 0  # lookup finds the repeated words
    table = run("bench", "--model", pair.target, "--draft-model", pair.draft, "--prompts", prompts, "-m", "6",
                "--tree-budget", "10")  # fmt: skip
    assert table.exit_code == 0, table.output
    assert "tree 10" in table.stdout and "rows/cycle" in table.stdout and "depth" in table.stdout


def test_the_status_lines_show_the_trees():
    r = SimpleNamespace(
        block_sizes={1: 2, 8: 3, 24: 5}, cycles=10, rows_verified=3 * 8 + 5 * 24, acceptance_length=5.1,
        acceptance_rate=0.25, lookup_hits=0, auto_reason=None, block_size=24, prompt_tokens=7, prompt_tps=50.0,
        generation_tokens=42, generation_tps=20.0, peak_memory=1.5, finish_reason="stop",
    )  # fmt: skip
    assert tree_text(r, 24) == "tree 24: 5.10 tokens/cycle, 18.0 rows verified/cycle, 2 plain steps"
    assert tree_text(r, "auto").startswith("tree auto 8-24, mostly 24: 5.10 tokens/cycle")
    assert "tree 24: 5.10 tokens/cycle" in stats_line(r, tree_budget=24)
    assert "block" not in stats_line(r, tree_budget=24) and "acceptance rate 25.0%" in stats_line(r, tree_budget=24)
    assert status_text(r, tree_budget=24) == "20.0 tok/s · tree 24: 5.10 tokens/cycle · accept 25% · 1.50 GB"
    assert status_text(r, tree_budget="auto").startswith("20.0 tok/s · tree auto (24): 5.10 tokens/cycle")
    assert status_text(r, "auto", final=True, tree_budget=24).startswith("42 tokens · 20.0 tok/s · tree 24: 5.10")
    plain = SimpleNamespace(**{**vars(r), "block_sizes": {1: 4}, "cycles": 4, "rows_verified": 0})
    assert tree_text(plain, 24) == "tree 24: no drafting cycles, 4 plain steps"
    assert "block auto" in stats_line(r, "auto")  # without trees the block line as before


def test_serve_sets_the_servers_tree_budget(pair, monkeypatch):
    import dflash_mlx.server

    made = []
    real = dflash_mlx.server.create_app

    def create_app(model, draft, tokenizer, config, group=None):
        made.append(config)
        return real(model, draft, tokenizer, config, group)

    def serve_forever(app, **kwargs):  # the server would wait, then end the process
        raise SystemExit(7)

    monkeypatch.setattr(dflash_mlx.server, "create_app", create_app)
    monkeypatch.setattr(dflash_mlx.server, "run", serve_forever)
    base = ("serve", "--model", pair.chat_target, "--draft-model", pair.draft, "--port", "1")
    for value, given in [("12", 12), ("auto", "auto"), (None, None)]:
        r = run(*base, *(() if value is None else ("--tree-budget", value)))
        assert r.exit_code == 7, r.output
        assert made[-1].tree_budget == given
    refused = run(*base, "--max-kv-size", "64", "--tree-budget", "8")
    assert_user_error(refused, "cannot verify draft trees over its KV caches", "(--tree-budget auto)")
