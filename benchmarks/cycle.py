"""What a DFlash cycle costs against a plain decoding step, and where the time goes.

    python benchmarks/cycle.py --shape qwen3-8b --prompt-tokens 1024,4096 --blocks 4,8,16 --tau 6.5
    python benchmarks/cycle.py --shape qwen3-8b --quantize 4 --blocks 4,8,16
    python benchmarks/cycle.py --shape qwen3-8b --cold        # a fresh process's first request

Random weights at a model's shapes (nothing to download): the drafter accepts
almost nothing, so every cycle commits about one token and tok/s is 1 / cycle
time (``--shape builtin``: the shipped pair, whose drafter accepts some of
the synthetic prompt's continuation; the cycle's time is what is reported). For each prompt length it reports, per mode:

- plain step ms: mlx-lm's own pipelined decoding (``generate_step``);
- cycle ms: a DFlash cycle in the real loop (``stream_generate``), the median
  (the mean, which includes the one-off rebuilds when a cache buffer grows, is
  in the --json record);
- host ms: the loop's own work per cycle, building and queuing the next
  cycle's graph (Python, then the backend encoding kernels in async_eval),
  split in the --json record into the drafter's and the target's graph
  building and async_eval;
- wait ms: the time per cycle the host waits for the device's result;
  pipelining works when this is well above zero, i.e. the host is done with
  cycle n+1 before the device finishes cycle n;
- synced verify / draft ms: each piece built, then evaluated alone and waited
  for (kernel launches and device time, no overlap);
- cycle in plain steps, and the projected speedup tau x step / cycle for the
  acceptance ``--tau`` (Z Lab's Qwen3-8B figures: ~6.5 math, ~4.3 chat);
- with ``--pad-ms 0,2,4,8`` (GPUs): the cycle again with that much device
  time queued after each cycle's kernels (device_pad.py), and from it the
  device's busy time per cycle (cycle - pad, once the pad grows the cycle)
  and its idle time (the unpadded cycle - busy): the host's time on the
  critical path.

Prints the machine; ``--json`` for a record.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from dflash_mlx.decode.cycle import Cycle

SHAPES = {
    # hidden, layers, heads, kv heads, head dim, ffn, vocab, drafter layers
    "small": (256, 8, 4, 2, 64, 768, 4096, 2),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, 3),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, 5),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, 5),
}


def configs(shape: str) -> tuple[dict, dict]:
    """The qwen3 target's and the DFlash drafter's configs at a model's shapes
    (SHAPES), as their config.json files would hold them."""
    from dflash_mlx.draft.dflash import default_target_layer_ids

    h, layers, heads, kv, hd, ffn, vocab, dlayers = SHAPES[shape]
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


def random_target(shape: str, quantize: int | None = None):
    """An mlx-lm qwen3 model at a model's shapes, random bf16 weights (or quantized)."""
    from mlx_lm.models.qwen3 import Model, ModelArgs

    model = Model(ModelArgs.from_dict(configs(shape)[0]))
    model.set_dtype(mx.bfloat16)
    if quantize:
        nn.quantize(model, group_size=64, bits=quantize)
    mx.eval(model.parameters())
    return model


def random_pair(shape: str, quantize: int | None):
    """The target and drafter at ``shape``'s sizes, random weights; "builtin":
    the shipped pair itself, bf16 (its drafter has four layers, where "small"
    has the same target sizes and two)."""
    from dflash_mlx import DFlashDraft, DraftConfig, load
    from dflash_mlx.targets import adapt

    if shape == "builtin":
        model, draft, _ = load("builtin", dtype="bfloat16")
        if quantize:
            nn.quantize(model, group_size=64, bits=quantize)
            draft.bind(adapt(model))
        return model, draft
    model = random_target(shape, quantize)
    draft = DFlashDraft(DraftConfig.from_dict(configs(shape)[1]))
    draft.set_dtype(mx.bfloat16)
    mx.eval(draft.parameters())
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
    times = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=steps + 1, sampler=lambda x: mx.argmax(x, axis=-1)):
        times.append(time.perf_counter())
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)


class LaunchClock:
    """Time spent in Cycle.launch (the host's work per cycle), and inside it
    in the drafter's and the target's graph building and in mx.async_eval."""

    PARTS = ("draft", "target", "async_eval")

    def __init__(self):
        from dflash_mlx.draft.dflash import DFlashDraft
        from dflash_mlx.targets.base import DenseTarget

        self.reset()
        self._wrap(Cycle, "launch", "launch")
        self._wrap(DFlashDraft, "__call__", "draft")
        self._wrap(DenseTarget, "__call__", "target")
        self._wrap(mx, "async_eval", "async_eval")

    def _wrap(self, owner, name, part):
        real, clock = getattr(owner, name), self

        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                clock.seconds[part] = clock.seconds.get(part, 0.0) + time.perf_counter() - tic
                if part == "launch":
                    clock.calls += 1

        setattr(owner, name, timed)

    def reset(self):
        self.seconds, self.calls = {}, 0

    def per_cycle_ms(self, part: str) -> float:
        return 1000 * self.seconds.get(part, 0.0) / max(self.calls, 1)


def dflash_cycle(model, draft, tokenizer, prompt, cycles: int, block: int, clock: LaunchClock) -> dict:
    from dflash_mlx import stream_generate

    clock.reset()
    marks, n = [], 0
    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=cycles + 1, block_size=block):
        marks.append(time.perf_counter())
        n = r.cycles
    gaps = sorted(b - a for a, b in zip(marks[1:], marks[2:]))
    cycle_s = gaps[len(gaps) // 2]  # the median: a buffer growth's one-off rebuilds show in the mean
    mean_s = (marks[-1] - marks[0]) / max(n, 1)
    host_s = clock.per_cycle_ms("launch") / 1000
    return {
        "cycle_ms": 1000 * cycle_s,
        "mean_cycle_ms": 1000 * mean_s,
        "host_ms": 1000 * host_s,
        "wait_ms": 1000 * max(mean_s - host_s, 0.0),
        "cycles": n,
        **{f"host_{p}_ms": clock.per_cycle_ms(p) for p in LaunchClock.PARTS},
    }


def padded_cycles(pad, pads: list[float], cycle_ms: float, run) -> list[dict]:
    """The cycle with each of ``pads`` ms of device time queued after its
    kernels: the device's busy time (cycle - pad) and idle time (``cycle_ms``,
    the unpadded cycle, less busy) per pad; meaningful where the pad grew
    the cycle (device_pad.py)."""
    out = []
    try:
        for p in pads:
            pad.add_to(Cycle, p)
            padded = run()["cycle_ms"]
            busy = padded - p
            out.append(
                {
                    "pad_ms": p,
                    "cycle_ms": round(padded, 3),
                    "busy_ms": round(busy, 3),
                    "idle_ms": round(cycle_ms - busy, 3),
                }
            )
    finally:
        pad.add_to(Cycle, 0.0)
    return out


def synced_pieces(model, draft, prompt, block: int) -> dict:
    """Verify and draft passes at this context, each built then evaluated alone."""
    target, cache = prefilled(model, draft, prompt)
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
                logits, hidden = target(mx.array([[1] * block]), cache.target, taps)
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


def main():
    from kernel_switches import (
        add_attention_argument,
        add_kernel_arguments,
        add_scalars_argument,
        kernel_settings,
        use_attention,
        use_kernels,
        use_scalars,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES) + ["builtin"],
        default="small",
        help="a model's sizes with random weights, or builtin: the shipped pair",
    )
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="mlx-lm quantization of the target (bits)")
    ap.add_argument("--prompt-tokens", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--blocks", default="16", help="comma-separated block sizes")
    ap.add_argument("--cycles", type=int, default=64, help="cycles timed per measurement")
    ap.add_argument("--tau", type=float, default=6.5, help="acceptance length for the projected speedup")
    ap.add_argument("--cold", action="store_true", help="no warm-up: what a fresh process's first request pays")
    ap.add_argument(
        "--compile",
        choices=["default", "on", "off"],
        default="default",
        help="trace each cycle with mx.compile (default: on a GPU)",
    )
    ap.add_argument(
        "--fuse",
        choices=["on", "off", "both"],
        default="on",
        help="fused q/k/v and gate/up products in the target's layers (the default), plain "
        "mlx-lm layers, or both side by side in one run",
    )
    ap.add_argument(
        "--fuse-draft",
        choices=["on", "off", "both"],
        default="on",
        help="fused products in the drafter's layers (the default), its modules, or both",
    )
    add_attention_argument(ap, "side by side")
    add_kernel_arguments(ap, "side by side")
    add_scalars_argument(ap, "side by side")
    ap.add_argument(
        "--sources",
        choices=["compact", "full"],
        default="compact",
        help="kernel sources as launched: compact (the default: no comments or indentation, since MLX's "
        "CUDA backend hashes a custom kernel's source at every launch) or as written; one per process",
    )
    ap.add_argument(
        "--pad-ms",
        default="",
        help="comma-separated device pads per cycle (GPUs; see device_pad.py), "
        "e.g. 0,2,4,8: the device's busy and idle time per cycle",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pads = [float(p) for p in args.pad_ms.split(",")] if args.pad_ms else []
    if pads and min(pads) < 0:
        raise SystemExit("--pad-ms takes device milliseconds of 0 or more, e.g. 0,2,4,8.")

    from dflash_mlx.decode.traces import forget_traces
    from dflash_mlx.kernels import launch_source
    from dflash_mlx.targets import Qwen3Target as DenseTarget  # the family random_pair makes
    from dflash_mlx.tiny import make_tokenizer

    launch_source.COMPACT_SOURCES = args.sources == "compact"  # (before any kernel is made)
    Cycle.compile_graphs = {"default": None, "on": True, "off": False}[args.compile]
    model, draft = random_pair(args.shape, args.quantize)
    tokenizer = make_tokenizer(64)
    vocab = draft.config.vocab_size
    clock = LaunchClock()
    pad = None
    if pads:
        from device_pad import DevicePad

        pad = DevicePad()
    rows = []
    for P in [int(p) for p in args.prompt_tokens.split(",")]:
        prompt = synthetic_prompt(vocab, P)
        if not args.cold:
            plain_step_ms(model, prompt, args.cycles)
            for block in [int(b) for b in args.blocks.split(",")]:
                dflash_cycle(model, draft, tokenizer, prompt, args.cycles, block, clock)
        step = plain_step_ms(model, prompt, args.cycles)
        settings = [
            (t, d, a, n, m, w)
            for t in ([True, False] if args.fuse == "both" else [args.fuse == "on"])
            for d in ([True, False] if args.fuse_draft == "both" else [args.fuse_draft == "on"])
            for a in args.attention.split(",")
            for n, m in kernel_settings(args)
            for w in args.scalars.split(",")
        ]
        for fuse, fuse_draft, attention, norm, products, scalars in settings:
            use_kernels(norm_rope=norm, products=products)
            use_scalars(scalars)
            DenseTarget.fuse_projections = fuse
            type(draft).fuse_projections = fuse_draft
            use_attention(attention)
            forget_traces(draft)  # compiled cycles hold the attention they were traced with
            for block in [int(b) for b in args.blocks.split(",")]:
                row = {
                    "prompt_tokens": P,
                    "block": block,
                    "fused": fuse,
                    "draft_fused": fuse_draft,
                    "attention": attention,
                    "norm_rope": norm,
                    "products": products,
                    "scalars": scalars,
                    "plain_step_ms": step,
                }
                if len(settings) > 1:  # a warm-up of this setting's graphs
                    dflash_cycle(model, draft, tokenizer, prompt, 8, block, clock)
                row.update(dflash_cycle(model, draft, tokenizer, prompt, args.cycles, block, clock))
                if pad is not None:
                    row["pads"] = padded_cycles(
                        pad,
                        pads,
                        row["cycle_ms"],
                        lambda: dflash_cycle(model, draft, tokenizer, prompt, args.cycles, block, clock),
                    )
                row.update(synced_pieces(model, draft, prompt, block))
                clock.reset()
                row["cycle_in_plain_steps"] = row["cycle_ms"] / step
                row["projected_speedup"] = args.tau * step / row["cycle_ms"]
                rows.append(row)
    record = {
        "machine": f"{platform.platform()} {platform.processor() or platform.machine()}, mlx {mx.__version__}, "
        f"device {mx.default_device()}",
        "shape": args.shape + (f" {args.quantize}-bit" if args.quantize else " bf16"),
        "mode": "cold (first request)" if args.cold else "warm",
        "compiled": args.compile,
        "tau": args.tau,
        **({"pad_steps_per_ms": round(pad.steps_per_ms)} if pad is not None else {}),
        "rows": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
    }
    if args.json:
        print(json.dumps(record, indent=2))
        return
    print(record["machine"])
    print(f"{record['shape']}, {record['mode']}, compiled={args.compile}, projected at tau {args.tau}")
    print(
        f"{'prompt':>6} {'block':>5} {'fused':>5} {'draft':>5} {'attn':>10} {'norm':>5} {'prod':>12} {'scal':>6} {'step ms':>8} {'cycle ms':>9} {'host ms':>8} {'wait ms':>8} "
        f"{'verify ms':>10} {'draft ms':>9} {'steps':>6} {'x plain':>8}"
    )
    for r in record["rows"]:
        print(
            f"{r['prompt_tokens']:>6} {r['block']:>5} {'yes' if r['fused'] else 'no':>5} {'yes' if r['draft_fused'] else 'no':>5} {r['attention'][:10]:>10} {r['norm_rope'][:5]:>5} {r['products']:>12} {r['scalars']:>6} {r['plain_step_ms']:>8.2f} {r['cycle_ms']:>9.2f} "
            f"{r['host_ms']:>8.2f} {r['wait_ms']:>8.2f} {r['verify_synced_ms']:>10.2f} {r['draft_synced_ms']:>9.2f} "
            f"{r['cycle_in_plain_steps']:>6.2f} {r['projected_speedup']:>8.2f}"
        )
    padded = [r for r in record["rows"] if r.get("pads")]
    if padded:
        print(
            "device pads (device_pad.py): busy = padded cycle - pad, idle = the row's cycle - busy; read them "
            "where the pad grew the cycle"
        )
        print(
            f"{'prompt':>6} {'block':>5} {'attn':>10} {'prod':>12} {'scal':>6} {'cycle ms':>9} {'pad ms':>7} {'padded':>8} "
            f"{'busy ms':>8} {'idle ms':>8}"
        )
        for r in padded:
            for q in r["pads"]:
                print(
                    f"{r['prompt_tokens']:>6} {r['block']:>5} {r['attention'][:10]:>10} {r['products']:>12} "
                    f"{r['scalars']:>6} {r['cycle_ms']:>9.2f} {q['pad_ms']:>7.2f} {q['cycle_ms']:>8.2f} {q['busy_ms']:>8.2f} "
                    f"{q['idle_ms']:>8.2f}"
                )


if __name__ == "__main__":
    main()
