"""Ctrl-C in a chat reply stops the reply, never the session: presses after
the first are absorbed, and an error MLX raises because an interrupt broke a
compiled cycle's trace stops the reply too, the pair's traces forgotten so
that the next reply works."""

import os
import signal

import pytest
from cli_fixtures import make_tiny_pair

import dflash_mlx
from dflash_mlx.cli import chat


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    pair = make_tiny_pair(tmp_path_factory.mktemp("chat-interrupts"))
    return dflash_mlx.load(str(pair.target), draft=str(pair.draft))


def session(loaded):
    model, draft, tok = loaded
    settings = dict(temp=0.0, top_p=1.0, top_k=0, seed=None, block_size=4, system_prompt=None)
    return chat.ChatSession(
        model,
        draft,
        tok,
        model_name="tiny",
        max_tokens=12,
        ignore_chat_template=True,
        enable_thinking=False,
        prefill_step_size=2048,
        **settings,
    )


def test_an_error_after_ctrl_c_inside_a_trace_stops_only_the_reply(loaded, monkeypatch, capsys):
    model, draft, tok = loaded
    real = dflash_mlx.stream_generate
    forgotten = []
    monkeypatch.setattr("dflash_mlx.decode.traces.forget_traces", lambda d: forgotten.append(d))

    def broken(*args, **kw):
        gen = real(*args, **kw)
        yield next(gen)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # raised where MLX was tracing a cycle ...
            sum(range(1000))
        except KeyboardInterrupt:
            gen.close()
            os.kill(os.getpid(), signal.SIGINT)  # ... pressed again ...
            sum(range(1000))
            # ... and MLX's compile turned the first into its own error
            raise RuntimeError("[compile] Attempting to compile a function whose outputs are captured") from None

    s = session(loaded)
    with chat.sigint_handled(s.interrupts):
        s.interrupts.reply()
        monkeypatch.setattr(dflash_mlx, "stream_generate", broken)
        s.reply("w1 w2 w3")
        monkeypatch.setattr(dflash_mlx, "stream_generate", real)
        s.interrupts.reply()
        s.reply(" w4")  # the next reply answers
    out = capsys.readouterr().out
    assert "reply stopped" in out and forgotten == [draft]
    assert out.count("── ") == 2 and s.cache.consistent()
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    # The next reply is exactly what the kept conversation decodes.
    n2 = int([line for line in out.splitlines() if line.startswith("── ")][-1].split()[1])
    prompt = s.history[:-n2]
    assert prompt[-len(tok.encode(" w4", add_special_tokens=False)) :] == tok.encode(" w4", add_special_tokens=False)
    assert s.messages[3]["content"] == dflash_mlx.generate(model, draft, tok, prompt, max_tokens=12, block_size=4)


def test_an_error_without_ctrl_c_is_not_taken_for_one(loaded, monkeypatch):
    def failing(*args, **kw):
        raise RuntimeError("not an interrupt")
        yield

    monkeypatch.setattr(dflash_mlx, "stream_generate", failing)
    s = session(loaded)
    with chat.sigint_handled(s.interrupts):
        s.interrupts.reply()
        with pytest.raises(RuntimeError, match="not an interrupt"):
            s.reply("w1 w2")
