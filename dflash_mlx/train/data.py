"""Training data: the target's own greedy responses to the prompts
(self-distillation), cached in ``distill.jsonl`` so ``--resume`` reuses them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..prompts import apply_chat_template, encode

DISTILL_FILE = "distill.jsonl"
DISTILL_META = "distill.meta.json"
SORT_WINDOW = 16


@dataclass
class Sequence:
    """A prompt followed by the target's greedy response (token ids)."""

    tokens: list[int]
    prompt_len: int


def encode_prompts(items: list[dict], tokenizer, max_prompt_len: int) -> list[list[int]]:
    """Token ids of each ``read_prompts`` item (conversations through the chat
    template), keeping the last ``max_prompt_len``; empty ones are dropped."""
    out = []
    for item in items:
        if "prompt" in item:
            ids = encode(tokenizer, item["prompt"])
        else:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    "the data holds chat conversations but the target's tokenizer has no chat "
                    'template; use plain {"prompt": ...} lines or a target with a chat template.'
                )
            ids = apply_chat_template(tokenizer, item["messages"])
        ids = ids[-max_prompt_len:]
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
    *,
    gen_batch: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sequence]:
    """The target's greedy responses to ``prompts``, each sequence cut at
    ``seq_len`` tokens, reusing those already in ``out/distill.jsonl``.

    Prompts are sorted by length within windows of ``SORT_WINDOW`` batches
    (less padding), but written in the prompts' order so a resume can count."""
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
    done = load_distilled(out)[: len(prompts)]
    eos = set(tokenizer.eos_token_ids)
    # Rewrite what is kept, in case an interruption cut the last line short.
    (out / DISTILL_FILE).write_text("".join(_line(s) for s in done))
    if progress:
        progress(len(done), len(prompts))
    gen_batch = max(1, gen_batch)
    window = gen_batch * SORT_WINDOW
    with (out / DISTILL_FILE).open("a") as f:
        for start in range(len(done), len(prompts), window):
            chunk = prompts[start : start + window]
            order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))
            made: dict[int, Sequence] = {}
            written = 0
            for b in range(0, len(order), gen_batch):
                rows = order[b : b + gen_batch]
                ps = [chunk[i] for i in rows]
                responses = greedy_batch(model, ps, [seq_len - len(p) for p in ps], eos)
                for i, p, r in zip(rows, ps, responses):
                    made[i] = Sequence((p + r)[:seq_len], min(len(p), seq_len))
                while written in made:
                    done.append(made.pop(written))
                    f.write(_line(done[-1]))
                    written += 1
                f.flush()
                if progress:
                    progress(start + written + len(made), len(prompts))
    return done


def greedy_batch(
    model,
    prompts: list[list[int]],
    max_new: list[int] | int,
    eos: set[int] | frozenset[int] = frozenset(),
    prefill_step: int = 512,
    check_every: int = 16,
) -> list[list[int]]:
    """The target's greedy continuation of every prompt, decoded as one
    left-padded batch: at most ``max_new`` tokens each, cut after the first
    token in ``eos`` (kept). Tokens are read every ``check_every`` steps."""
    import mlx.core as mx

    from ..decode.sampling import greedy

    eos = set(eos)
    n = len(prompts)
    budget = [max_new] * n if isinstance(max_new, int) else list(max_new)
    if len(budget) != n:
        raise ValueError(f"greedy_batch got {n} prompts but {len(budget)} budgets")
    out: list[list[int]] = [[] for _ in range(n)]
    rows = [i for i in range(n) if budget[i] > 0 and prompts[i]]
    if not rows:
        return out
    L = max(len(prompts[i]) for i in rows)
    pad = [L - len(prompts[i]) for i in rows]
    tokens = mx.array([[0] * p + list(prompts[i]) for p, i in zip(pad, rows)])
    cache = _batch_cache(model, pad)

    # Prefill all but the last column through the body only: no vocabulary logits.
    body = getattr(model, "model", None)
    for s in range(0, L - 1, prefill_step):
        part = tokens[:, s : min(s + prefill_step, L - 1)]
        h = body(part, cache=cache) if body is not None else model(part, cache=cache)
        mx.eval(h, [(c.keys, c.values) for c in cache])

    def step(x):
        return greedy(model(x[:, None], cache=cache)[:, -1, :])

    y = step(tokens[:, -1])
    mx.async_eval(y)
    active = list(rows)  # the row of ``out`` that each batch row writes
    left = {i: budget[i] for i in rows}
    pending = []
    until = min(check_every, max(budget[i] for i in rows))
    while True:
        pending.append(y)
        # Queue the next step before reading anything, so the device stays busy.
        y = step(y)
        mx.async_eval(y)
        if len(pending) < until:
            continue
        cols = mx.stack(pending, axis=1).tolist()
        pending = []
        keep = []
        for b, (i, col) in enumerate(zip(active, cols)):
            if left[i] <= 0:
                continue  # finished at an earlier check, still in the batch
            col = col[: left[i]]
            hit = next((k for k, t in enumerate(col) if t in eos), None)
            if hit is not None:
                col = col[: hit + 1]
            out[i] += col
            left[i] = 0 if hit is not None else left[i] - len(col)
            if left[i] > 0:
                keep.append(b)
        if not keep:
            break
        if len(keep) <= 0.75 * len(active):  # drop the finished rows
            idx = mx.array(keep)
            for c in cache:
                c.filter(idx)
            active = [active[b] for b in keep]
            y = y[idx]
        until = min(check_every, max(left[i] for i in active))
    return out


def _batch_cache(model, left_padding: list[int]) -> list:
    """One ``BatchKVCache`` per layer, sliding layers included: their mask
    applies the window."""
    from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache, make_prompt_cache

    layers = make_prompt_cache(model)
    for c in layers:
        if type(c) is KVCache or (type(c) is RotatingKVCache and c.keep == 0):
            continue
        raise ValueError(
            f"the target's {type(c).__name__} layers are not supported by the batched "
            "self-distillation yet; use a target whose layers all use attention."
        )
    return [BatchKVCache(left_padding) for _ in layers]


def _line(seq: Sequence) -> str:
    return json.dumps({"tokens": seq.tokens, "prompt_len": seq.prompt_len}) + "\n"
