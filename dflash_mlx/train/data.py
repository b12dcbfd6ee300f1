"""Training data: prompts from JSONL, and the target's own greedy responses.

Self-distillation (DFlash paper): the drafter learns to predict what the
target itself would write, so the target first writes its greedy response to
every training prompt. Those sequences are cached in the output directory
(``distill.jsonl``) so that ``--resume`` never regenerates them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DISTILL_FILE = "distill.jsonl"
DISTILL_META = "distill.meta.json"


@dataclass
class Sequence:
    """A prompt followed by the target's greedy response (token ids)."""

    tokens: list[int]
    prompt_len: int


def read_prompts(path: str | Path) -> list[dict]:
    """Parse a JSONL file whose lines are a JSON string, {"prompt": str} or
    {"messages": [{"role", "content"}, ...]} (a chat conversation: its
    trailing assistant turns are dropped, the target answers the rest).
    Blank lines are skipped. Raises ValueError naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"the data file {path} {what}; pass a JSONL file of prompts with --data.")
    items = []
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text; pass a JSONL file of prompts with --data.") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not valid JSON ({e.msg}); fix or remove that line.") from None
        items.append(_item(obj, path, n))
    if not items:
        raise ValueError(
            f"{path} holds no prompts; write one JSON object per line, "
            'such as {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}.'
        )
    return items


def _item(obj, path: Path, n: int) -> dict:
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
        if not obj["prompt"]:
            raise ValueError(f"{path} line {n} has an empty prompt; give it some text or remove the line.")
        return {"prompt": obj["prompt"]}
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        messages = obj["messages"]
        ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
        if not ok:
            raise ValueError(
                f"{path} line {n}: every message needs a \"role\" and a \"content\" string; fix that line."
            )
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise ValueError(f"{path} line {n} has no user turn for the target to answer; fix or remove that line.")
        return {"messages": messages}
    raise ValueError(
        f"{path} line {n} is neither a prompt string, a {{\"prompt\": ...}} object nor a "
        "{\"messages\": [...]} conversation; fix or remove that line."
    )


def encode_prompts(items: list[dict], tokenizer, max_prompt_len: int) -> list[list[int]]:
    """Token ids of each prompt: plain prompts as they are (the tokenizer's
    special tokens added, as mlx-lm does), conversations through the chat
    template with the generation prompt. Long prompts keep their last
    ``max_prompt_len`` tokens; empty ones are dropped."""
    out = []
    for item in items:
        if "prompt" in item:
            ids = tokenizer.encode(item["prompt"])
        else:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    "the data holds chat conversations but the target's tokenizer has no chat "
                    "template; use plain {\"prompt\": ...} lines or a target with a chat template."
                )
            ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict):  # transformers 5 may return a BatchEncoding
                ids = ids["input_ids"]
        ids = list(ids)[-max_prompt_len:]
        if ids:
            out.append(ids)
    return out


def data_fingerprint(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_distilled(out: Path) -> list[Sequence]:
    f = out / DISTILL_FILE
    if not f.is_file():
        return []
    seqs = []
    for line in f.read_text().splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut short by an interruption: regenerate from here
        seqs.append(Sequence(obj["tokens"], obj["prompt_len"]))
    return seqs


def distill(
    model,
    tokenizer,
    prompts: list[list[int]],
    seq_len: int,
    out: Path,
    meta: dict,
    gen_batch: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sequence]:
    """The target's greedy responses to ``prompts``, each sequence cut at
    ``seq_len`` tokens (the EOS kept when the target stopped). Sequences
    already in ``out/distill.jsonl`` (from an interrupted run with the same
    ``meta``) are reused; new ones are appended as they are made."""
    from mlx_lm.generate import batch_generate

    meta_file = out / DISTILL_META
    if meta_file.is_file():
        old = json.loads(meta_file.read_text())
        if old != meta:
            raise ValueError(
                f"{out} holds self-distilled data made from other data, target or --seq-len; "
                "pass a new --out directory."
            )
    else:
        meta_file.write_text(json.dumps(meta))
    done = load_distilled(out)
    eos = list(tokenizer.eos_token_ids)
    # Rewrite what is kept, in case an interruption cut the last line short.
    (out / DISTILL_FILE).write_text("".join(_line(s) for s in done))
    if progress:
        progress(len(done), len(prompts))
    with (out / DISTILL_FILE).open("a") as f:
        for start in range(len(done), len(prompts), gen_batch):
            chunk = prompts[start : start + gen_batch]
            budget = [seq_len - len(p) for p in chunk]
            res = batch_generate(
                model, tokenizer, chunk, max_tokens=budget, return_token_ids=True,
                completion_batch_size=gen_batch, prefill_batch_size=min(gen_batch, 8),
            )
            for p, ids, room in zip(chunk, res.token_ids, budget):
                ids = list(ids)
                if len(ids) < room and eos:
                    ids.append(eos[0])  # stopped on EOS: the drafter should learn to propose it
                seq = Sequence(p + ids[:room], len(p))
                done.append(seq)
                f.write(_line(seq))
            f.flush()
            if progress:
                progress(len(done), len(prompts))
    return done


def _line(seq: Sequence) -> str:
    return json.dumps({"tokens": seq.tokens, "prompt_len": seq.prompt_len}) + "\n"
