"""How a draft tree's shape pays: ways of choosing a tree's nodes, replayed on the target's replies.

Reported in BENCHMARKS.md, "Draft trees".

    python benchmarks/tree_oracle.py --prompts 12 --budgets 16,24,32,48

For each held-out prompt, the target's own greedy reply (what every lossless
tree commits) and, at every position of it, the drafter's log-probabilities
for the block that would start there (its training forward, every anchor at
once, as lookup_oracle.py takes them). At each position each way of choosing
``budget`` nodes builds its tree, and its accepted depth is how far the reply
runs down it. Whole decodes are then replayed on the reply (a cycle commits
its accepted drafts and one more token), giving tokens per cycle as speed.py
measures them. Halves: the calibrated ways are fitted on the even prompts and
scored on the odd ones (and the other way round), never on what they score.

- block: the drafter's first choices only (a chain, ``block`` rows);
- chain first: the first choices' chain, then the most probable prefixes
  (draft/tree.py's rule before it kept the most probable alone);
- library: draft/tree.py's build_tree as it stands;
- probable: the most probable prefixes alone (DDTree's rule);
- calibrated: the most probable prefixes where a candidate's probability is
  what candidates of its rank at its depth turned out to be worth, apart
  for paths on the first choices' chain and off it (fitted on the other half).
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from lookup_oracle import drafter_blocks, greedy_reply, replay

ROOT = Path(__file__).resolve().parent.parent


def walk(nodes: dict[tuple[int, int], int], future: np.ndarray) -> int:
    """How far ``future`` runs down a tree given as (parent, token) -> node, the root 0."""
    at = depth = 0
    for token in future:
        at = nodes.get((at, int(token)))
        if at is None:
            break
        depth += 1
    return depth


def best_first(worth: np.ndarray, ids: np.ndarray, budget: int, chain_first: bool = False) -> dict:
    """The ``budget - 1`` prefixes of highest summed worth, the root's children
    up (after the first choices' chain where ``chain_first``), as (parent,
    token) -> node; ``worth`` [D, K, 2]: a candidate's log-worth, on the first
    choices' chain (0) and off it (1); ``ids`` [D, K] the candidates, the first choice first."""
    depth_count, k = ids.shape
    nodes: dict[tuple[int, int], int] = {}
    # (chain first, -score, depth, parent node, column, on chain)
    heap = [(-(chain_first and j == 0), -worth[0, j, 0], 0, 0, j, j == 0) for j in range(k)]
    heapq.heapify(heap)
    while heap and len(nodes) < budget - 1:
        _, score, d, parent, j, chain = heapq.heappop(heap)
        node = len(nodes) + 1
        nodes[(parent, int(ids[d, j]))] = node
        if d + 1 < depth_count:
            for c in range(k):
                on = chain and c == 0
                heapq.heappush(
                    heap, (-(chain_first and on), score - worth[d + 1, c, 0 if on else 1], d + 1, node, c, on)
                )
    return nodes


def library_tree(logprobs: np.ndarray, budget: int, top_k: int) -> dict[tuple[int, int], int]:
    from dflash_mlx.draft.tree import build_tree

    tokens, layout = build_tree(mx.array(logprobs), budget, top_k)
    tokens, parents = np.array(tokens).tolist(), np.array(layout.parents).tolist()
    return {(parents[n], tokens[n]): n for n in range(1, len(tokens))}


def candidates(logprobs: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each depth's ``top_k`` candidates, most probable first, and their log-probabilities."""
    ids = np.argsort(-logprobs, axis=-1)[:, :top_k]
    return ids, np.take_along_axis(logprobs, ids, axis=-1)


def hit_rates(positions: list[tuple[np.ndarray, np.ndarray]], top_k: int) -> np.ndarray:
    """[D, K, 2] log of how often the rank-k candidate at each depth was the
    reply's token where the path above it held the reply, on the first
    choices' chain (0: every token above was a first choice) and off it (1)."""
    depth_count = positions[0][0].shape[0]
    hits = np.ones((depth_count, top_k, 2))  # a prior of one hit in two tries
    tries = np.full((depth_count, top_k, 2), 2.0)
    for ids, future in positions:
        chain = True
        for d in range(min(depth_count, len(future))):
            tries[d, :, 0 if chain else 1] += 1
            rank = np.flatnonzero(ids[d] == future[d])
            if rank.size == 0:
                break
            hits[d, rank[0], 0 if chain else 1] += 1
            chain = chain and rank[0] == 0
    return np.log(hits / tries)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "dflash_mlx" / "builtin" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "dflash_mlx" / "builtin" / "draft"))
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts, half code and half chat")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="16,24,32,48")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dflash_mlx import load
    from dflash_mlx.targets import adapt

    model, draft, tok = load(args.model, draft=args.draft)
    draft.bind(adapt(model))
    held = json.loads((ROOT / "benchmarks" / "prompts" / "held_out.json").read_text())
    texts = held["code"][: (args.prompts + 1) // 2] + held["chat"][: args.prompts // 2]
    eos = set(tok.eos_token_ids)
    k = args.block_size - 1
    budgets = [int(b) for b in args.budgets.split(",")]
    # per prompt, per position: (candidates [D, K], their log-probs, the full log-probs, the reply's next k tokens)
    prompts = []
    for text in texts:
        prompt = tok.encode(text)
        reply = greedy_reply(model, prompt, args.max_tokens, eos)
        sequence = prompt + reply
        anchors = list(range(len(prompt), len(sequence) - 1))
        if not anchors:
            continue
        logprobs = drafter_blocks(draft, adapt(model), sequence, anchors, args.block_size)
        history = np.array(sequence)
        prompts.append(
            [
                (*candidates(logprobs[i], args.top_k), logprobs[i], history[a + 1 : a + 1 + k])
                for i, a in enumerate(anchors)
            ]
        )
    fitted = [
        hit_rates([(ids, f) for p in prompts[1 - half :: 2] for ids, _, _, f in p], args.top_k) for half in (0, 1)
    ]

    def ways(budget: int):
        def probable(ids, lp, full, i):
            return best_first(np.repeat(lp[..., None], 2, axis=-1), ids, budget)

        def chain_first(ids, lp, full, i):
            return best_first(np.repeat(lp[..., None], 2, axis=-1), ids, budget, chain_first=True)

        def calibrated(ids, lp, full, i):
            return best_first(fitted[i % 2], ids, budget)

        return {
            "chain first": chain_first,
            "library": lambda ids, lp, full, i: library_tree(full, budget, args.top_k),
            "probable": probable,
            "calibrated": calibrated,
        }

    def tokens_per_cycle(accepted_by_prompt: list[list[int]], rows: int) -> float:
        tokens = cycles = 0
        for accepted in accepted_by_prompt:
            t, c, _ = replay({"drafter": accepted}, lambda r, i: (r["drafter"][i], rows))
            tokens, cycles = tokens + t, cycles + c
        return tokens / max(cycles, 1)

    block = [[int(np.cumprod(ids[:, 0][: len(f)] == f).sum()) for ids, _, _, f in p] for p in prompts]
    summary = {"positions": sum(map(len, prompts)), "block": round(tokens_per_cycle(block, args.block_size), 3)}
    for budget in budgets:
        for name, build in ways(budget).items():
            accepted = [[walk(build(ids, lp, full, j), f) for ids, lp, full, f in p] for j, p in enumerate(prompts)]
            summary[f"{name} {budget}"] = round(tokens_per_cycle(accepted, budget), 3)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{len(texts)} prompts, {summary['positions']} positions, block {args.block_size}, top {args.top_k} a depth")
    print("decodes replayed on the target's replies: tokens per cycle (over block)")
    for name, value in summary.items():
        if name != "positions":
            print(f"  {name:>16}: {value:6.3f} ({value / summary['block']:.2f}x)")


if __name__ == "__main__":
    main()
