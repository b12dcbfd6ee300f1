"""`dflash-mlx chat`: a multi-turn terminal session with live acceptance stats.

The target's and the drafter's caches live across turns (make_prompt_cache):
every turn passes the whole conversation and only its new part is prefilled.
"""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from dflash_mlx.prompts import apply_chat_template, encode

from .console import UserError, console, user_errors
from .options import (
    BlockSize, DraftModel, EnableThinking, IgnoreChatTemplate, MaxTokens, Model, PrefillStepSize, Seed,
    SystemPrompt, Temp, TopK, TopP, Verbose, check_args,
)
from .pair import load_pair
from .progress import PrefillProgress
from .prompts import supports_thinking, thinking_note, uses_template
from .status import status_text

EXAMPLES = """\
Examples:

$ dflash-mlx chat --model Qwen/Qwen3-8B

$ dflash-mlx chat --model ./qwen3-8b --draft-model ./qwen3-8b-dflash --temp 0.6 --top-p 0.95 --enable-thinking

$ dflash-mlx chat --model Qwen/Qwen3-8B --system-prompt "Answer in one paragraph." -m 1024

In the session: /help, /reset, /stats, /think, /quit; Ctrl-C stops a reply, Ctrl-D quits.
"""

HELP = """\
/help    this list
/reset   forget the conversation (and free its caches)
/stats   acceptance by block position for this session, as a chart
/think   turn the template's thinking section on or off
/quit    leave (Ctrl-D too); Ctrl-C stops a reply and keeps the session"""

STATUS_HZ = 30


@contextmanager
def sigint_ignored():
    """Hold Ctrl-C off while the caches are being rolled back."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class ReplyView:
    """The reply on screen as it streams: finished rows are printed for good;
    the row being written and the status line live in a rich Live below."""

    def __init__(self, out: Console):
        self.out = out
        self.tail = ""
        self.status = ""
        self.live: Optional[Live] = None
        self.shown = 0.0

    def add(self, text: str, status: str) -> None:
        if self.live is None:
            self.live = Live(console=self.out, transient=True, auto_refresh=False,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start()
        self.tail += text
        rows = self._finished_rows()
        # The live part is re-drawn under every printed row, so keep it current
        # even when the status refresh below is skipped.
        self.live.update(Group(Text(self.tail), Text(status, style="dim")), refresh=False)
        for row in rows:
            self.out.print(row)
        now = time.monotonic()
        if not rows and now - self.shown >= 1 / STATUS_HZ:
            self.shown = now
            self.live.refresh()

    def _finished_rows(self) -> list[Text]:
        """Take the rows that are complete (ended by a newline, or full
        width) off the tail."""
        rows = []
        if "\n" in self.tail:
            *done, self.tail = self.tail.split("\n")
            rows += [Text(row) for row in done]
        if Text(self.tail).cell_len >= self.out.width:
            wrapped = Text(self.tail).wrap(self.out, self.out.width)
            rows += list(wrapped)[:-1]
            self.tail = wrapped[-1].plain
        return rows

    def finish(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        if self.tail:
            self.out.print(Text(self.tail))
            self.tail = ""


@dataclass
class SessionStats:
    replies: int = 0
    tokens: int = 0
    cycles: int = 0
    committed: int = 0
    by_position: list = field(default_factory=list)

    def add(self, r) -> None:
        self.replies += 1
        self.tokens += r.generation_tokens
        self.cycles += r.cycles
        self.committed += round(r.acceptance_length * r.cycles)
        counts = list(r.accepted_by_position)
        if len(counts) > len(self.by_position):
            self.by_position += [0] * (len(counts) - len(self.by_position))
        for i, c in enumerate(counts):
            self.by_position[i] += c


def stats_chart(s: SessionStats, width: int = 30) -> Text:
    """Acceptance by block position: the share of verify cycles in which the
    draft at each position was accepted, as a bar chart."""
    if s.cycles == 0:
        return Text("no verify cycles yet; ask something first.", style="dim")
    out = Text()
    out.append(
        f"{s.replies} repl{'y' if s.replies == 1 else 'ies'} · {s.tokens} tokens · {s.cycles} cycles · "
        f"acceptance length {s.committed / s.cycles:.2f}\n", style="bold"
    )
    out.append("draft accepted, by block position (share of cycles)\n", style="dim")
    for i, c in enumerate(s.by_position):
        frac = c / s.cycles
        filled = round(frac * width)
        out.append(f"{i + 1:>4} ")
        out.append("█" * filled, style="green")
        out.append("·" * (width - filled), style="dim")
        out.append(f" {frac:4.0%}\n")
    out.rstrip()
    return out


class ChatSession:
    def __init__(self, model, draft, tokenizer, *, model_name: str, max_tokens: int, temp: float, top_p: float,
                 top_k: int, seed: Optional[int], block_size: int | str | None, system_prompt: Optional[str],
                 ignore_chat_template: bool, enable_thinking: bool, prefill_step_size: int):
        from dflash_mlx import make_prompt_cache

        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.model_name = model_name
        self.sampling = dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k,
                             block_size=block_size, seed=seed, prefill_step_size=prefill_step_size)
        self.block_size = block_size or "auto"
        self.system_prompt = system_prompt
        self.template = uses_template(tokenizer, ignore_chat_template)
        self.thinking = enable_thinking
        self._make_cache = lambda: make_prompt_cache(model, draft)
        self.reset()

    def reset(self) -> None:
        self.cache = self._make_cache()
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt and self.template else []
        self.history: list[int] = []
        self.stats = SessionStats()

    # -- one turn --------------------------------------------------------------
    def prompt_for(self, text: str) -> list[int]:
        if self.template:
            messages = self.messages + [{"role": "user", "content": text}]
            return apply_chat_template(self.tokenizer, messages, enable_thinking=self.thinking)
        if not self.history:
            return encode(self.tokenizer, text)
        return self.history + self.tokenizer.encode(text, add_special_tokens=False)

    def reply(self, text: str) -> None:
        from dflash_mlx import stream_generate

        ids = self.prompt_for(text)
        progress = PrefillProgress()
        view = ReplyView(console)
        tokens: list[int] = []
        pieces: list[str] = []
        last = None
        interrupted = False
        gen = stream_generate(self.model, self.draft, self.tokenizer, ids, prompt_cache=self.cache,
                              prompt_progress=progress, **self.sampling)
        try:
            try:
                for last in gen:
                    tokens += last.tokens
                    pieces.append(last.text)
                    view.add(last.text, status_text(last))
            except KeyboardInterrupt:
                interrupted = True
            with sigint_ignored():
                # Closing the generator rolls the caches back to what was committed.
                gen.close()
                progress.close()
                if interrupted:
                    # The streaming detokenizer may hold back the end of the text.
                    rest = self._unshown(tokens, "".join(pieces))
                    if rest:
                        pieces.append(rest)
                        view.add(rest, "")
                view.finish()
        except KeyboardInterrupt:  # pressed again before the tidy-up began
            interrupted = True
            gen.close()
            view.finish()
        if not self.cache.consistent():
            # Never expected (the cache settles itself on any interrupt); said
            # aloud so that a test or a user would see it.
            console.print(Text("(prompt cache rebuilt)", style="dim"))
            self.cache = self._make_cache()
        reply = "".join(pieces)
        if tokens:
            if self.template:
                self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
            else:
                self.history = ids + tokens
        if last is not None:
            self.stats.add(last)
        if interrupted:
            console.print(Text("⏹ reply stopped", style="yellow"))
        if last is not None:
            limit = " · reached --max-tokens" if last.finish_reason == "length" else ""
            console.print(Text("── " + status_text(last, self.block_size, final=True) + limit, style="dim"))

    def _unshown(self, tokens: list[int], shown: str) -> str:
        eos = set(getattr(self.tokenizer, "eos_token_ids", ()))
        full = self.tokenizer.decode([t for t in tokens if t not in eos])
        return full[len(shown):] if full.startswith(shown) else ""

    # -- the loop --------------------------------------------------------------
    def banner(self) -> None:
        mode = "chat template" if self.template else "raw text (no chat template)"
        thinking = ", thinking on" if self.thinking else ""
        console.print(Text(f"dflash-mlx chat · {self.model_name} · block {self.block_size} · {mode}{thinking}", style="bold"))
        console.print(Text("/help for commands · Ctrl-C stops a reply · Ctrl-D or /quit leaves", style="dim"))

    def command(self, line: str) -> bool:
        """Run a /command; False when the session should end."""
        name = line.split()[0].lower()
        if name in ("/quit", "/exit", "/q"):
            return False
        if name == "/help":
            console.print(Text(HELP, style="dim"))
        elif name == "/reset":
            self.reset()
            console.print(Text("conversation cleared", style="dim"))
        elif name == "/stats":
            console.print(stats_chart(self.stats))
        elif name == "/think":
            if not (self.template and supports_thinking(self.tokenizer)):
                console.print(Text("this model's chat template has no thinking section.", style="dim"))
            self.thinking = not self.thinking
            console.print(Text(f"thinking {'on' if self.thinking else 'off'}", style="dim"))
        else:
            console.print(Text(f"unknown command {name}; /help lists the commands.", style="yellow"))
        return True

    def run(self) -> None:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        tty = sys.stdout.isatty()
        prompt = "\001\033[1;32m\002>>> \001\033[0m\002" if tty else ">>> "
        self.banner()
        while True:
            try:
                line = input(prompt).strip()
            except EOFError:
                console.print()
                return
            except KeyboardInterrupt:
                console.print()
                console.print(Text("(Ctrl-D or /quit to leave)", style="dim"))
                continue
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.reply(line)


def chat_command(
    model: Model = None,
    draft_model: DraftModel = None,
    max_tokens: MaxTokens = 512,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    block_size: BlockSize = None,
    system_prompt: SystemPrompt = None,
    ignore_chat_template: IgnoreChatTemplate = False,
    enable_thinking: EnableThinking = False,
    prefill_step_size: PrefillStepSize = 2048,
    verbose: Verbose = False,
):
    """Chat with a model in the terminal, with live DFlash stats.

    Replies stream token by token above a status line (tok/s, acceptance
    length and rate, block size, memory). The caches are kept across turns,
    so a follow-up does not re-read the conversation.
    """
    with user_errors(verbose):
        block_size = check_args(max_tokens, temp, top_p, top_k, block_size)
        if prefill_step_size < 1:
            raise UserError(f"--prefill-step-size must be positive, got {prefill_step_size}.")
        target, draft, tokenizer = load_pair(model, draft_model)
        thinking_note(tokenizer, enable_thinking, ignore_chat_template)
        if not ignore_chat_template and not uses_template(tokenizer, False):
            console.print(Text("the tokenizer has no chat template; turns are joined as raw text.", style="dim"))
        session = ChatSession(
            target, draft, tokenizer, model_name=str(model or "built-in model"), max_tokens=max_tokens, temp=temp,
            top_p=top_p, top_k=top_k, seed=seed, block_size=block_size, system_prompt=system_prompt,
            ignore_chat_template=ignore_chat_template, enable_thinking=enable_thinking,
            prefill_step_size=prefill_step_size,
        )
        session.run()
