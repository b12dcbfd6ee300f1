"""`dflash-mlx chat`: a multi-turn terminal session with live acceptance stats.

The target's and the drafter's caches live across turns (make_prompt_cache):
every turn passes the whole conversation and only its new part is prefilled.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from dflash_mlx.prompts import apply_chat_template, encode

from . import options
from .cache_prompt import check_rank_files, open_cache, rank_file, read_cache_file
from .console import UserError, console, refuse_across_ranks, sigint_handled, speak_on_first_rank_only, user_errors
from .option_groups import Kv, Pair, Sampling, Template, check_drafter_block, check_trees, flags, takes_groups
from .pair import room_for_reply
from .progress import PrefillProgress
from .prompt_input import supports_thinking, uses_template
from .serve import PrefixCacheDir, PrefixCacheGB, check_prefix_cache
from .status import status_text

EXAMPLES = """\
Examples:

$ dflash-mlx chat --model Qwen/Qwen3-8B

$ dflash-mlx chat --model ./qwen3-8b --draft-model ./qwen3-8b-dflash --temp 0.6 --top-p 0.95 --enable-thinking

$ dflash-mlx chat --model Qwen/Qwen3-8B --system-prompt "Answer in one paragraph." -m 1024

$ dflash-mlx chat --resume talk.json

In the session: /help, /reset, /stats, /think, /save FILE, /quit; a line ending in \\ continues on the next line
(a paste is one message); Ctrl-C stops a reply, Ctrl-D quits. Without --model the built-in pair runs.
"""

HELP = """\
/help    this list
/reset   forget the conversation (and free its caches)
/stats   acceptance by block position (a tree's depth) for this session, as a chart
/think   turn the template's thinking section on or off
/save F  write the conversation to the file F (JSON); chat --resume F continues it
/quit    leave (Ctrl-D too); Ctrl-C stops a reply and keeps the session
A line ending in \\ continues the message on the next line; a paste is one message."""

STATUS_HZ = 30
CONVERSATION_FORMAT = "dflash-mlx chat"


@contextmanager
def keys_not_echoed():
    """Keys typed while a reply streams are not echoed into it; they wait in
    the terminal's buffer and show up at the next prompt (Ctrl-C still works)."""
    try:
        import termios

        fd = sys.stdin.fileno()
        if not os.isatty(fd):
            raise OSError
        old = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError):
        yield
        return
    new = list(old)
    new[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, new)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)


def _more_pasted() -> bool:
    """Whether more input is already waiting (the rest of a paste)."""
    try:
        return bool(select.select([sys.stdin], [], [], 0.02)[0])
    except (OSError, ValueError):
        return False


def read_message(prompt: str, tty: bool) -> str:
    """One message: a line, lines joined while each ends in a backslash, and
    on a terminal the lines of a paste (bracketed paste arrives whole; the
    lines of an unbracketed one are already waiting when the first is read)."""
    lines = []
    line = input(prompt)
    while True:
        if line.endswith("\\"):
            lines.append(line[:-1])
            line = input("... ")
            continue
        lines.append(line)
        if not (tty and _more_pasted()):
            break
        line = input("")
    return "\n".join(lines)


def save_conversation(path: Path, messages: list[dict], tokens: Optional[list[int]], model: str) -> None:
    data = {"format": CONVERSATION_FORMAT, "model": model, "messages": messages}
    if tokens is not None:
        data["tokens"] = tokens
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def load_conversation(path: Path) -> dict:
    """A conversation written by /save: its messages (and, for raw-text
    models, the token ids)."""
    how = "pass a file written by /save in dflash-mlx chat."
    if not path.is_file():
        raise UserError(
            f"the conversation file {path} {'is a directory' if path.is_dir() else 'does not exist'}; {how}"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is not a JSON conversation; {how}") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise UserError(f"{path} holds no list of messages with a role and a content; {how}")
    tokens = data.get("tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
        raise UserError(f"{path} has token ids that are not integers; {how}")
    return {"messages": messages, "tokens": tokens}


class Interrupts:
    """The session's Ctrl-C. At the prompt it raises KeyboardInterrupt as
    usual. During a reply the first press stops the reply: raised at once
    while ``armed`` (the generator is running), or once the step being shown
    is done (``held``); every later press is absorbed until the prompt is
    back, so that a second press never ends the session. A press that the
    handler raised where Python ignores exceptions (a finalizer, a weakref
    callback) is raised again at the next step's end."""

    def __init__(self):
        self.replying = False
        self.armed = False
        self.pressed = False
        self.raised = False  # by the handler, wherever the press landed
        self.stopped = False  # by check(), in the reply's own frames: it reaches the reply

    def __call__(self, *_):
        if not self.replying:
            raise KeyboardInterrupt
        self.pressed = True
        if self.armed and not self.raised:
            self.raised = True
            raise KeyboardInterrupt

    def at_prompt(self) -> None:
        self.replying = False

    def reply(self) -> None:
        self.pressed = self.raised = self.stopped = self.armed = False
        self.replying = True

    def check(self) -> None:
        """Raise a press not yet acted on (once a reply). Called only where no
        KeyboardInterrupt is on its way out, so a press the handler raised
        before this point was swallowed and is raised here."""
        if self.pressed and not self.stopped:
            self.raised = self.stopped = True
            raise KeyboardInterrupt

    @contextmanager
    def held(self):
        """A step's tokens, its text and what is printed of it go together:
        an interrupt never leaves on screen a part of a piece whose tokens
        were committed; a press here is raised once the block ends."""
        self.armed = False
        try:
            yield
        finally:
            self.armed = True
        self.check()


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
            self.live = Live(
                console=self.out, transient=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False
            )
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
        """Count ``r``'s drafting cycles only: acceptance says nothing of plain steps."""
        drafting = r.cycles - (getattr(r, "block_sizes", None) or {}).get(1, 0)
        self.replies += 1
        self.tokens += r.generation_tokens
        self.cycles += drafting
        self.committed += round(r.acceptance_length * drafting)
        counts = list(r.accepted_by_position)
        if len(counts) > len(self.by_position):
            self.by_position += [0] * (len(counts) - len(self.by_position))
        for i, c in enumerate(counts):
            self.by_position[i] += c


def stats_chart(s: SessionStats, width: int = 30) -> Text:
    """Acceptance by block position: the share of verify cycles in which the
    draft at each position was accepted, as a bar chart."""
    if s.cycles == 0 and s.replies:
        return Text("no drafting cycles yet: every step was a plain target step.", style="dim")
    if s.cycles == 0:
        return Text("no verify cycles yet; ask something first.", style="dim")
    out = Text()
    out.append(
        f"{s.replies} repl{'y' if s.replies == 1 else 'ies'} · {s.tokens} tokens · {s.cycles} cycles · "
        f"acceptance length {s.committed / s.cycles:.2f}\n",
        style="bold",
    )
    out.append("draft accepted, by block position or tree depth (share of cycles)\n", style="dim")
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
    def __init__(
        self,
        model,
        draft,
        tokenizer,
        *,
        model_name: str,
        system_prompt: Optional[str],
        ignore_chat_template: bool,
        enable_thinking: bool,
        prefill_step_size: int,
        template_kwargs: Optional[dict] = None,
        cache_file: Optional[Path] = None,
        prefix: str = "",
        kv: Kv = Kv(),
        prefix_cache_dir: Optional[Path] = None,
        prefix_cache_gb: float = 20.0,
        group=None,
        **sampling,
    ):
        """``sampling``: Sampling's flags (max_tokens, temp, ..., block_size
        checked already), their defaults where left out. ``group``: the ranks
        (distributed.world()) the target is split across, None alone."""
        from dflash_mlx import make_prompt_cache

        flags = Sampling(**sampling)
        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.model_name = model_name
        self.max_tokens = flags.max_tokens
        self.sampling = flags.generation(flags.block_size, prefill_step_size)
        self.block_size = flags.block_size or "auto"
        self.system_prompt = system_prompt
        self.template = uses_template(tokenizer, ignore_chat_template)
        self.template_kwargs = dict(template_kwargs or {})
        self.thinking = bool(self.template_kwargs.pop("enable_thinking", enable_thinking))
        self.prefix = prefix
        self.cache_file = cache_file
        self.kv = kv
        from dflash_mlx.distributed import is_first_rank

        self.interrupts = Interrupts()
        self.group = group
        self.first = is_first_rank(group)  # reads the user's lines and writes files
        self._make_cache = lambda: kv.cache(model, draft) or make_prompt_cache(model, draft)
        self.prefix_store = None
        if prefix_cache_dir is not None:
            from dflash_mlx.cache.store import PrefixStore

            try:
                self.prefix_store = PrefixStore(prefix_cache_dir, int(prefix_cache_gb * 1e9), self._make_cache)
            except ValueError as e:
                raise UserError(options.flag_names(str(e))) from None
        self.reset()
        # the trees shown in the status lines (None: blocks)
        self.tree_budget = check_trees(self.sampling["tree_budget"], model, draft, self.cache)

    def reset(self) -> None:
        if self.cache_file is not None:
            from dflash_mlx.cache.files import load_prompt_cache

            try:
                self.cache, _ = load_prompt_cache(self.cache_file, self.model, self.draft, *self.kv.quantization)
            except ValueError as e:
                raise ValueError(options.flag_names(str(e))) from None
        else:
            self.cache = self._make_cache()
        self.messages = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt and self.template else []
        )
        self.history: list[int] = []
        self.stats = SessionStats()

    def resume(self, conversation: dict) -> None:
        """Continue a conversation saved by /save: its messages (the caches are
        rebuilt from them on the next turn)."""
        self.messages = list(conversation["messages"])
        if not self.template:
            tokens = conversation.get("tokens")
            if tokens is None and self.messages:
                tokens = encode(self.tokenizer, self.messages[0]["content"])
                for m in self.messages[1:]:
                    tokens += self.tokenizer.encode(m["content"], add_special_tokens=False)
            self.history = list(tokens or [])
        for m in self.messages:
            who = {"user": ">>> ", "assistant": "", "system": "system: "}[m["role"]]
            console.print(Text(who + m["content"], style="dim"))
        turns = sum(m["role"] == "user" for m in self.messages)
        console.print(
            Text(f"(resumed {turns} turn{'s' if turns != 1 else ''}; the next reply re-reads them)", style="dim")
        )

    def save(self, path: Path) -> None:
        save_conversation(path, self.messages, None if self.template else self.history, self.model_name)

    # -- one turn --------------------------------------------------------------
    def prompt_for(self, text: str) -> list[int]:
        if self.template:
            messages = self.messages + [{"role": "user", "content": text}]
            return apply_chat_template(self.tokenizer, messages, enable_thinking=self.thinking, **self.template_kwargs)
        if not self.history:
            return encode(self.tokenizer, text)
        return self.history + self.tokenizer.encode(text, add_special_tokens=False)

    def reply(self, text: str) -> None:
        from dflash_mlx import stream_generate

        first = not any(m["role"] == "user" for m in self.messages)
        if first:
            text = self.prefix + text  # a prompt-cache file's prefix opens the first message
        ids = self.prompt_for(text)
        try:
            bounded = self.kv.max_kv_size is not None
            max_tokens, limit = room_for_reply(self.model, len(ids), self.max_tokens, bounded=bounded)
        except UserError as e:
            console.print(Text(str(e), style="yellow"))
            return
        if first and self.cache_file is not None:
            loaded = open_cache(self.cache_file, self.model, self.draft, ids, self.kv.quantization)
            self.cache = self.kv.cache(self.model, self.draft, loaded)
        if self.prefix_store is not None:  # an earlier session's cache holding more of this prompt
            self.cache = self.prefix_store.load_longer(ids, self.cache) or self.cache
        progress = PrefillProgress()
        view = ReplyView(console)
        tokens: list[int] = []
        pieces: list[str] = []
        last = None
        interrupted = False
        gen = stream_generate(
            self.model,
            self.draft,
            self.tokenizer,
            ids,
            prompt_cache=self.cache,
            prompt_progress=progress,
            max_tokens=max_tokens,
            **self.sampling,
        )
        stops = self.interrupts
        try:
            with keys_not_echoed():
                try:
                    stops.armed = True
                    stops.check()  # pressed while the reply was being set up
                    for last in gen:
                        with stops.held():
                            tokens += last.tokens
                            pieces.append(last.text)
                            view.add(last.text, status_text(last, tree_budget=self.tree_budget))
                finally:
                    stops.armed = False  # from here on, presses are absorbed
        except KeyboardInterrupt:
            interrupted = True
        except Exception:
            # An interrupt inside a compiled cycle's trace can leave MLX's
            # compile state broken (an error then, or at the next call).
            if not stops.pressed:
                raise
            interrupted = True
        # Closing the generator rolls the caches back to what was committed.
        gen.close()
        progress.close()
        if interrupted:
            # The streaming detokenizer may hold back the end of the text.
            rest = self._unshown(tokens, "".join(pieces))
            if rest:
                pieces.append(rest)
                view.add(rest, "")
            # Traces made while Ctrl-C was raised may be half built: the next
            # reply traces its cycles afresh.
            from dflash_mlx.decode.traces import forget_traces

            forget_traces(self.draft)
        view.finish()
        if not self.cache.consistent():
            # Never expected (the cache settles itself on any interrupt); said
            # aloud so that a test or a user would see it.
            console.print(Text("(prompt cache rebuilt)", style="dim"))
            self.cache = self._make_cache()
        elif self.prefix_store is not None:
            self.prefix_store.save(self.cache)  # written by the store's thread while the user reads
        reply = "".join(pieces)
        if tokens:
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
            if not self.template:
                self.history = ids + tokens
        self._keep_first_ranks_turn()
        if last is not None:
            self.stats.add(last)
        if interrupted:
            console.print(Text("⏹ reply stopped", style="yellow"))
        if last is not None:
            cut = f" · cut at {limit}" if last.finish_reason == "length" else ""
            status = status_text(last, self.block_size, final=True, tree_budget=self.tree_budget)
            console.print(Text("── " + status + cut, style="dim"))
            if last.finish_reason == "length" and max_tokens < self.max_tokens:
                console.print(
                    Text(
                        "the conversation has reached the target's context length; /save it and /reset to go on.",
                        style="yellow",
                    )
                )

    def _keep_first_ranks_turn(self) -> None:
        """Across ranks, rank 0's record of the turn on every rank: an
        interrupted reply ends on every rank after the same cycle, but only
        rank 0 stops showing tokens before it, and the next prompt is built
        from what was shown."""
        if self.group is not None:
            from dflash_mlx.distributed import share_from_first_rank

            self.messages, self.history = share_from_first_rank((self.messages, self.history), self.group)

    def _unshown(self, tokens: list[int], shown: str) -> str:
        eos = set(getattr(self.tokenizer, "eos_token_ids", ()))
        full = self.tokenizer.decode([t for t in tokens if t not in eos])
        return full[len(shown) :] if full.startswith(shown) else ""

    # -- the loop --------------------------------------------------------------
    def banner(self) -> None:
        mode = "chat template" if self.template else "raw text (no chat template)"
        thinking = ", thinking on" if self.thinking else ""
        drafting = f"block {self.block_size}" if self.tree_budget is None else f"tree {self.tree_budget}"
        console.print(Text(f"dflash-mlx chat · {self.model_name} · {drafting} · {mode}{thinking}", style="bold"))
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
        elif name == "/save":
            where = line[len(name) :].strip()
            if not where:
                console.print(Text("/save needs a file name, e.g. /save talk.json", style="yellow"))
                return True
            try:
                if self.first:  # (every rank holds the same conversation)
                    self.save(Path(where).expanduser())
            except OSError as e:
                console.print(Text(f"cannot write {where}: {e.strerror}; check the path.", style="yellow"))
                return True
            console.print(
                Text(f"saved {len(self.messages)} messages to {where}; chat --resume {where} continues", style="dim")
            )
        elif name == "/think":
            if not (self.template and supports_thinking(self.tokenizer)):
                console.print(
                    Text("this model's chat template has no thinking section; /think changes nothing.", style="dim")
                )
                return True
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
        # Across ranks rank 0 alone reads and takes Ctrl-C; a stop reaches the others through the cycle.
        handler = self.interrupts if self.first else signal.SIG_IGN
        try:
            with sigint_handled(handler):
                self._loop(prompt, tty)
        finally:
            if self.prefix_store is not None:
                self.prefix_store.close()  # the last turn's cache reaches the disk

    def _loop(self, prompt: str, tty: bool) -> None:
        while True:
            line = self._next_line(prompt, tty)
            if line is None:
                return
            if not line:
                continue
            if line.startswith("/") and "\n" not in line:
                if not self.command(line):
                    return
                continue
            self.reply(line)

    def _next_line(self, prompt: str, tty: bool) -> Optional[str]:
        """The next message or command, None once the user leaves; across
        ranks rank 0's, on every rank."""
        line = self._read_line(prompt, tty) if self.first else None
        if self.group is None:
            return line
        from dflash_mlx.distributed import share_from_first_rank

        return share_from_first_rank(line, self.group)

    def _read_line(self, prompt: str, tty: bool) -> Optional[str]:
        while True:
            try:
                self.interrupts.at_prompt()
                line = read_message(prompt, tty).strip()
                self.interrupts.reply()  # from here a press stops at most a reply
                return line
            except EOFError:
                console.print()
                return None
            except KeyboardInterrupt:
                self.interrupts.reply()  # a press while the reminder prints is absorbed
                console.print()
                console.print(Text("(Ctrl-D or /quit to leave)", style="dim"))


@takes_groups
def chat_command(
    *,
    pair: Pair = flags(Pair),
    sampling: Sampling = flags(Sampling, max_tokens=512),
    system_prompt: options.SystemPrompt = None,
    template: Template = flags(Template),
    adapter_path: options.AdapterPath = None,
    trust_remote_code: options.TrustRemoteCode = False,
    prompt_cache_file: options.PromptCacheFile = None,
    resume: Annotated[
        Optional[Path],
        typer.Option("--resume", help="Continue a conversation saved with /save FILE.", show_default=False),
    ] = None,
    prefill_step_size: options.PrefillStepSize = 2048,
    kv: Kv = flags(Kv),
    prefix_cache_dir: PrefixCacheDir = None,
    prefix_cache_gb: PrefixCacheGB = 20.0,
    split: options.Split = "auto",
    verbose: options.Verbose = False,
):
    """Chat with a model in the terminal, with live DFlash stats.

    Replies stream token by token above a status line (tok/s, acceptance
    length and rate, block size, memory). The caches are kept across turns,
    so a follow-up does not re-read the conversation. Leaving out --model
    uses the built-in pair.
    """
    from dflash_mlx import distributed

    group = distributed.world()
    speak_on_first_rank_only(group)
    with user_errors(verbose):
        refuse_across_ranks(group, **{"--prefix-cache-dir": prefix_cache_dir})
        check_rank_files(prompt_cache_file, group)
        prompt_cache_file = rank_file(prompt_cache_file, group)
        generation = sampling.check(prefill_step_size, drafter=pair.draft_model != "none")
        block_size = generation["block_size"]
        kwargs = template.kwargs()
        kv.check(prompt_cache_file)
        check_prefix_cache(prefix_cache_dir, prefix_cache_gb)
        conversation = None if resume is None or group is not None and group.rank() else load_conversation(resume)
        if group is not None:  # the file is on rank 0's machine
            conversation = distributed.share_from_first_rank(conversation, group)
        prefix = ""
        if prompt_cache_file is not None:
            cached = read_cache_file(prompt_cache_file)
            prefix, system_prompt = cached["prompt"], system_prompt or cached["system_prompt"]
            kwargs = kwargs or cached["template_kwargs"]
        if group is None:
            target, draft, tokenizer = pair.load(adapter_path=adapter_path, trust_remote_code=trust_remote_code)
        else:
            target, draft, tokenizer = pair.load_split(
                group, split, adapter_path=adapter_path, trust_remote_code=trust_remote_code
            )
        check_drafter_block(block_size, draft)
        template.prepare(tokenizer)
        if not template.ignore_chat_template and not uses_template(tokenizer, False):
            console.print(Text("the tokenizer has no chat template; turns are joined as raw text.", style="dim"))
        session = ChatSession(
            target,
            draft,
            tokenizer,
            system_prompt=system_prompt,
            **template.prompt_settings(kwargs),
            model_name=str(pair.model or "builtin"),
            prefill_step_size=prefill_step_size,
            cache_file=prompt_cache_file,
            prefix=prefix,
            kv=kv,
            prefix_cache_dir=prefix_cache_dir,
            prefix_cache_gb=prefix_cache_gb,
            group=group,
            **asdict(replace(sampling, block_size=block_size, num_draft_tokens=None)),
        )
        if conversation is not None:
            session.resume(conversation)
        session.run()
