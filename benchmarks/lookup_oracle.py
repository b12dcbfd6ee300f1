"""How far prompt lookup can go with a target: an oracle over its own greedy replies.

Reported in BENCHMARKS.md, "Prompt lookup".

    python benchmarks/lookup_oracle.py --model dflash_mlx/builtin/target --draft dflash_mlx/builtin/draft \
        --prompts benchmarks/prompts/copy_edits.json --block-size 16 --max-tokens 96

For each prompt, the target's own greedy reply (mlx-lm's ``generate_step``):
what every lossless drafter commits. For copy_edits.json prompts, how much of
the asked-for edit the reply reproduces before it leaves it. Then at every
position of the reply (the last committed token; k = block - 1 drafts to come),
how many of the next k tokens each drafter would have had accepted:

- drafter: the DFlash drafter's block (its training forward, every anchor at once);
- find: draft/lookup.py's ``find`` (drafted beside the drafter where n >= min_ngram);
- copy any: the best continuation copied from any earlier place (no match asked for);
- copy n1, n3: the best copied from a place whose last 1 (3) tokens match;
- longest: the continuation after the longest match (most recent), n unbounded;
- believed: of the places whose last token matches, the continuation the
  drafter believes most (``find_believed``'s choice below min_ngram).

"copy any" bounds every copying drafter: where it is low the target does not
copy. Then whole decodes are replayed on the reply (a cycle commits its
accepted drafts and one more token) under each way of choosing a cycle's
drafts, giving tokens per cycle as speed.py measures them; "(oracle)" rows
choose knowing the reply. Where a policy falls short of the oracles the loss
is in the policy; where the oracles are low it is in the target.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def greedy_reply(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    from dflash_mlx.tiny import greedy_reference

    return greedy_reference(model, prompt, n, eos)


def expected_edit(text: str) -> str | None:
    """The rest of the edit a copy_edits.json prompt asks for (its function
    with the name renamed, less the part the prompt starts), or None for
    other prompts."""
    found = re.match(r"# (\S+)\n(.*)\n\n# \1, with (\w+) renamed to (\w+)\n(.*)\Z", text, re.S)
    if found is None:
        return None
    _, src, old, new, start = found.groups()
    edited = re.sub(rf"\b{re.escape(old)}\b", new, src)
    return edited[len(start) :] if edited.startswith(start) else None


def drafter_blocks(draft, adapter, sequence: list[int], anchors: list[int], block: int) -> np.ndarray:
    """The drafter's log-probabilities [len(anchors), block - 1, V]: at anchor
    a, the block [sequence[a], MASK, ...] over the context of positions before a."""
    from dflash_mlx.train.forward import draft_logits, target_taps

    taps = target_taps(adapter, mx.array(sequence)[None], list(draft.config.target_layer_ids))
    anchor = mx.array(anchors, mx.int32)
    first = mx.array([sequence[a] for a in anchors], mx.int32)
    mask = draft.config.mask_token_id
    batch = {
        "block": mx.where(mx.arange(block)[None] == 0, first[:, None], mask).astype(mx.int32),
        "anchor": anchor,
        "seq": mx.zeros(len(anchors), mx.int32),
        "length": mx.full((len(anchors),), block, mx.int32),
    }
    logits = draft_logits(draft, taps, batch).astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def copied(history: np.ndarray, last: int, k: int) -> np.ndarray:
    """[last, k]: the k tokens that follow each earlier position p < last,
    where a continuation past ``last`` repeats the span it copied."""
    p = np.arange(last)[:, None]
    at = p + 1 + np.arange(k)[None]
    period = last - p
    past = at - last
    at = np.where(past > 0, at - period * ((past + period - 1) // period), at)
    return history[at]


def match_lengths(history: np.ndarray, last: int) -> np.ndarray:
    """[last]: how many tokens ending at each earlier position p match the
    tokens ending at ``last``."""
    p = np.arange(last)
    n = np.zeros(last, np.int64)
    alive = np.ones(last, bool)
    for j in range(last + 1):
        ok = alive & (p - j >= 0) & (history[np.maximum(p - j, 0)] == history[last - j])
        if not ok.any():
            break
        n += ok
        alive = ok
    return n


def agreement(drafts: np.ndarray, future: np.ndarray) -> np.ndarray:
    """How many leading drafts (rows of ``drafts``) equal ``future``."""
    m = len(future)
    same = drafts[..., :m] == future
    return np.cumprod(same, axis=-1).sum(axis=-1)


def analyse(model, draft, prompt: list[int], reply: list[int], block: int, params) -> dict[str, list]:
    """Per position of the reply (the last committed token), each drafter's
    accepted drafts, and the beliefs ``find_believed`` weighs."""
    from dflash_mlx.draft.lookup import TokenHistory, find
    from dflash_mlx.targets import adapt

    sequence = prompt + reply
    k = block - 1
    anchors = list(range(len(prompt), len(sequence) - 1))
    logprobs = drafter_blocks(draft, adapt(model), sequence, anchors, block)
    drafts = logprobs.argmax(-1)
    history = np.array(sequence)
    buffer = TokenHistory(sequence)
    rows: dict[str, list] = {}

    def add(name, value):
        rows.setdefault(name, []).append(value)

    for i, a in enumerate(anchors):
        future = history[a + 1 : a + 1 + k]
        cont = copied(history, a, k)
        got = agreement(cont, future)
        n = match_lengths(history, a)
        looked, found_n = find(buffer.tokens, mx.array(a, mx.int32), 2 * k, params)
        looked, found_n = np.array(looked), found_n.item()
        add("drafter", int(agreement(drafts[i], future)))
        add("find", int(agreement(looked[:k], future)) if found_n >= params.min_ngram else 0)
        add("find_n", found_n)
        add("find_long", int(agreement(looked, history[a + 1 : a + 1 + 2 * k])) if found_n >= params.min_ngram else 0)
        add("copy_any", int(got.max()))
        add("copy_n1", int(got[n >= 1].max()) if (n >= 1).any() else 0)
        add("copy_n3", int(got[n >= 3].max()) if (n >= 3).any() else 0)
        best = int(np.flatnonzero(n == n.max())[-1])
        add("longest", int(got[best]) if n[best] >= params.min_ngram else 0)
        add("longest_n", int(n[best]))
        # find_believed's weighing (tests/test_lookup.py checks the device's against a plain one)
        expected = np.where(n >= 1, np.cumprod(np.exp(logprobs[i][np.arange(k), cont]), axis=-1).sum(-1), -1.0)
        believed = int(expected.argmax())
        add("believed", int(got[believed]))
        add("believed_expected", float(expected[believed]))
        add("own_expected", float(np.cumprod(np.exp(logprobs[i].max(-1))).sum()))
    return rows


def replay(rows: dict[str, list], choose) -> tuple[int, int, int]:
    """(tokens, cycles, rows verified) of a decode over the reply where a cycle
    at position i verifies ``choose(rows, i)`` = (accepted drafts, rows); a
    cycle commits its accepted drafts and one more token."""
    i = tokens = cycles = verified = 0
    total = len(rows["drafter"])
    while i < total:
        accepted, width = choose(rows, i)
        step = min(accepted + 1, total - i)
        tokens, cycles, verified, i = tokens + step, cycles + 1, verified + width, i + step
    return tokens, cycles, verified


def policies(block: int, min_ngram: int, beliefs: list[float]) -> dict:
    """Ways of choosing a cycle's drafts: name -> (rows, i) -> (accepted drafts, rows verified)."""
    k = block - 1

    def looked_up_at(n: int):
        return lambda r, i: (r["find"][i] if r["find_n"][i] >= n else r["drafter"][i], block)

    def believed(belief: float):
        def choose(r, i):
            if r["find_n"][i] >= min_ngram:
                return r["find"][i], block
            if r["believed_expected"][i] >= belief * r["own_expected"][i]:
                return r["believed"][i], block
            return r["drafter"][i], block

        return choose

    return {
        "drafter alone": lambda r, i: (r["drafter"][i], block),
        f"find n>={min_ngram} or drafter": looked_up_at(min_ngram),
        **{f"find n>={n} or drafter": looked_up_at(n) for n in (1, 2, 4, 6) if n != min_ngram},
        "longest (n unbounded) or drafter": lambda r, i: (
            r["longest"][i] if r["longest_n"][i] >= min_ngram else r["drafter"][i],
            block,
        ),
        **{f"find_believed, belief {b}": believed(b) for b in beliefs},
        f"find n>={min_ngram}: {2 * k} drafts, else drafter": lambda r, i: (
            (r["find_long"][i], 2 * k + 1) if r["find_n"][i] >= min_ngram else (r["drafter"][i], block)
        ),
        "best of find, drafter (oracle)": lambda r, i: (max(r["find"][i], r["drafter"][i]), block),
        f"best of copy n>={min_ngram}, drafter (oracle)": lambda r, i: (max(r["copy_n3"][i], r["drafter"][i]), block),
        "best of copy any, drafter (oracle)": lambda r, i: (max(r["copy_any"][i], r["drafter"][i]), block),
        "find alone": lambda r, i: (r["find"][i] if r["find_n"][i] else 0, block),
        "copy any alone (oracle)": lambda r, i: (r["copy_any"][i], block),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "dflash_mlx" / "builtin" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "dflash_mlx" / "builtin" / "draft"))
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "copy_edits.json")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--belief", default="0.1,0.2,0.3,0.5", help="comma-separated LookupParams.belief values to replay")
    ap.add_argument("--show", type=int, default=0, help="print the first N prompts' replies, marked")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dflash_mlx import load
    from dflash_mlx.draft.lookup import LookupParams
    from dflash_mlx.targets import adapt

    model, draft, tok = load(args.model, draft=args.draft)
    draft.bind(adapt(model))
    texts = json.loads(args.prompts.read_text())
    texts = texts["prompts"] if isinstance(texts, dict) else texts
    eos = set(tok.eos_token_ids)
    params = LookupParams()
    every: dict[str, list] = {}
    chosen = policies(args.block_size, params.min_ngram, [float(b) for b in args.belief.split(",")])
    replays = {name: [0, 0, 0] for name in chosen}
    followed = wanted = 0  # characters of the asked-for edit the replies reproduce, and all of them
    for j, text in enumerate(texts):
        prompt = tok.encode(text)
        reply = greedy_reply(model, prompt, args.max_tokens, eos)
        rows = analyse(model, draft, prompt, reply, args.block_size, params)
        for name, values in rows.items():
            every.setdefault(name, []).extend(values)
        for name, choose in chosen.items():
            replays[name] = [x + y for x, y in zip(replays[name], replay(rows, choose))]
        edit = expected_edit(text)
        if edit is not None:
            written = tok.decode(reply)
            edit = edit[: len(written)]  # as much as the reply had room for
            followed += len(os.path.commonprefix([written, edit]))
            wanted += len(edit)
        if j < args.show:
            print(f"--- prompt {j}: ...{tok.decode(prompt[-60:])!r}\n+++ reply: {tok.decode(reply)!r}")
    k = args.block_size - 1
    positions = len(every["drafter"])
    summary = {
        "positions": positions,
        "block_size": args.block_size,
        "mean_accepted_at_every_position": {
            name: round(float(np.mean(every[name])), 3) for name in every if not name.endswith(("_n", "_expected"))
        },
        "share_with_a_match_of_3": round(float(np.mean(np.array(every["find_n"]) >= params.min_ngram)), 3),
        "share_of_the_edit_reproduced": round(followed / wanted, 3) if wanted else None,
        "share_copy_any_full_block": round(float(np.mean(np.array(every["copy_any"]) == k)), 3),
        "tokens_per_cycle": {name: round(t / max(c, 1), 3) for name, (t, c, _) in replays.items()},
        "rows_per_cycle": {name: round(v / max(c, 1), 2) for name, (_, c, v) in replays.items()},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{len(texts)} prompts, {positions} positions, block {args.block_size} ({k} drafts)")
    print("mean accepted drafts at every position:")
    for name, value in summary["mean_accepted_at_every_position"].items():
        print(f"  {name:>36}: {value:6.3f}")
    print(f"positions with a match of >= {params.min_ngram}: {summary['share_with_a_match_of_3']:.3f}")
    print(f"positions where some copy predicts all {k}: {summary['share_copy_any_full_block']:.3f}")
    if wanted:
        print(f"share of the asked-for edit the replies reproduce before leaving it: {followed / wanted:.3f}")
    print("decodes replayed on the target's replies: tokens per cycle (rows verified per cycle)")
    for name, value in summary["tokens_per_cycle"].items():
        print(f"  {name:>36}: {value:6.3f} ({summary['rows_per_cycle'][name]})")


if __name__ == "__main__":
    main()
