"""Decode tok/s of plain mlx-lm, dflash-mlx and the official Z Lab loop on the same weights.

Reported in BENCHMARKS.md, "Against the official Z Lab loop" (under "The built-in
pair" and under "Qwen3-8B shapes, random weights"), and README.md's "vs the official
Z Lab loop" row.

    python benchmarks/speed.py --shape qwen3-8b --max-tokens 96 --block-size 16,auto --repeat 2
    python benchmarks/speed.py --model dflash_mlx/builtin/target --draft dflash_mlx/builtin/draft \
        --prompt @benchmarks/prompts/held_out_code.txt --max-tokens 256
    python benchmarks/speed.py --model dflash_mlx/builtin/target --draft dflash_mlx/builtin/draft \
        --prompts benchmarks/prompts/copy_edits.json --block-size 16 --lookup off,on,auto,alone

``--tree-budget`` verifies draft trees of that many rows (or auto) in
dflash-mlx's rows (docs/trees.md). ``--lookup`` adds prompt lookup to dflash-mlx's rows (off, on, auto; alone: no
drafter, lookup only). ``--prompts`` runs a prompt set (a JSON list of texts, or
an object whose "prompts" list them) and sums its decode times; copy_edits.json,
written by ``--write-copy-edits``, asks for an edit of a function given in the
prompt (held-out stdlib files, a name renamed): replies that copy their context.

All three run in one process, each round in turn; the official loop
(``dflash.model_mlx``, ``pip install --no-deps dflash==0.1.0``) is skipped where
it is not installed. With random weights (``--shape``) the drafter accepts almost
nothing, so the figure is a cycle's cost against a plain step; with a trained pair
it is the real speedup.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from cycle import SHAPES, configs, random_target, synthetic_prompt
from mlx_lm.generate import generate_step

ROOT = Path(__file__).resolve().parent.parent
COPY_EDITS = ROOT / "benchmarks" / "prompts" / "copy_edits.json"


def random_pair(shape: str, tmp: Path):
    """The pair at a model's shapes written as checkpoints (the official loop loads from disk)."""
    from dflash_mlx.tiny import make_tokenizer, random_draft_weights, write_target, write_zlab_draft

    tcfg, dcfg = configs(shape)
    target_dir = write_target(tmp / "target", tcfg, random_target(shape), make_tokenizer(64))
    draft_dir = write_zlab_draft(tmp / "draft", dcfg, random_draft_weights(dcfg))
    return str(target_dir), str(draft_dir)


def timed(label, streams):
    """Run each prompt's token stream to the end; decode tok/s after each first token, summed."""
    tokens = 0
    ttft = decode = 0.0
    for stream in streams:
        tic = time.perf_counter()
        first = None
        count = 0
        for count_now in stream:
            if first is None:
                first = time.perf_counter()
            count = count_now
        end = time.perf_counter()
        tokens += count - 1
        ttft += first - tic
        decode += end - first
    return {
        "mode": label,
        "tokens": tokens,
        "ttft_s": round(ttft, 4),
        "decode_tps": round(tokens / max(decode, 1e-9), 2),
    }


def plain(model, prompt, n):
    k = 0
    for _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        k += 1
        yield k


def ours(model, draft, tok, prompt, n, bs, stats, lookup=False, tree=None):
    from dflash_mlx import stream_generate

    k = 0
    for r in stream_generate(model, draft, tok, prompt, max_tokens=n, block_size=bs, lookup=lookup, tree_budget=tree):
        k += len(r.tokens)
        if r.accepted is not None:
            stats["tokens"] = stats.get("tokens", 0) + len(r.tokens)
            stats["cycles"] = stats.get("cycles", 0) + 1
            stats["lookup_hits"] = stats.get("lookup_hits", 0) + r.lookup_hit
        yield k


def copy_edits(n: int, seed: int) -> list[str]:
    """``n`` prompts asking for an edit of a documented function from a
    held-out stdlib file: the function, then its first half with a local name
    renamed, for the model to finish (a reply that copies its context)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from builtin_corpus import functions, stdlib_files

    rng = random.Random(seed)
    found = []
    for rel, text in stdlib_files(held_out=True):
        for _, _, src in functions(text):
            if not 8 <= src.count("\n") + 1 <= 24 or len(src) > 1000:
                continue
            uses: dict[str, int] = {}
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Name) and len(node.id) > 2 and not node.id.startswith("__"):
                    uses[node.id] = uses.get(node.id, 0) + 1
            names = sorted(k for k, v in uses.items() if v >= 3 and k != "self" and k not in dir(__builtins__))
            if names:
                found.append((rel, src, names))
    rng.shuffle(found)
    prompts = []
    for rel, src, names in found[:n]:
        old = rng.choice(names)
        new = f"new_{old}"
        lines = re.sub(rf"\b{re.escape(old)}\b", new, src).splitlines(keepends=True)
        cut = next(i for i in range(len(lines) // 2, len(lines)) if lines[i].strip())
        # The prompt ends at a line's end, its newlines left to the model: the
        # tokenizer joins a newline to the next line's indent, so a prompt
        # ending in a bare newline reads as a function's end.
        start = "".join(lines[:cut]).rstrip("\n")
        prompts.append(f"# {rel}\n{src}\n\n# {rel}, with {old} renamed to {new}\n{start}")
    return prompts


def official_draft(path: str):
    """The official loop's drafter from a local directory. Its ``load_draft``
    takes a Hub id only (``snapshot_download``), so that name is pointed at
    the directory: the one way in without a download."""
    import dflash.model_mlx as official_mod

    official_mod.snapshot_download = lambda *a, **k: path
    return official_mod.load_draft(path)


def official(model, draft, tok, prompt, n, bs):
    from dflash.model_mlx import stream_generate as official_stream

    k = 0
    for r in official_stream(model, draft, tok, prompt, block_size=bs, max_tokens=n):
        k += len(r.tokens)
        if r.tokens:
            yield k


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="length of the synthetic prompt (token ids)")
    ap.add_argument(
        "--prompt",
        help="a text prompt instead (a trained pair accepts little on synthetic ids); '@FILE' reads it from FILE",
    )
    ap.add_argument("--prompts", type=Path, help="a prompt set instead: a JSON list of texts (or {'prompts': [...]})")
    ap.add_argument(
        "--write-copy-edits",
        type=int,
        metavar="N",
        help=f"write N copy-edit prompts from this Python's held-out stdlib to {COPY_EDITS.relative_to(ROOT)} and stop",
    )
    ap.add_argument(
        "--lookup",
        default="off",
        help="comma-separated prompt lookup settings for dflash-mlx: off, on, auto, alone (no drafter)",
    )
    ap.add_argument(
        "--tree-budget",
        default="off",
        help="comma-separated draft-tree settings for dflash-mlx: off, a row budget, auto (docs/trees.md)",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--block-size",
        default="16,auto",
        help="comma-separated block sizes for dflash-mlx (ints or 'auto'); "
        "the official loop runs the first integer one",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--cold",
        action="store_true",
        help="one round and no warm-up: includes the kernel and graph builds a first request pays "
        "(kernel builds, graph builds on CUDA)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.write_copy_edits:
        prompts = copy_edits(args.write_copy_edits, seed=0)
        record = {"python": platform.python_version(), "prompts": prompts}
        COPY_EDITS.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {len(prompts)} prompts to {COPY_EDITS}")
        return
    lookups = args.lookup.split(",")
    if not set(lookups) <= {"off", "on", "auto", "alone"}:
        raise SystemExit(f"--lookup takes off, on, auto and alone; got {args.lookup!r}")
    trees = [None if t == "off" else t if t == "auto" else int(t) for t in args.tree_budget.split(",")]

    from dflash_mlx import load

    tmp = tempfile.TemporaryDirectory()
    if args.model:
        target_dir, draft_dir = args.model, args.draft
    else:
        target_dir, draft_dir = random_pair(args.shape, Path(tmp.name))
    model, draft, tok = load(target_dir, draft=draft_dir)
    blocks = [b if b == "auto" else int(b) for b in args.block_size.split(",")]
    bs = next((b for b in blocks if b != "auto"), draft.config.block_size)
    vocab = draft.config.vocab_size
    if args.prompts:
        texts = json.loads(args.prompts.read_text())
        prompts = [tok.encode(t) for t in (texts["prompts"] if isinstance(texts, dict) else texts)]
    elif args.prompt:
        text = Path(args.prompt[1:]).read_text() if args.prompt.startswith("@") else args.prompt
        prompts = [tok.encode(text)]
    else:
        prompts = [synthetic_prompt(vocab, args.prompt_tokens)]
    args.prompt_tokens = sum(len(p) for p in prompts) // len(prompts)
    setting = {"off": False, "on": True, "auto": "auto", "alone": True}

    have_official = True
    try:
        from mlx_lm import load as mlx_lm_load

        their_model, _ = mlx_lm_load(target_dir)
        their_draft = official_draft(draft_dir)
    except Exception as e:  # the oracle is optional here
        print(f"official loop skipped: {e}", file=sys.stderr)
        have_official = False

    rows = []
    for rep in range(1 if args.cold else args.repeat + 1):  # the first round warms up, unless --cold
        measured = rep or args.cold
        run_on = prompts if measured else prompts[:1]  # the warm-up builds graphs; one prompt does
        round_rows = [timed("plain mlx-lm", [plain(model, p, args.max_tokens) for p in run_on])]
        for block in blocks:
            for lookup, tree in itertools.product(lookups, trees):
                stats: dict = {}
                drafter = None if lookup == "alone" else draft
                runs = [
                    ours(model, drafter, tok, p, args.max_tokens, block, stats, setting[lookup], tree) for p in run_on
                ]
                label = f"dflash-mlx {block}" + ("" if lookup == "off" else f" lookup {lookup}")
                label += "" if tree is None else f" tree {tree}"
                row = timed(label, runs)
                row["acceptance_length"] = round(stats["tokens"] / max(stats["cycles"], 1), 3)
                row["lookup_hits"] = stats["lookup_hits"]
                round_rows.append(row)
        if have_official:
            runs = [official(their_model, their_draft, tok, p, args.max_tokens, bs) for p in run_on]
            round_rows.append(timed("official dflash", runs))
        if measured:
            rows.extend(round_rows)
            for r in round_rows:  # as it goes, so that a run cut short keeps what it measured
                print(f"round {rep}: {r['mode']} {r['decode_tps']:.1f} tok/s", file=sys.stderr, flush=True)

    def median(mode, key):
        vals = sorted(r[key] for r in rows if r["mode"] == mode and key in r)
        return vals[len(vals) // 2] if vals else None

    base = median("plain mlx-lm", "decode_tps")
    summary = {
        "machine": f"{platform.platform()} {platform.processor() or platform.machine()}, mlx {mx.__version__}, device {mx.default_device()}",
        "target": target_dir if args.model else f"random {args.shape}",
        "block_size": bs,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "results": [
            {
                "mode": m,
                "decode_tps": median(m, "decode_tps"),
                "speedup_vs_plain": round(median(m, "decode_tps") / base, 3),
                "acceptance_length": median(m, "acceptance_length"),
                "lookup_hits": median(m, "lookup_hits"),
            }
            for m in dict.fromkeys(r["mode"] for r in rows)
        ],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(summary["machine"])
    print(
        f"target {summary['target']}, block {bs}, {len(prompts)} prompt(s) of {args.prompt_tokens} tokens "
        f"(mean), new tokens {args.max_tokens} each, "
        + ("one cold round (no warm-up)" if args.cold else f"median of {args.repeat}")
    )
    for r in summary["results"]:
        tau = f"  tokens/cycle {r['acceptance_length']}" if r["acceptance_length"] is not None else ""
        hits = f"  lookup hits {r['lookup_hits']}" if r["lookup_hits"] else ""
        print(f"{r['mode']:>28}: {r['decode_tps']:8.1f} tok/s  x{r['speedup_vs_plain']:.2f}{tau}{hits}")


if __name__ == "__main__":
    main()
