"""The `dflash-mlx` app through Typer's CliRunner: every command, every
error a user can cause (one red sentence, exit code 1, no traceback)."""

from __future__ import annotations

import json

import pytest
from cli_fixtures import make_tiny_pair
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx import builtin, loading
from dflash_mlx.cli.app import app
from dflash_mlx.cli.progress import PrefillProgress, hub_progress_class
from dflash_mlx.targets import ADAPTERS

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("cli-models"))


@pytest.fixture(scope="module")
def loaded(pair):
    return {
        "raw": dflash_mlx.load(str(pair.target), draft=str(pair.draft)),
        "chat": dflash_mlx.load(str(pair.chat_target), draft=str(pair.draft)),
    }


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input, prog_name="dflash-mlx", env={"COLUMNS": "200"})


def assert_user_error(result, *fragments):
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert "error:" in result.stderr
    for f in fragments:
        assert f in " ".join(result.stderr.split()), (f, result.stderr)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0].strip()), result.stderr  # one line, last


def expected(loaded, kind, prompt, **kwargs):
    model, draft, tok = loaded[kind]
    return dflash_mlx.generate(model, draft, tok, prompt, **kwargs)


# -- help ---------------------------------------------------------------------
def test_root_help_lists_commands():
    for args in ([], ["--help"]):
        result = run(*args)
        assert result.exit_code == 0
        for name in ("generate", "chat", "bench", "models", "convert", "train", "version"):
            assert name in result.output


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "models", "convert", "train", "version"])
def test_every_command_help_has_examples(command):
    result = run(command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output
    assert f"dflash-mlx {command}" in result.output


def test_version():
    result = run("version")
    assert result.exit_code == 0 and result.stdout.strip() == dflash_mlx.__version__


# -- generate -----------------------------------------------------------------
def test_generate_streams_what_the_library_generates(pair, loaded):
    result = run(
        "generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1 w2 w3", "--max-tokens", 24
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == expected(loaded, "raw", "w1 w2 w3", max_tokens=24) + "\n"
    stats = result.stderr
    for part in ("generated 24 tokens", "tok/s", "acceptance length", "acceptance rate", "peak memory"):
        assert part in stats
    assert "no chat template" in stats  # the dim note for template-less tokenizers


def test_generate_sampled_with_seed_is_repeatable(pair, loaded):
    args = [
        "generate",
        "--model",
        pair.target,
        "--draft-model",
        pair.draft,
        "--prompt",
        "w5 w6",
        "-m",
        20,
        "--temp",
        0.8,
        "--top-p",
        0.9,
        "--top-k",
        20,
        "--seed",
        7,
        "--block-size",
        4,
    ]
    result = run(*args)
    assert result.exit_code == 0, result.output
    want = expected(loaded, "raw", "w5 w6", max_tokens=20, temperature=0.8, top_p=0.9, top_k=20, seed=7, block_size=4)
    assert result.stdout == want + "\n"


def test_generate_with_automatic_block_size(pair, loaded):
    result = run(
        "generate",
        "--model",
        pair.target,
        "--draft-model",
        pair.draft,
        "--prompt",
        "w1 w2",
        "-m",
        30,
        "--block-size",
        "AUTO",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == expected(loaded, "raw", "w1 w2", max_tokens=30) + "\n"  # greedy: the same text


def test_generate_applies_the_chat_template(pair, loaded):
    model, draft, tok = loaded["chat"]
    ids = tok.encode("w1 w9 w4 w2 w7 w8 w4 w3", add_special_tokens=False)  # TEMPLATE with system + user
    result = run(
        "generate",
        "--model",
        pair.chat_target,
        "--draft-model",
        pair.draft,
        "--prompt",
        "w7 w8",
        "--system-prompt",
        "w9",
        "--max-tokens",
        16,
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == dflash_mlx.generate(model, draft, tok, ids, max_tokens=16) + "\n"
    assert "no chat template" not in result.stderr

    raw = run(
        "generate",
        "--model",
        pair.chat_target,
        "--draft-model",
        pair.draft,
        "--prompt",
        "w7 w8",
        "--ignore-chat-template",
        "--max-tokens",
        16,
    )
    assert raw.exit_code == 0
    assert raw.stdout == expected(loaded, "chat", "w7 w8", max_tokens=16) + "\n"


def test_generate_enable_thinking(pair, loaded):
    model, draft, tok = loaded["chat"]
    ids = tok.encode("w2 w7 w4 w3 w5", add_special_tokens=False)
    result = run(
        "generate",
        "--model",
        pair.chat_target,
        "--draft-model",
        pair.draft,
        "--prompt",
        "w7",
        "--enable-thinking",
        "-m",
        10,
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == dflash_mlx.generate(model, draft, tok, ids, max_tokens=10) + "\n"
    assert "changes nothing" not in result.stderr
    raw = run(
        "generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w7", "--enable-thinking", "-m", 2
    )
    assert raw.exit_code == 0 and "changes nothing" in raw.stderr


def test_generate_reads_the_prompt_from_stdin(pair, loaded):
    result = run(
        "generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "-", "-m", 12, input="w3 w4\n"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == expected(loaded, "raw", "w3 w4", max_tokens=12) + "\n"


def test_generate_long_prefill_in_steps(pair, loaded):
    prompt = " ".join(f"w{i % 60}" for i in range(40))
    result = run(
        "generate",
        "--model",
        pair.target,
        "--draft-model",
        pair.draft,
        "--prompt",
        prompt,
        "-m",
        12,
        "--prefill-step-size",
        8,
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == expected(loaded, "raw", prompt, max_tokens=12) + "\n"


def test_prefill_progress_bar_only_for_several_steps(monkeypatch):
    bar = PrefillProgress()
    bar(10, 10)
    assert bar.bar is None  # one step: no bar
    bar(4, 12)
    assert bar.bar is not None
    bar(12, 12)
    assert bar.bar is None


def test_a_ctrl_c_while_the_prefill_bar_starts_leaves_it_whole(monkeypatch):
    """A press while rich starts the bar is raised once the start is done:
    raised halfway, the console's stacks broke and the bar's stop failed."""
    import os
    import signal
    import threading

    from rich.console import Console

    push = Console.push_render_hook

    def press_then_push(self, hook):
        os.kill(os.getpid(), signal.SIGINT)
        return push(self, hook)

    monkeypatch.setattr(Console, "push_render_hook", press_then_push)
    idle = threading.Event()
    other = threading.Thread(target=idle.wait)  # as chat's prefix writer: the signal may reach it
    other.start()
    try:
        bar = PrefillProgress()
        with pytest.raises(KeyboardInterrupt):
            bar(4, 12)
        bar.close()
        assert bar.bar is None
    finally:
        idle.set()
        other.join()


def test_generate_verbose_shows_the_prompt(pair):
    result = run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1", "-m", 2, "-v")
    assert result.exit_code == 0
    assert "prompt: 1 tokens" in result.stderr


# -- errors ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--temp", "-1"], ["--temp must be >= 0"]),
        (["--top-p", "1.5"], ["--top-p must be in (0, 1]"]),
        (["--top-k", "-2"], ["--top-k must be a non-negative integer"]),
        (["--block-size", "1"], ["--block-size must be an integer >= 2"]),
        (["--block-size", "fast"], ["--block-size must be an integer >= 2", "or 'auto'"]),
        (["--max-tokens", "0"], ["--max-tokens must be a positive integer"]),
        (["--max-tokens", "many"], ["Invalid value for '--max-tokens'", "dflash-mlx generate --help"]),
        (["--bogus"], ["No such option: --bogus"]),
        (["--prefill-step-size", "0"], ["--prefill-step-size must be a positive integer"]),
    ],
)
def test_generate_bad_flags(pair, extra, fragments):
    result = run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1", *extra)
    assert_user_error(result, *fragments)


def test_serve_refuses_a_bad_prefill_step_before_loading():
    assert_user_error(run("serve", "--prefill-step-size", "0"), "--prefill-step-size must be a positive integer")


def test_generate_without_model_or_prompt(pair, monkeypatch):
    from dflash_mlx import builtin

    monkeypatch.setattr(builtin, "available", lambda: False)
    assert_user_error(run("generate", "--prompt", "w1"), "no model given", "--model")
    monkeypatch.undo()
    assert_user_error(run("generate", "--model", pair.target, "--draft-model", pair.draft), "no prompt given")
    assert_user_error(
        run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "  "), "the prompt is empty"
    )
    assert_user_error(
        run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "-", input=""),
        "the prompt is empty",
    )


def test_generate_bad_paths_and_wrong_pairs(pair, tmp_path):
    missing = tmp_path / "nowhere"
    assert_user_error(run("generate", "--model", missing, "--draft-model", pair.draft, "--prompt", "w1"), str(missing))
    assert_user_error(run("generate", "--model", pair.target, "--draft-model", missing, "--prompt", "w1"), str(missing))
    # no --draft-model, and the registry knows no drafter for this target
    assert_user_error(run("generate", "--model", pair.target, "--prompt", "w1"), "drafter")
    # a target where a drafter belongs
    r = run("generate", "--model", pair.target, "--draft-model", pair.target, "--prompt", "w1")
    assert_user_error(r, "drafter")
    # a drafter made for another target
    assert_user_error(run("generate", "--model", pair.target, "--draft-model", pair.other_draft, "--prompt", "w1"))
    # a file where a directory belongs
    f = tmp_path / "model.txt"
    f.write_text("hi")
    assert_user_error(run("generate", "--model", f, "--draft-model", pair.draft, "--prompt", "w1"), "is a file")


def test_library_errors_are_one_sentence_and_verbose_shows_the_traceback(pair, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("the prompt holds token ids outside the target's vocabulary [0, 64).")

    monkeypatch.setattr(dflash_mlx, "stream_generate", broken)
    args = ["generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1"]
    assert_user_error(run(*args), "outside the target's vocabulary")
    verbose = run(*args, "--verbose")
    assert verbose.exit_code == 1
    assert "Traceback" in verbose.stderr and "error: the prompt holds" in verbose.stderr


def test_unexpected_errors_have_no_traceback_without_verbose(pair, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(dflash_mlx, "stream_generate", broken)
    result = run("generate", "--model", pair.target, "--draft-model", pair.draft, "--prompt", "w1")
    assert_user_error(result, "unexpected RuntimeError: kaboom", "--verbose")


def test_unknown_command():
    assert_user_error(run("frobnicate"), "No such command")


# -- chat (not a terminal: the pty test drives the real thing) --------------------
def test_chat_over_a_pipe(pair, loaded):
    script = "w1 w2 w3\n/stats\n/think\n/help\n/bogus\n/reset\nw1 w2 w3\n/quit\n"
    result = run("chat", "--model", pair.target, "--draft-model", pair.draft, "-m", 10, input=script)
    assert result.exit_code == 0, result.output
    want = expected(loaded, "raw", "w1 w2 w3", max_tokens=10)
    out = result.stdout
    assert out.count(want) == 2  # the same reply before and after /reset
    assert "acceptance length" in out and "block position" in out  # /stats
    assert "no thinking section" in out and "thinking on" not in out  # /think: nothing to turn on
    assert "/reset" in out and "/quit" in out  # /help
    assert "unknown command /bogus" in out
    assert "conversation cleared" in out


def test_chat_with_template_keeps_the_conversation(pair, loaded):
    model, draft, tok = loaded["chat"]
    first = dflash_mlx.generate(model, draft, tok, tok.encode("w2 w5 w4 w3", add_special_tokens=False), max_tokens=8)
    second_ids = tok.encode(f"w2 w5 w4 w3 {first} w4 w2 w6 w4 w3", add_special_tokens=False)
    second = dflash_mlx.generate(model, draft, tok, second_ids, max_tokens=8)
    result = run("chat", "--model", pair.chat_target, "--draft-model", pair.draft, "-m", 8, input="w5\nw6\n")
    assert result.exit_code == 0, result.output  # EOF ends the session cleanly
    assert first in result.stdout and second in result.stdout

    # /think switches the template's thinking section on for the next turn
    thinking_ids = tok.encode(f"w2 w5 w4 w3 {first} w4 w2 w6 w4 w3 w5", add_special_tokens=False)
    thinking = dflash_mlx.generate(model, draft, tok, thinking_ids, max_tokens=8)
    result = run("chat", "--model", pair.chat_target, "--draft-model", pair.draft, "-m", 8, input="w5\n/think\nw6\n")
    assert result.exit_code == 0, result.output
    assert "thinking on" in result.stdout and "no thinking section" not in result.stdout
    assert thinking in result.stdout


def test_chat_errors(pair, monkeypatch):
    from dflash_mlx import builtin

    assert_user_error(
        run("chat", "--model", pair.target, "--draft-model", pair.draft, "--temp", "-0.5"), "--temp must be"
    )
    # Without --model the built-in target is used, which this drafter does not fit ...
    assert_user_error(run("chat", "--draft-model", pair.draft), "does not fit the target")
    # ... and without the built-in pair there is no model at all.
    monkeypatch.setattr(builtin, "available", lambda: False)
    assert_user_error(run("chat", "--draft-model", pair.draft), "no model given")
    monkeypatch.undo()
    assert_user_error(run("chat", "--model", pair.target, "--draft-model", pair.other_draft))


# -- bench ------------------------------------------------------------------------
def test_bench_json(pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2"}\n\n{"turns": ["w3 w4", "w5"]}\n')
    result = run(
        "bench",
        "--model",
        pair.target,
        "--draft-model",
        pair.draft,
        "--prompts",
        prompts,
        "-m",
        12,
        "--block-size",
        6,
        "--json",
    )  # a fixed block: auto's choices follow the machine's timings
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["prompt"] for r in data["results"]] == ["w1 w2", "w3 w4", "w5"]  # every MT-Bench turn
    assert data["draft_model"] == str(pair.draft)
    for r in data["results"]:
        assert r["plain_tps"] > 0 and r["dflash_tps"] > 0
        assert r["speedup"] == pytest.approx(r["dflash_tps"] / r["plain_tps"])
        assert 1.0 <= r["acceptance_length"] <= data["block_size"]
        assert r["identical"] is True  # greedy DFlash is the target's own greedy decoding
        assert r["dflash_peak_memory_gb"] >= 0
    assert data["summary"]["identical"] is True
    assert data["block_size"] == 6


def test_bench_table(pair, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw4 [bold]w5\n")
    result = run(
        "bench",
        "--model",
        pair.target,
        "--draft-model",
        pair.draft,
        "--prompts",
        prompts,
        "-m",
        8,
        "--repeat",
        2,
        "--temp",
        0.7,
        "--seed",
        3,
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    for head in ("mlx-lm tok/s", "dflash tok/s", "speedup", "τ", "peak GB"):
        assert head in out
    assert "[bold]w5" in out and "all" in out
    assert "same text" not in out  # only checked when greedy


@pytest.mark.parametrize(
    "content, fragments",
    [
        (None, ["does not exist"]),
        ("", ["holds no prompts"]),
        ('{"prompt": "w1"}\n{"prompt": \n', ["line 2 is not valid JSON"]),
        ('{"answer": "w1"}\n', ["line 1 has no prompt"]),
    ],
)
def test_bench_bad_prompt_files(pair, tmp_path, content, fragments):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    result = run("bench", "--model", pair.target, "--draft-model", pair.draft, "--prompts", path)
    assert_user_error(result, *fragments)


def test_bench_bad_flags(pair):
    assert_user_error(
        run("bench", "--model", pair.target, "--draft-model", pair.draft, "--repeat", 0), "--repeat must be"
    )
    assert_user_error(
        run("bench", "--model", pair.target, "--draft-model", pair.draft, "--top-p", 0), "--top-p must be"
    )


# -- models -----------------------------------------------------------------------
def test_models_lists_pairs_what_runs_and_cache_state(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    result = run("models", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert rows[0]["builtin"] and rows[0]["target"] == "builtin"  # the built-in pair, first
    rows = rows[1:]
    assert {(r["target"], r["drafter"]) for r in rows} == set(loading.known_pairs())
    assert not any(r["target_cached"] or r["drafter_cached"] for r in rows)
    assert all(r["runs"] == (loading.FAMILIES[r["target"]] in ADAPTERS) for r in rows)
    assert all((r["why_not"] is None) == r["runs"] for r in rows)
    table = run("models")
    assert table.exit_code == 0 and "z-lab/" in table.stdout
    # A family without an adapter is marked, with the reason.
    monkeypatch.delitem(ADAPTERS, "llama")
    rows = json.loads(run("models", "--json").stdout)
    llama = next(r for r in rows if r["target"] == "meta-llama/Llama-3.1-8B-Instruct")
    assert not llama["runs"] and llama["why_not"] == "its family (llama) has no target adapter yet."
    assert "its family (llama) has no target adapter yet." in " ".join(run("models").stdout.split())
    none = run("models", "--cached")
    assert none.exit_code == 0 and "no Hub pair is fully cached" in none.stdout


def test_without_model_the_builtin_target_is_used(monkeypatch, pair, loaded):
    monkeypatch.setattr(builtin, "TARGET", pair.target)
    result = run("generate", "--draft-model", pair.draft, "--prompt", "w1 w2 w3", "-m", 6)
    assert result.exit_code == 0, result.output
    assert result.stdout == expected(loaded, "raw", "w1 w2 w3", max_tokens=6) + "\n"


def test_bench_names_the_builtin_pair_once(monkeypatch, pair):
    monkeypatch.setattr(builtin, "TARGET", pair.target)
    result = run("bench", "--draft-model", pair.draft, "-m", 2, "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("no --model given") == 1
    data = json.loads(result.stdout)
    assert data["model"] == "builtin" and data["draft_model"] == str(pair.draft)


def test_without_model_the_builtin_pair_is_used_and_named():
    from dflash_mlx import builtin, generate, load

    assert builtin.available()
    result = run("generate", "--prompt", "def add(a, b):", "--ignore-chat-template", "-m", 12)
    assert result.exit_code == 0, result.output
    assert "built-in" in result.stderr
    model, draft, tok = load("builtin")
    assert result.stdout == generate(model, draft, tok, "def add(a, b):", max_tokens=12) + "\n"


# -- downloads ----------------------------------------------------------------------
def test_hub_repo_not_cached_while_offline(pair, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    result = run("generate", "--model", "nobody/not-a-model", "--draft-model", pair.draft, "--prompt", "w1")
    assert_user_error(result, "nobody/not-a-model")


def test_download_bars_are_tasks_of_one_rich_progress():
    import time

    from huggingface_hub.utils.tqdm import _create_progress_bar, hf_thread_map
    from rich.progress import Progress

    progress = Progress(disable=True)
    cls = hub_progress_class(progress)
    transfer = _create_progress_bar(cls=cls, log_level=20, name="t", desc="Downloading bytes", total=0, unit="B")
    files = _create_progress_bar(cls=cls, log_level=20, name="f", desc="Reconstructing", total=0, unit="B")
    files.total = 100
    files.refresh()
    files.update(40)
    files.refresh()
    assert hf_thread_map(lambda x: (time.sleep(0.01), x)[1], range(4), desc="Fetching 4 files", tqdm_class=cls) == [
        0,
        1,
        2,
        3,
    ]
    assert [(t.description, t.completed, t.total) for t in progress.tasks] == [
        ("Downloading bytes", 0, 0),
        ("Reconstructing", 40, 100),
    ]
    files.update(60)
    transfer.close()
    files.close()
    files.close()
    assert progress.tasks == []


# -- chat display pieces --------------------------------------------------------------
def test_reply_view_wraps_long_lines_on_a_narrow_terminal():
    import io

    from cli_fixtures import screen_lines
    from rich.console import Console

    from dflash_mlx.cli.chat import ReplyView

    buf = io.StringIO()
    out = Console(file=buf, width=30, force_terminal=True, color_system=None, highlight=False)
    view = ReplyView(out)
    words = [f"w{i}" for i in range(60)]
    text = " ".join(words[:25]) + "\n\n" + " ".join(words[25:])
    for i in range(0, len(text), 7):
        view.add(text[i : i + 7], f"status {i}")
    view.finish()
    lines = screen_lines(buf.getvalue().replace("\n", "\r\n"))  # as a pty's onlcr would
    assert all(len(line) <= 30 for line in lines)
    assert " ".join(lines).split() == text.split()
    assert "" in lines  # the blank line of the reply survives
    assert not any(line.startswith("status") for line in lines)  # the live status is transient


def test_ctrl_c_during_a_shown_step_waits_for_the_step_to_be_shown():
    """A step's tokens and what is printed of them go together: Ctrl-C
    pressed while a piece is being shown is raised once it is shown; later
    presses in the same reply are absorbed; at the prompt Ctrl-C raises."""
    import os
    import signal

    from dflash_mlx.cli.chat import Interrupts, sigint_handled

    done = []
    stops = Interrupts()
    with sigint_handled(stops):
        stops.reply()
        stops.armed = True
        with pytest.raises(KeyboardInterrupt):
            with stops.held():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("shown")  # (not cut short)
        assert done == ["shown"]
        for _ in range(3):  # pressed again, armed or held: absorbed
            os.kill(os.getpid(), signal.SIGINT)
            with stops.held():
                os.kill(os.getpid(), signal.SIGINT)
        stops.reply()  # the next reply
        with stops.held():  # nothing pressed: nothing raised
            done.append("again")
        stops.at_prompt()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):
                pass
    assert done == ["shown", "again"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back


def test_a_ctrl_c_swallowed_where_it_was_raised_stops_the_reply_at_the_next_step():
    """The handler raises the first press at once, wherever Python happens to
    be; inside a finalizer or a weakref callback Python ignores it. The press
    still stops the reply, at the end of the next step shown, and a second
    press absorbed meanwhile changes nothing."""
    import signal

    from dflash_mlx.cli.chat import Interrupts

    stops = Interrupts()
    stops.reply()
    stops.armed = True
    try:
        stops(signal.SIGINT, None)  # raised while armed ...
    except KeyboardInterrupt:
        pass  # ... where Python ignores it
    stops(signal.SIGINT, None)  # the second press: absorbed
    with pytest.raises(KeyboardInterrupt):
        with stops.held():
            pass
    with stops.held():  # acted on once
        pass


def test_stats_chart():
    from dflash_mlx.cli.chat import SessionStats, stats_chart

    assert "no verify cycles" in stats_chart(SessionStats()).plain

    class R:
        generation_tokens, cycles, acceptance_length, accepted_by_position = 30, 10, 3.0, [10, 8, 2, 0]

    s = SessionStats()
    s.add(R())
    s.add(R())
    chart = stats_chart(s, width=10).plain.splitlines()
    assert chart[0].startswith("2 replies · 60 tokens · 20 cycles · acceptance length 3.00")
    assert chart[2:] == [
        "   1 ██████████ 100%",
        "   2 ████████··  80%",
        "   3 ██········  20%",
        "   4 ··········   0%",
    ]


def test_status_line_names_the_chosen_block():
    from types import SimpleNamespace

    from dflash_mlx.cli.status import status_text

    r = SimpleNamespace(
        cycles=3,
        prompt_tokens=5,
        prompt_tps=10.0,
        generation_tokens=12,
        generation_tps=40.0,
        acceptance_length=4.0,
        acceptance_rate=0.2,
        block_size=6,
        peak_memory=0.01,
    )
    assert "block auto (6)" in status_text(r, "auto")
    assert "block 8" in status_text(r, 8) and "block 6" in status_text(r)
