"""A DFlash cycle's time in plain mlx-lm decode steps, at a model's shapes.

Reported in BENCHMARKS.md, "Qwen3-8B shapes, random weights" (its table and
"4-bit target"), the cycle paragraph under "The built-in pair" / "H100", and
README.md's Qwen3-8B rows.

    python benchmarks/cycle.py --shape qwen3-8b --prompt-tokens 1024,4096 --blocks 16 --cycles 48 [--cold]
    python benchmarks/cycle.py --shape qwen3-8b --quantize 4 --prompt-tokens 1024 --blocks 4,8,16 --cycles 32
    python benchmarks/cycle.py --shape builtin --prompt-tokens 256 --blocks 16 --cycles 64
    python benchmarks/cycle.py --shape qwen3-8b --prompt-tokens 1024 --blocks 16,t16,t32 --cycles 32
    python benchmarks/cycle.py --shape tiny --prompt-tokens 256 --blocks 16,t24,t32 --cycles 32 --repeat 5 --count-ops
    python benchmarks/cycle.py --shape gemma3-27b-layers --prompt-tokens 64 --blocks 16,t16 --count-ops
    python benchmarks/cycle.py --shape qwen3.5-9b-layers --prompt-tokens 64 --blocks 16,t16 --count-ops
    mlx.launch --backend nccl -n 2 python benchmarks/cycle.py --shape qwen3-8b --split pipeline --blocks 16

Random weights at a model's shapes (nothing to download): the drafter accepts
almost nothing, so every cycle commits about one token and shows a cycle's cost
(``--shape builtin``: the shipped pair). For each prompt length and block:

- plain step ms: mlx-lm's own pipelined decoding (``generate_step``);
- cycle ms: a cycle in the real loop (``stream_generate``), the median (the
  mean, which includes one-off rebuilds when a cache buffer grows, is in the
  --json record); with ``--repeat N`` the median of N such measurements,
  the blocks taking turns (for a shared machine);
- process ms: this process's processor time a cycle (all threads; the mean),
  in the --json record: on a GPU the host's work a cycle;
- synced verify / draft ms: each pass built, then evaluated alone and waited
  for (no overlap);
- cycle in plain steps, and the projected speedup tau x step / cycle at the
  acceptance ``--tau`` (Z Lab's Qwen3-8B figures: ~6.5 math, ~4.3 chat).

``--count-ops`` adds the device operations one cycle's graph holds (on a Mac
each is a Metal dispatch): as built eagerly (the CPU's path), and through
mx.compile (the GPU's path, elementwise chains fused), views left out; and
the host's median ms to build the cycle (eagerly) or replay its trace; and
a plain step's operations, mlx-lm's and ours (eager, as ``auto``'s exact
plain steps run, and compiled). On the CPU each delta-net recurrence, ours
and mlx-lm's, counts as one operation, as its kernel launch on a GPU.
``--shape tiny`` has Qwen3-8B's layer counts at tiny
widths: a cycle's operations without its compute; ``--shape
gemma3-27b-layers`` Gemma 3 27B's (62 layers, 52 of them sliding);
``--shape qwen3.5-9b-layers`` Qwen3.5-9B's (32 layers, 24 of them gated
delta-net).

Under ``mlx.launch`` the target is split across the ranks (``--split``
pipeline or tensor, docs/distributed.md), the drafter whole on each, and only
rank 0 prints. The plain step is then mlx-lm's sharded ``generate_step``
(tensor), or one-token steps through the split adapter queued one ahead as
``generate_step`` queues them (pipeline: mlx-lm's qwen3 has no pipelined
forward). Each row adds the bytes a rank sends to the others per cycle and
per plain step, from the exchanges' shapes (a ring all-sum sends
2 (n - 1) / n of its buffer from each rank).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import re
import tempfile
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream

SHAPES = {
    # hidden, layers, heads, kv heads, head dim, ffn, vocab, drafter layers
    "tiny": (64, 36, 2, 1, 32, 128, 1024, 5),
    "small": (256, 8, 4, 2, 64, 768, 4096, 2),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, 3),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, 5),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, 5),
}


# Other families' layer counts and attention windows at "tiny"'s widths
# (``--count-ops``: a cycle's kernels, where sliding layers keep their own
# bookkeeping): Gemma 3 27B, five sliding layers to a full one; Qwen3.5-9B,
# three gated delta-net layers to an attention one.
LAYOUTS = {
    "gemma3-27b-layers": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 32,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3.5-9b-layers": {
        "model_type": "qwen3_5",
        "num_hidden_layers": 32,
        "full_attention_interval": 4,
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 1,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    },
}


def configs(shape: str) -> tuple[dict, dict]:
    """The target's (qwen3, or a LAYOUTS family's) and the DFlash drafter's
    configs at a model's shapes (SHAPES), as their config.json files would hold them."""
    from dflash_mlx.draft.dflash import default_target_layer_ids

    layout = LAYOUTS.get(shape, {})
    h, layers, heads, kv, hd, ffn, vocab, dlayers = SHAPES["tiny" if layout else shape]
    layers = layout.get("num_hidden_layers", layers)
    target = {
        "model_type": "qwen3",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 40960,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        **layout,
    }
    draft = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": h,
        "num_hidden_layers": dlayers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
        "num_target_layers": layers,
        "block_size": 16,
        "dflash_config": {"target_layer_ids": default_target_layer_ids(layers, dlayers), "mask_token_id": vocab - 1},
    }
    return target, draft


def random_target(shape: str, quantize: int | None = None, group=None, split: str | None = None):
    """An mlx-lm model (qwen3, or a LAYOUTS family) at a model's shapes, random bf16 weights (or
    quantized), split over ``group`` by ``split`` before any weight is made."""
    from dflash_mlx import distributed

    cfg = configs(shape)[0]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    model.eval()  # as mlx-lm's load leaves it: its recurrence kernels run only outside training
    if quantize:
        nn.quantize(model, group_size=64, bits=quantize)
    if split == "pipeline":
        distributed.split_stages(model, group)
    elif split == "tensor":
        model.shard(group)
    mx.eval(model.parameters())
    return model


def random_pair(shape: str, quantize: int | None, group=None, split: str | None = None, draft_bits: int | None = None):
    """The target and drafter at ``shape``'s sizes, random weights; "builtin":
    the shipped pair itself, bf16 (its drafter has four layers, where "small"
    has the same target sizes and two). Every rank makes the same weights.
    ``draft_bits``: the drafter's layers quantized as ``--draft-bits`` does."""
    from dflash_mlx import DFlashDraft, DraftConfig, load
    from dflash_mlx.draft import precision
    from dflash_mlx.targets import adapt

    if shape == "builtin":
        if quantize and group is not None:
            raise ValueError("--quantize with --shape builtin runs on one process; leave out one of them.")
        model, draft, _ = load("builtin", dtype="bfloat16", group=group, split=split or "auto")
        if quantize:
            nn.quantize(model, group_size=64, bits=quantize)
    else:
        mx.random.seed(0)
        model = random_target(shape, quantize, group, split)
        draft = DFlashDraft(DraftConfig.from_dict(configs(shape)[1]))
        draft.set_dtype(mx.bfloat16)
        mx.eval(draft.parameters())
    if draft_bits:
        precision.quantize(draft, draft_bits)
    if shape != "builtin" or quantize or draft_bits:
        draft.bind(adapt(model))
    return model, draft


def synthetic_prompt(vocab: int, n: int) -> list[int]:
    """``n`` token ids spread over the vocabulary (nothing to tokenize)."""
    return [(i * 7919) % (vocab - 2) + 1 for i in range(n)]


def prefilled(model, draft, prompt: list[int]):
    """The pair's adapter and a prompt cache holding ``prompt``."""
    from dflash_mlx import make_prompt_cache
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.targets import adapt

    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    prefill(target, draft, cache, prompt, 2048, None)
    return target, cache


def synced_ms(fn, repeat: int = 7) -> float:
    """The median ms of ``repeat`` runs of ``fn`` evaluated and waited for
    (after one untimed run)."""
    times = []
    for _ in range(repeat + 1):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1000 * sorted(times[1:])[repeat // 2]


def plain_step_ms(model, prompt: list[int], steps: int) -> float:
    from dflash_mlx.targets import adapt

    if adapt(model).pipeline_size > 1:
        return split_step_ms(model, prompt, steps)
    times = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=steps + 1, sampler=lambda x: mx.argmax(x, axis=-1)):
        times.append(time.perf_counter())
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)


def split_step_ms(model, prompt: list[int], steps: int) -> float:
    """A plain greedy step of a pipelined target through its adapter, each
    step queued before the last one's token is read (as generate_step);
    it taps the last layer only, the least the adapter's exchange carries."""
    from dflash_mlx.targets import adapt

    target = adapt(model)
    cache, taps = target.make_cache(), [target.num_layers - 1]

    def step(ids: mx.array) -> mx.array:
        logits, _ = target(ids[None], cache, taps, last_only=True)
        return mx.argmax(logits[0, -1], axis=-1, keepdims=True)

    with mx.stream(generation_stream):
        head = prompt[:-1]
        for i in range(0, len(head), 2048):
            logits, _ = target(mx.array(head[i : i + 2048])[None], cache, taps, last_only=True)
            mx.eval(logits, [c.keys for c in cache])
        y = step(mx.array(prompt[-1:]))
    mx.async_eval(y)
    times = []
    for _ in range(steps + 1):
        with mx.stream(generation_stream):
            following = step(y)
        mx.async_eval(following)
        y.item()
        times.append(time.perf_counter())
        y = following
    mx.eval(y)
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)


def sent_bytes(target, rows: int, taps: int) -> int:
    """Bytes the busiest rank sends to the others for one target call over
    ``rows`` rows tapping ``taps`` layers (targets/base.py's exchanges)."""
    ranks = target.group.size()
    row = target.hidden_size * target.dtype.size
    ring = 2 * (ranks - 1) / ranks  # of an all-sum's buffer, sent by each rank
    if target.tensor_group is not None:  # mlx-lm's sharded layers: an all-sum after attention, one after the MLP
        return round(2 * target.num_layers * ring * rows * row)
    return round(rows * row + ring * (taps + 1) * rows * row)  # the hidden state on, then taps and output to all


def decoding(block: int | str) -> dict:
    """stream_generate's arguments for a ``--blocks`` entry: a block size or
    "auto", or "tN": draft trees of N rows from the drafter's block."""
    return {"tree_budget": int(block[1:])} if str(block).startswith("t") else {"block_size": block}


def dflash_cycle(model, draft, tokenizer, prompt, cycles: int, block: int | str) -> dict:
    """A cycle in the real loop; ``block`` "tN": draft trees of N rows."""
    from dflash_mlx import stream_generate

    marks, busy, n = [], [], 0
    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=cycles + 1, **decoding(block)):
        marks.append(time.perf_counter())
        busy.append(time.process_time())
        n = r.cycles
    gaps = sorted(b - a for a, b in zip(marks[1:], marks[2:]))
    cycle_s = gaps[len(gaps) // 2]  # the median: a buffer growth's one-off rebuilds show in the mean
    mean_s = (marks[-1] - marks[0]) / max(n, 1)
    # this process's processor time a cycle, all its threads: on a GPU the host's work, on the CPU
    # the computing too; a busy shared machine slows it less than the wall clock
    process_s = (busy[-1] - busy[0]) / max(n, 1)
    return {"cycle_ms": 1000 * cycle_s, "mean_cycle_ms": 1000 * mean_s, "process_ms": 1000 * process_s, "cycles": n}


def synced_pieces(model, draft, prompt, block: int | str) -> dict:
    """Verify and draft passes at this context, each built then evaluated alone
    (``block`` "tN": a tree of N rows, the drafter at its trained block)."""
    from dflash_mlx.kv.tree import chain

    target, cache = prefilled(model, draft, prompt)
    tree = chain(int(block[1:])) if isinstance(block, str) else None
    rows = block if tree is None else tree.size
    block = block if tree is None else draft.config.block_size
    taps = list(draft.config.target_layer_ids)
    mask = draft.config.mask_token_id
    out = {}
    for name in ("verify", "draft"):
        build, run = [], []
        for _ in range(6):
            cache.settle()
            length = mx.array(len(prompt), mx.int32)
            for c in cache.target + cache.draft:
                c.set_length(length, len(prompt))
            tic = time.perf_counter()
            if name == "verify":
                target.set_tree(cache.target, tree)  # a tree's mask and positions, or none
                logits, hidden = target(mx.array([[1] * rows]), cache.target, taps)
                target.set_tree(cache.target, None)
                y = [logits, hidden]
            else:
                y = [draft(mx.array([[1] + [mask] * (block - 1)]), None, cache.draft)]
            mid = time.perf_counter()
            mx.eval(y)
            end = time.perf_counter()
            build.append(mid - tic)
            run.append(end - mid)
        out[f"{name}_build_ms"] = 1000 * sorted(build[1:])[2]
        out[f"{name}_synced_ms"] = 1000 * (sorted(build[1:])[2] + sorted(run[1:])[2])
    cache.settle()
    return out


# Primitives that make a view or nothing: no kernel of their own.
VIEWS = {"Broadcast", "Reshape", "Flatten", "Unflatten", "Squeeze", "ExpandDims", "Transpose", "Slice", "Split"}
VIEWS |= {"AsStrided", "StopGradient", "Depends"}


def graph_ops(outputs: list) -> Counter:
    """The kernels that make ``outputs`` from evaluated arrays, by primitive
    (mx.export_to_dot's boxes): views left out, a concatenation one copy per input."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "graph.dot")
        mx.export_to_dot(path, *outputs)
        with open(path) as f:
            text = f.read()
    names = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]', text))
    inputs = Counter(re.findall(r"-> (\d+)$", text, flags=re.M))
    ops = Counter()
    for node, name in names.items():
        if name not in VIEWS:
            ops[name] += inputs[node] if name == "Concatenate" else 1
    return ops


@contextlib.contextmanager
def recurrence_as_one_launch():
    """Where no gated delta-net kernel runs (the CPU), each recurrence call
    one stand-in operation, as a GPU's kernel launch is, and replay rollback
    as there: for counting and building a cycle, never for its values."""
    from dflash_mlx.device import backend
    from dflash_mlx.targets import recurrent

    if backend() != "cpu":
        yield
        return

    def recurrence(q, k, v, g, beta, state, steps=None, use_kernel=True):
        return v * 1, state + 0

    def tree_recurrence(q, k, v, g, beta, state, parents=None, keep_all=True, use_kernel=True):
        return v * 1, mx.broadcast_to(state, (q.shape[1] + 1, *state.shape)) + 0

    def mlx_lm_recurrence(q, k, v, g, beta, state, mask=None):  # (mlx-lm's, one Metal kernel on a Mac)
        return v * 1, state + 0

    from mlx_lm.models import gated_delta

    real = recurrent.recurrence, recurrent.tree_recurrence, recurrent.DeltaCache.rollback, gated_delta.gated_delta_ops
    recurrent.recurrence, recurrent.tree_recurrence = recurrence, tree_recurrence
    recurrent.DeltaCache.rollback = "replay"
    gated_delta.gated_delta_ops = mlx_lm_recurrence
    try:
        yield
    finally:
        recurrent.recurrence, recurrent.tree_recurrence, recurrent.DeltaCache.rollback, gated_delta.gated_delta_ops = (
            real
        )


def mlx_lm_step_ops(model, prompt: list[int]) -> int:
    """The device operations of mlx-lm's own plain step after ``prompt``."""
    from mlx_lm.models.cache import make_prompt_cache

    def states(cache) -> list:
        return [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]

    with recurrence_as_one_launch():
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        mx.eval(states(cache))
        logits = model(mx.array([[prompt[-1]]]), cache=cache)
        return sum(graph_ops([logits, *states(cache)]).values())


def cycle_graph(model, draft, prompt, block: int | str, compiled: bool, builds: int = 9) -> tuple[Counter, float]:
    """The operations of one greedy cycle of ``block`` ("tN": a tree of N
    rows) after ``prompt``, eagerly or through mx.compile (what a GPU runs),
    and the host's median ms to build it (a compiled cycle: to replay its
    trace), never evaluating inside the timing."""
    from dflash_mlx.decode.cycle import Cycle
    from dflash_mlx.decode.sampling import SamplingParams
    from dflash_mlx.draft.tree import TreeParams

    with recurrence_as_one_launch():
        target, cache = prefilled(model, draft, prompt)
        tree = TreeParams(draft.config.block_size) if isinstance(block, str) else None
        size = int(str(block).lstrip("t"))
        cycle = Cycle(target, draft, cache, SamplingParams(), 0, tree=tree)
        cycle.compiled = compiled
        last, length, ops, times = mx.array([1], mx.int32), mx.array(len(prompt), mx.int32), None, []
        for _ in range(builds):
            bound = len(prompt) + size  # (nothing is accepted: at least the length)
            tic = time.perf_counter()
            if compiled:
                out = cycle._run_compiled(size, last, length, bound)
            else:
                out = cycle._build(size, last, length, bound, None, read="bound")
                target.set_length(cache.target, out[2], bound + size)
            times.append(time.perf_counter() - tic)
            if ops is None:
                ops = graph_ops([a for a in out if isinstance(a, mx.array)] + cache.arrays())
            mx.eval(out[0], *cache.arrays())
            cache.settle()
            length = mx.array(len(prompt), mx.int32)
    return ops, 1000 * sorted(times[1:])[len(times[1:]) // 2]  # (the first: a trace)


MODES = (("eager", False), ("compiled", True))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES) + sorted(LAYOUTS) + ["builtin"],
        default="small",
        help="a model's sizes with random weights, or builtin: the shipped pair",
    )
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="mlx-lm quantization of the target (bits)")
    ap.add_argument("--draft-bits", type=int, choices=[4, 8], help="the drafter's layers quantized (--draft-bits)")
    ap.add_argument("--prompt-tokens", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--blocks", default="16", help="comma-separated block sizes; tN: draft trees of N rows")
    ap.add_argument("--cycles", type=int, default=64, help="cycles timed per measurement")
    ap.add_argument("--repeat", type=int, default=1, help="measurements of each block, interleaved: the median")
    ap.add_argument("--tau", type=float, default=6.5, help="acceptance length for the projected speedup")
    ap.add_argument("--cold", action="store_true", help="no warm-up: what a fresh process's first request pays")
    ap.add_argument(
        "--split", choices=["pipeline", "tensor"], help="under mlx.launch: how the target is split (default pipeline)"
    )
    ap.add_argument("--count-ops", action="store_true", help="also the device operations one cycle's graph holds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dflash_mlx import distributed
    from dflash_mlx.targets import adapt
    from dflash_mlx.tiny import make_tokenizer

    group = distributed.world()
    if args.split and group is None:
        ap.error("--split splits the target across ranks; run under mlx.launch (e.g. mlx.launch -n 2 python ...).")
    split = (args.split or "pipeline") if group is not None else None
    model, draft = random_pair(args.shape, args.quantize, group, split, args.draft_bits)
    target = adapt(model)
    tokenizer = make_tokenizer(64)
    vocab = draft.config.vocab_size
    blocks = [b if b.startswith("t") else int(b) for b in args.blocks.split(",")]
    rows, plain_ops = [], []
    for P in [int(p) for p in args.prompt_tokens.split(",")]:
        prompt = synthetic_prompt(vocab, P)
        if not args.cold:
            plain_step_ms(model, prompt, args.cycles)
            for block in blocks:
                dflash_cycle(model, draft, tokenizer, prompt, args.cycles, block)
        step = plain_step_ms(model, prompt, args.cycles)
        runs = {block: [] for block in blocks}
        for _ in range(args.repeat):  # interleaved, so that a busy machine slows every block alike
            for block in blocks:
                runs[block].append(dflash_cycle(model, draft, tokenizer, prompt, args.cycles, block))
        if args.count_ops:
            ours = {mode: sum(cycle_graph(model, draft, prompt, 1, compiled)[0].values()) for mode, compiled in MODES}
            plain_ops.append((P, mlx_lm_step_ops(model, prompt), ours))
        for block in blocks:
            row = {"prompt_tokens": P, "block": block, "plain_step_ms": step}
            row.update(sorted(runs[block], key=lambda r: r["cycle_ms"])[args.repeat // 2])
            row.update(synced_pieces(model, draft, prompt, block))
            if args.count_ops:
                for mode, compiled in MODES:
                    ops, build_ms = cycle_graph(model, draft, prompt, block, compiled)
                    row[f"{mode}_ops"], row[f"{mode}_build_ms"] = sum(ops.values()), build_ms
            row["cycle_in_plain_steps"] = row["cycle_ms"] / step
            row["projected_speedup"] = args.tau * step / row["cycle_ms"]
            if group is not None:
                taps = len(draft.config.target_layer_ids)
                row["cycle_sent_bytes"] = sent_bytes(target, int(str(block).lstrip("t")), taps)
                row["plain_step_sent_bytes"] = sent_bytes(target, 1, 1)
            rows.append(row)
    record = {
        "machine": f"{platform.platform()} {platform.processor() or platform.machine()}, mlx {mx.__version__}, "
        f"device {mx.default_device()}",
        "shape": args.shape
        + (f" {args.quantize}-bit" if args.quantize else " bf16")
        + (f", drafter {args.draft_bits}-bit" if args.draft_bits else ""),
        "mode": "cold (first request)" if args.cold else "warm",
        "split": f"{split} over {group.size()} ranks" if group is not None else "one process",
        "tau": args.tau,
        "rows": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
    }
    if plain_ops:
        record["plain_step_ops"] = [{"prompt_tokens": P, "mlx_lm": n, **ours} for P, n, ours in plain_ops]
    if not distributed.is_first_rank(group):
        return
    if args.json:
        print(json.dumps(record, indent=2))
        return
    print(record["machine"])
    print(f"{record['shape']}, {record['mode']}, {record['split']}, projected at tau {args.tau}")
    print(
        f"{'prompt':>6} {'block':>5} {'step ms':>8} {'cycle ms':>9} {'verify ms':>10} {'draft ms':>9} "
        f"{'steps':>6} {'x plain':>8}"
    )
    for r in record.get("plain_step_ops", []):
        print(
            f"{r['prompt_tokens']:>6} plain step, device operations: mlx-lm's {r['mlx_lm']}; "
            f"ours {r['eager']} eager, {r['compiled']} compiled"
        )
    for r in record["rows"]:
        print(
            f"{r['prompt_tokens']:>6} {r['block']:>5} {r['plain_step_ms']:>8.2f} {r['cycle_ms']:>9.2f} "
            f"{r['verify_synced_ms']:>10.2f} {r['draft_synced_ms']:>9.2f} "
            f"{r['cycle_in_plain_steps']:>6.2f} {r['projected_speedup']:>8.2f}"
        )
        if "eager_ops" in r:
            print(
                f"{'':>12} device operations a cycle: {r['eager_ops']} eager, {r['compiled_ops']} compiled; "
                f"host ms to build it: {r['eager_build_ms']:.2f} eager, {r['compiled_build_ms']:.2f} compiled"
            )
        if "cycle_sent_bytes" in r:
            print(
                f"{'':>12} sent per rank: {r['cycle_sent_bytes'] / 1024:.1f} KiB a cycle, "
                f"{r['plain_step_sent_bytes'] / 1024:.1f} KiB a plain step"
            )


if __name__ == "__main__":
    main()
