"""`dflash-mlx chat` driven in a real pseudo-terminal: two turns, /stats,
/reset, /quit, and a Ctrl-C mid-reply that keeps the session. What the
user sees (replayed through a small terminal emulator) must be exactly
what dflash_mlx.generate produces for the same prompt and seed."""

from __future__ import annotations

import os
import sys

import pexpect
import pytest
from cli_fixtures import make_tiny_pair, screen_lines

import dflash_mlx

PROMPT = ">>> "


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pty-models"))


def spawn(pair, *flags):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TERM="xterm-256color", PYTHONUNBUFFERED="1")
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    args = [
        "-m",
        "dflash_mlx.cli.app",
        "chat",
        "--model",
        str(pair.target),
        "--draft-model",
        str(pair.draft),
        *map(str, flags),
    ]
    child = pexpect.spawn(sys.executable, args, env=env, dimensions=(40, 400), encoding="utf-8", timeout=60)
    log = []

    class Tee:
        def write(self, s):
            log.append(s)

        def flush(self):
            pass

    child.logfile_read = Tee()
    return child, log


def reply_after(lines: list[str], user_text: str, nth: int = 0) -> str:
    """The reply printed after the nth '>>> user_text' line, up to the stats line."""
    starts = [i for i, line in enumerate(lines) if line == PROMPT + user_text]
    i = starts[nth] + 1
    out = []
    while not lines[i].startswith("──"):
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def test_two_turns_stats_reset_quit(pair):
    model, draft, tok = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    sampling = dict(max_tokens=24, temperature=0.7, top_p=0.95, seed=11)
    first_ids = tok.encode("w1 w2 w3")
    first_tokens = []
    first = ""
    for r in dflash_mlx.stream_generate(model, draft, tok, first_ids, **sampling):
        first += r.text
        first_tokens += r.tokens
    # Turn two extends the whole conversation (no chat template: raw tokens).
    second_ids = first_ids + first_tokens + tok.encode("w4 w5", add_special_tokens=False)
    second = dflash_mlx.generate(model, draft, tok, second_ids, **sampling)

    child, log = spawn(pair, "--max-tokens", 24, "--temp", 0.7, "--top-p", 0.95, "--seed", 11)
    child.expect_exact(PROMPT)
    child.sendline("w1 w2 w3")
    child.expect_exact("── ")
    child.expect_exact(PROMPT)
    child.sendline("w4 w5")
    child.expect_exact("── ")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect_exact("block position")
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact("conversation cleared")
    child.expect_exact(PROMPT)
    child.sendline("w1 w2 w3")  # after /reset, the first turn again
    child.expect_exact("── ")
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    lines = screen_lines("".join(log))
    assert reply_after(lines, "w1 w2 w3", 0) == first
    assert reply_after(lines, "w4 w5") == second
    assert reply_after(lines, "w1 w2 w3", 1) == first
    text = "\n".join(lines)
    assert "2 replies · 48 tokens" in text  # /stats covers the session so far
    assert text.count("tok/s · τ") >= 3  # the final status line of each reply
    assert "Traceback" not in text


def stopped_reply(lines: list[str], user_text: str) -> tuple[str, int]:
    """The text of a reply stopped with Ctrl-C, and its token count."""
    start = lines.index(PROMPT + user_text) + 1
    end = next(i for i in range(start, len(lines)) if "reply stopped" in lines[i])
    assert lines[end + 1].startswith("── ")
    return "\n".join(lines[start:end]), int(lines[end + 1].split()[1])


def test_ctrl_c_stops_the_reply_and_keeps_the_session(pair):
    child, log = spawn(pair, "--max-tokens", 100000, "--block-size", 4)
    for text in ("w1 w2 w3", "w4 w5"):
        child.expect_exact(PROMPT)
        child.sendline(text)
        child.expect_exact("tok/s · τ")  # the live status line: the reply is streaming
        child.sendintr()
        child.expect_exact("reply stopped")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect_exact("2 replies · ")
    child.expect_exact(PROMPT)
    child.sendintr()  # Ctrl-C at the prompt only reminds how to leave
    child.expect_exact("Ctrl-D or /quit")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    lines = screen_lines("".join(log))
    assert "Traceback" not in "\n".join(lines)
    assert "prompt cache rebuilt" not in "\n".join(lines)  # the cache settles itself after Ctrl-C
    # What was shown is exactly what was committed: greedy decoding cut at that many tokens ...
    model, draft, tok = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    first, n1 = stopped_reply(lines, "w1 w2 w3")
    assert 0 < n1 < 100000
    first_ids = tok.encode("w1 w2 w3")
    assert first == dflash_mlx.generate(model, draft, tok, first_ids, max_tokens=n1, block_size=4)
    # ... and the next turn continues from the stopped conversation, caches intact.
    second, n2 = stopped_reply(lines, "w4 w5")
    second_ids = first_ids + tok.encode(first, add_special_tokens=False) + tok.encode("w4 w5", add_special_tokens=False)
    assert len(second_ids) == len(first_ids) + n1 + 2
    assert second == dflash_mlx.generate(model, draft, tok, second_ids, max_tokens=n2, block_size=4)


def test_a_paste_is_one_message_and_typed_ahead_keys_are_not_echoed(pair):
    model, draft, tok = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    child, log = spawn(pair, "--max-tokens", 12, "--block-size", 4)
    child.expect_exact(PROMPT)
    child.send("\x1b[200~w1 w2\nw3\x1b[201~\r")  # a bracketed paste of two lines, then Enter
    child.expect_exact("── ")
    child.expect_exact(PROMPT)
    child.send("w4 w5\nw6\n")  # an unbracketed paste: both lines arrive at once
    child.expect_exact("── ")
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    text = "\n".join(screen_lines("".join(log)))
    assert text.count("── ") == 2 and "Traceback" not in text  # two messages, two replies
    first_ids = tok.encode("w1 w2\nw3")
    first = []
    for r in dflash_mlx.stream_generate(model, draft, tok, first_ids, max_tokens=12, block_size=4):
        first += r.tokens
    assert dflash_mlx.generate(model, draft, tok, first_ids, max_tokens=12, block_size=4) in text
    second_ids = first_ids + first + tok.encode("w4 w5\nw6", add_special_tokens=False)
    assert dflash_mlx.generate(model, draft, tok, second_ids, max_tokens=12, block_size=4) in text

    child, log = spawn(pair, "--max-tokens", 200, "--block-size", 4)
    child.expect_exact(PROMPT)
    child.sendline("w1 w2 w3")
    child.expect_exact("tok/s · τ")  # streaming
    child.send("qqq")  # typed while the reply streams
    child.expect_exact("── ")
    child.expect_exact(PROMPT)
    child.expect_exact("qqq")  # ... waiting at the next prompt
    child.sendline(" w4")
    child.expect_exact("── ")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    raw = "".join(log)
    assert "qqq" not in raw[raw.index("w1 w2 w3") : raw.index("── ")]  # the terminal did not echo them into the reply
    assert PROMPT + "qqq w4" in screen_lines(raw)


def quiet_at_the_prompt(child) -> None:
    """The prompt, and no more output for half a second: a press that lands at
    the prompt prints a reminder and the prompt again, and drops a line typed
    before it is handled (as a shell does)."""
    child.expect_exact(PROMPT)
    while True:
        try:
            child.expect_exact(PROMPT, timeout=0.5)
        except pexpect.TIMEOUT:
            return


def test_a_second_ctrl_c_early_in_a_reply_stops_only_the_reply(pair):
    import time

    child, log = spawn(pair, "--max-tokens", 100000, "--block-size", 4)
    child.expect_exact(PROMPT)
    # MLX's CPU backend probes its compiler once a process, through system(), which ignores
    # SIGINT while it runs (a press then is lost): a first reply past its first cycles does it.
    child.sendline("w5 w4")
    child.expect_exact("tok/s · τ")
    child.sendintr()
    child.expect_exact("reply stopped")
    quiet_at_the_prompt(child)
    stopped = 0
    for k in range(8):
        text = f"w{k % 5 + 1} w2"
        child.sendline(text)
        child.expect_exact(text + "\r\n")  # the line is read: the reply begins
        time.sleep(0.03 + 0.01 * k)  # past the 20 ms paste check: the prefill, first cycles, compile
        child.sendintr()
        time.sleep(0.05)
        child.sendintr()
        # (on a loaded machine a press can land before the reply starts: the turn is dropped, as at the prompt)
        stopped += child.expect_exact(["reply stopped", "Ctrl-D or /quit to leave"]) == 0
        quiet_at_the_prompt(child)
    assert stopped >= 4
    child.sendline("/stats")  # the session is still there ...
    child.expect_exact("block position")
    child.expect_exact(PROMPT)
    child.sendline("w3 w4")  # ... and the next turn answers
    child.expect_exact("tok/s · τ")
    child.sendintr()
    child.expect_exact("reply stopped")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    text = "\n".join(screen_lines("".join(log)))
    assert "Traceback" not in text and "error" not in text.lower()
