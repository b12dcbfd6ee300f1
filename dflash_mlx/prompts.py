"""Prompts: text to token ids (the BOS rule, chat templates) and prompt files."""

from __future__ import annotations

import json
from pathlib import Path

# Fields that hold a prompt in common JSONL files (MT-Bench "turns", Alpaca "instruction").
PROMPT_FIELDS = ("prompt", "question", "instruction", "input", "text", "turns")


def encode(tokenizer, text: str) -> list[int]:
    """Raw text as token ids, special tokens added unless the text already
    starts with BOS (as mlx-lm's ``stream_generate`` does)."""
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))


def apply_chat_template(tokenizer, messages: list[dict], prefill: str | None = None, **template_kwargs) -> list[int]:
    """A conversation through the chat template with the generation prompt, as
    token ids; ``prefill`` starts the assistant's reply for the model to continue."""
    if prefill is not None:
        messages = [*messages, {"role": "assistant", "content": prefill}]
        template_kwargs = {**template_kwargs, "continue_final_message": True}
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=prefill is None, **template_kwargs
    )
    return encode(tokenizer, text)


def read_prompts(path: str | Path) -> list[dict]:
    """The prompts in a file, one per non-blank line (plain text, a JSON string,
    or an object with ``messages`` or a ``PROMPT_FIELDS`` field), each as
    ``{"prompt", ["turns"]}`` or ``{"messages"}`` with trailing assistant turns
    dropped. Raises ValueError naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"the prompts file {path} {what}; pass a file with one prompt per line (text or JSONL).")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; pass a file with one prompt per line (text or JSONL).") from None
    items = [_item(line, path, n) for n, line in enumerate(lines, 1) if line.strip()]
    if not items:
        raise ValueError(
            f"{path} holds no prompts; write one per line, as text or as JSON such as "
            '{"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}.'
        )
    return items


def _item(line: str, path: Path, n: int) -> dict:
    where = f"{path} line {n}"
    text = line.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            if not text[1:].lstrip().startswith('"'):  # plain text that happens to open with a brace
                obj = line
            else:
                raise ValueError(f"{where} is not valid JSON ({e.msg}); fix or remove that line.") from None
    elif text.startswith('"'):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = line
    else:
        obj = line
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if isinstance(obj.get("messages"), list):
        return {"messages": _messages(obj["messages"], where)}
    value = next((obj[k] for k in PROMPT_FIELDS if k in obj), None)
    turns = None
    if isinstance(value, list) and value:
        turns = [t.get("content") if isinstance(t, dict) else t for t in value]
        value = turns[0]
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        fields = ", ".join(json.dumps(k) for k in ("messages", *PROMPT_FIELDS[1:]))
        raise ValueError(f'{where} has no prompt; give it a "prompt" string (or {fields}), or fix or remove that line.')
    if not value.strip():
        raise ValueError(f"{where} has an empty prompt; give it some text or remove the line.")
    if turns is not None and len(turns) > 1:
        if not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"{where} has a turn without text; give every turn some text, or fix that line.")
        return {"prompt": value, "turns": turns}
    return {"prompt": value}


def _messages(messages: list, where: str) -> list[dict]:
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(f'{where}: every message needs a "role" and a "content" string; fix that line.')
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ValueError(f"{where} has no user turn to answer; fix or remove that line.")
    return messages
