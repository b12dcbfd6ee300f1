"""Training data: the target's own greedy responses to the prompts.

Self-distillation (DFlash paper): the drafter learns to predict what the
target itself would write, so the target first writes its greedy response to
every training prompt. Those sequences are cached in the output directory
(``distill.jsonl``) so that ``--resume`` never regenerates them.
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
# ``distill`` sorts the prompts by length within windows of this many batches.
SORT_WINDOW = 16


@dataclass
class Sequence:
    """A prompt followed by the target's greedy response (token ids)."""

    tokens: list[int]
    prompt_len: int


def encode_prompts(items: list[dict], tokenizer, max_prompt_len: int) -> list[list[int]]:
    """Token ids of each item of ``dflash_mlx.prompts.read_prompts``: plain
    prompts as they are, conversations through the chat template with the
    generation prompt. Long prompts keep their last ``max_prompt_len``
    tokens; empty ones are dropped."""
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
    gen_batch: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sequence]:
    """The target's greedy responses to ``prompts``, each sequence cut at
    ``seq_len`` tokens (when the target stopped before that, the EOS it
    wrote is the last token). Sequences already in ``out/distill.jsonl``
    (from an interrupted run with the same ``meta``) are reused; new ones
    are appended as they are made.

    The prompts go through in windows of ``SORT_WINDOW`` batches: inside a
    window they are sorted by length, so that each batch of ``gen_batch``
    holds prompts of about one length (little padding, and the batch stops
    when its rows have used their room), while the file keeps the prompts'
    order, so that a resumed run finds the first sequences done."""
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
                # Append the window's sequences that are now complete from its start.
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
    """The target's greedy (argmax) continuation of every prompt, decoded as
    one batch: at most ``max_new`` tokens each (an int, or one per prompt),
    cut after the first token in ``eos`` (that EOS kept).

    The prompts are left-padded to one length and share one
    ``BatchKVCache`` per layer (per-row RoPE offsets and padding masks; a
    sliding-window layer keeps all its keys and the mask applies the
    window). Produced tokens stay on the device; every ``check_every``
    steps they come to the host, the loop stops once every row has met an
    EOS or its budget, and the finished rows leave the batch when they are
    a quarter of it or more."""
    import mlx.core as mx

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

    # Prefill all but the last column through the body only (no logits over
    # the vocabulary), then the last column through the whole model.
    body = getattr(model, "model", None)
    for s in range(0, L - 1, prefill_step):
        part = tokens[:, s : min(s + prefill_step, L - 1)]
        h = body(part, cache=cache) if body is not None else model(part, cache=cache)
        mx.eval(h, [(c.keys, c.values) for c in cache])

    def step(x):
        return mx.argmax(model(x[:, None], cache=cache)[:, -1, :], axis=-1)

    y = step(tokens[:, -1])
    mx.async_eval(y)
    active = list(rows)  # the row of ``out`` that each batch row writes
    left = {i: budget[i] for i in rows}  # how many tokens each row may still take
    pending = []  # produced columns not yet read on the host
    until = min(check_every, max(budget[i] for i in rows))  # columns to make before the next read
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
    """One ``BatchKVCache`` per layer of ``model``, for prompts left-padded by
    ``left_padding``. Layers that mlx-lm gives a rotating (sliding-window)
    cache get a full one too: their mask applies the window."""
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
