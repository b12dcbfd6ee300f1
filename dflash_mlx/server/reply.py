"""Generated text to what a client is sent: stop strings cut the text, then
mlx-lm's text state machine splits it into content, reasoning and tool-call
text, and the model family's mlx-lm tool parser reads the calls."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Optional

from mlx_lm.generate import TextStateMachine, make_text_state_machine

log = logging.getLogger("dflash_mlx.server")


@dataclass
class Delta:
    """New output: content, reasoning, finished tool calls
    ({"id", "name", "arguments": dict}), and the log-probs of the tokens
    generated since the last Delta (``TokenLogprob``)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)

    def merge(self, other: Delta) -> Delta:
        return Delta(
            self.content + other.content,
            self.reasoning + other.reasoning,
            self.tool_calls + other.tool_calls,
            self.logprobs + other.logprobs,
        )


@dataclass
class TokenLogprob:
    """One generated token: its text, its log-prob under the target, and the
    top (text, log-prob) pairs at its position."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


class StopScanner:
    """Finds the first stop string in streamed text; holds back the tail that
    could still begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.matched: Optional[str] = None

    def feed(self, text: str) -> str:
        self.buffer += text
        hits = [(i, s) for s in self.stops if (i := self.buffer.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.buffer = self.buffer[:at], ""
            return out
        keep = min(self.hold, len(self.buffer))
        out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return out

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


class ReplyParser:
    """One reply's text, fed as it is generated."""

    def __init__(self, tokenizer, stops: list[str], structured: bool, starts_in_reasoning: bool, tools=None):
        self.tokenizer, self.tools = tokenizer, tools
        self.scanner = StopScanner(stops)
        machine = make_text_state_machine(tokenizer) if structured else TextStateMachine()
        self.state = machine.make_state("reasoning" if starts_in_reasoning else "normal")
        self.tool_text = ""
        self.made_tool_call = False

    @property
    def stopped(self) -> bool:
        return self.scanner.matched is not None

    @property
    def stop_sequence(self) -> Optional[str]:
        return self.scanner.matched

    def feed(self, text: str) -> Delta:
        self.state, segments = TextStateMachine.split(self.state, self.scanner.feed(text))
        return self._collect(segments)

    def finish(self) -> Delta:
        self.state, segments = TextStateMachine.split(self.state, self.scanner.flush())
        self.state, rest, current = TextStateMachine.flush(self.state)
        delta = self._collect(segments + [(current, rest)])
        if self.tool_text:  # a call cut off by the end of the reply
            delta = delta.merge(self._parse_tool_call())
        return delta

    def _collect(self, segments) -> Delta:
        delta = Delta()
        for state, text in segments:
            if state == "tool":
                self.tool_text += text
                continue
            if self.tool_text:
                delta = delta.merge(self._parse_tool_call())
            if state == "reasoning":
                delta.reasoning += text
            elif state is not None:
                delta.content += text
        return delta

    def _parse_tool_call(self) -> Delta:
        text, self.tool_text = self.tool_text, ""
        try:
            parsed = self.tokenizer.tool_parser(text, self.tools)
        except Exception as e:  # the model wrote something its parser cannot read
            log.warning("could not parse a tool call (%s: %s); sent as text", type(e).__name__, e)
            return Delta(content=f"{self.tokenizer.tool_call_start}{text}{self.tokenizer.tool_call_end or ''}")
        calls = parsed if isinstance(parsed, list) else [parsed]
        self.made_tool_call = True
        return Delta(
            tool_calls=[
                {
                    "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    "name": c["name"],
                    "arguments": c.get("arguments") or {},
                }
                for c in calls
            ]
        )
