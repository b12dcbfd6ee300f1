"""A DFlash cycle in plain decode steps for other target families, and the hybrid's rollback share.

Reported in BENCHMARKS.md, "Target families at real shapes" (and docs/families.md).

    python benchmarks/families.py --models qwen3.5-9b-like --bits 16,4 --blocks 4,16 --rollbacks default,replay,per-step
    python benchmarks/families.py --models gpt-oss-20b-like --official
    python benchmarks/families.py --models gpt-oss-20b-like --bits 4,mxfp4 --blocks 4,16
    python benchmarks/families.py --models qwen3.5-9b-like --bits 16 --blocks 16,t16 --repeat 5
    python benchmarks/families.py --small          # tiny shapes: a CPU smoke test, numbers meaningless

Shapes, random weights, bf16 and/or 4-bit: a Qwen3.5-9B-like hybrid (gated
delta-net layers, full attention every 4th) and a gpt-oss-20b-like MoE (32
experts, top 4, sliding layers with sinks). For each it times

- plain: mlx-lm's own decoding (``generate_step``), ms per token;
- adapter plain: our adapter's own plain step (its forward and caches, one
  token a step), ms per token: on a hybrid, the recurrence through the same
  kernel the cycle runs (on CUDA ours; mlx-lm's plain step there is a loop of
  small ops, on a Mac its own kernel);
- cycle: one DFlash cycle through the library's loop at each block size (or
  ``tN``: a draft tree of N nodes from the drafter's block) and delta-net rollback (``--rollbacks``; ``default``: what this machine picks),
  in ms and in plain steps of both (a random drafter: the cycle's cost does
  not depend on how many drafts are accepted);
- each time the median over the run's steps or cycles (a graph traced or a
  kernel built mid-run moves the mean, not the median); with ``--repeat N``,
  N rounds each timing the plain steps and every cycle in turn, and the
  medians of the times and of each round's ratios;
- rollback (hybrid): what the rollback adds to the delta-net layers' verify
  when half of a verify's steps are kept, ms per cycle over the layers;
- with ``--official``: the official Z Lab MLX loop's cycle on the same shapes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from cycle import decoding
from mlx_lm.generate import generate_step
from speed import official_draft

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.targets import adapt
from dflash_mlx.targets.recurrent import ROLLBACKS, DeltaCache
from dflash_mlx.tiny import draft_config, make_draft, make_tokenizer, random_draft_weights, write_zlab_draft


def qwen35_9b(small: bool) -> dict:
    if small:
        h, layers, vocab = 128, 8, 512
        heads, kv, hd, vh, kh, kd, vd, inter = 4, 2, 32, 4, 2, 32, 32, 256
    else:
        h, layers, vocab = 4096, 32, 248320
        heads, kv, hd, vh, kh, kd, vd, inter = 16, 4, 256, 32, 16, 128, 128, 12288
    return {
        "model_type": "qwen3_5",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": inter,
        "linear_num_value_heads": vh,
        "linear_num_key_heads": kh,
        "linear_key_head_dim": kd,
        "linear_value_head_dim": vd,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "rope_parameters": {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    }


def gpt_oss_20b(small: bool) -> dict:
    if small:
        h, layers, vocab, heads, kv, hd, experts, inter = 128, 4, 512, 8, 2, 16, 8, 128
    else:
        h, layers, vocab, heads, kv, hd, experts, inter = 2880, 24, 201088, 64, 8, 64, 32, 2880
    return {
        "model_type": "gpt_oss",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": inter,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "rope_theta": 150000,
        "rms_norm_eps": 1e-5,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
    }


# --models: each family's shapes (``small``: tiny ones, a CPU smoke test)
FAMILIES = {"qwen3.5-9b-like": qwen35_9b, "gpt-oss-20b-like": gpt_oss_20b}

# --bits: mlx-lm's affine quantization, or mxfp4 as mlx-community's gpt-oss conversions hold it
QUANTIZATIONS = {
    "4": {"bits": 4, "group_size": 64},
    "8": {"bits": 8, "group_size": 64},
    "mxfp4": {"bits": 4, "group_size": 32, "mode": "mxfp4"},
}


def quantize(module: nn.Module, bits: str | None) -> None:
    if bits:
        nn.quantize(module, **QUANTIZATIONS[bits])


def target(cfg: dict, bits: str | None, dtype=mx.bfloat16):
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(dict(cfg)))
    model.set_dtype(dtype)
    quantize(model, bits)
    model.eval()  # as mlx-lm's load leaves it: its recurrence kernels run only outside training
    mx.eval(model.parameters())
    return model


def drafter_config(cfg: dict) -> dict:
    n = cfg["num_hidden_layers"]
    return draft_config(
        cfg, layers=1 if cfg["hidden_size"] < 1024 else 5, block_size=16, taps=sorted({1, n // 2, n - 2})
    )


def build(cfg: dict, bits: str | None, dtype=mx.bfloat16):
    model = target(cfg, bits, dtype)
    dcfg = drafter_config(cfg)
    draft = make_draft(dcfg, random_draft_weights(dcfg))
    draft.set_dtype(dtype)
    quantize(draft, bits)
    mx.eval(draft.parameters())
    return model, draft


def official_cycle_ms(cfg: dict, bits: str | None, dtype, tok, prompt, bs: int, n: int) -> float | None:
    """The official Z Lab MLX loop's cycle (``dflash.model_mlx``) on a target
    of its own (it wraps the layers, and patches the delta-net class), with a
    random drafter of the same shape written in Z Lab's layout; None where the
    package is missing or the loop cannot run the family."""
    try:
        import dflash.model_mlx as official
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as d:
        dcfg = drafter_config(cfg)
        path = write_zlab_draft(Path(d) / "draft", dcfg, random_draft_weights(dcfg), dtype=dtype)
        try:
            draft = official_draft(str(path))
            mx.eval(draft.parameters())  # read before the directory goes
        except Exception as e:
            print(f"official loop: its drafter did not load ({type(e).__name__}: {e})", file=sys.stderr)
            return None
    quantize(draft, bits)
    model = target(cfg, bits, dtype)
    stamps = []
    try:
        for r in official.stream_generate(model, draft, tok, prompt, block_size=bs, max_tokens=n * bs):
            if r.tokens:
                stamps.append(time.perf_counter())
    except Exception as e:
        print(f"official loop: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return (stamps[-1] - stamps[2]) * 1000 / max(len(stamps) - 3, 1)


def median_interval(stamps: list[tuple[float, int]], skip: int = 2) -> float:
    """ms per unit (token or cycle) between (time, count) stamps, the median
    over consecutive pairs past the first ``skip``: a spike (a graph traced or
    a kernel built for a new buffer width) does not move it."""
    per = [(t1 - t0) * 1000 / (c1 - c0) for (t0, c0), (t1, c1) in zip(stamps[skip:], stamps[skip + 1 :]) if c1 > c0]
    return statistics.median(per)


def plain_ms(model, prompt, n: int) -> float:
    steps = generate_step(mx.array(prompt), model, max_tokens=n + 4, sampler=lambda x: mx.argmax(x, axis=-1))
    stamps = [(time.perf_counter(), i) for i, _ in enumerate(steps)]
    return median_interval(stamps)


def adapter_plain_ms(model, prompt, n: int) -> float:
    """Our adapter's plain decoding, greedy, one token a step, pipelined as
    mlx-lm's ``generate_step`` is (the next step queued before this one is read)."""
    target = adapt(model)
    cache = target.make_cache()
    logits, _ = target(mx.array(prompt)[None], cache, [0], last_only=True)

    def step(token: mx.array) -> mx.array:
        logits, _ = target(token[None], cache, [0])
        return mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)

    token = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
    stamps = []
    for i in range(n + 4):
        following = step(token)
        mx.async_eval(following)
        token.item()
        stamps.append((time.perf_counter(), i))
        token = following
    return median_interval(stamps)


def cycle_ms(model, draft, tok, prompt, block: int | str, n: int, rollback: str | None = None) -> float:
    """ms per DFlash cycle of ``block`` ("tN": a tree of N nodes from the
    drafter's block), its delta-net layers (if any) rolling back by
    ``rollback`` (None: the default here)."""
    cache = make_prompt_cache(model, draft)
    cache.target[:] = [DeltaCache(rollback) if isinstance(c, DeltaCache) else c for c in cache.target]
    bs = draft.config.block_size if str(block).startswith("t") else block
    stamps = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=n * bs, prompt_cache=cache, **decoding(block)):
        stamps.append((time.perf_counter(), r.cycles))
    return median_interval(stamps)


def rollback_ms(model, prompt, bs: int, reps: int, rollback: str | None = None) -> float | None:
    """The delta-net layers' verify of ``bs`` steps then a cut to half of them
    under ``rollback`` (None: the default here), less the same verify with
    replay's bookkeeping and no cut (the plain work); ms per cycle, over all
    the layers. None for a target without delta-net layers."""
    target = adapt(model)
    cache = target.make_cache()
    deltas = [(c, layer.linear_attn) for c, layer in zip(cache, target.inner.layers) if isinstance(c, DeltaCache)]
    if not deltas:
        return None
    target(mx.array(prompt)[None], cache, [0])
    mx.eval([c.state for c, _ in deltas])
    n = len(prompt)
    x = (0.1 * mx.random.normal((1, bs, target.hidden_size))).astype(target.dtype)

    def verify(strategy: str | None, cut: bool) -> float:
        def once():
            out = []
            for c0, layer in deltas:
                c = DeltaCache(strategy)  # a fresh cache at the prompt's state
                c.conv, c.ssm, c.offset, c.bound = c0.conv, c0.ssm, n, n
                y = c.forward(layer, x)
                if cut:
                    c.set_length(mx.array(n + bs // 2, mx.int32), n + bs)
                out += [y, c.conv, c.ssm]
            mx.eval(out)

        once()
        stamps = [(time.perf_counter(), 0)]
        for i in range(reps):
            once()
            stamps.append((time.perf_counter(), i + 1))
        return median_interval(stamps, skip=0)

    plain = verify("replay", cut=False)
    return verify(rollback, cut=True) - plain


def strategy(rollback: str) -> str | None:
    """A ``--rollbacks`` entry as DeltaCache takes it (None: this machine's default)."""
    return None if rollback == "default" else rollback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--blocks", default="4,8,16", help="block sizes, or tN (a draft tree of N nodes), comma-separated"
    )
    parser.add_argument("--models", default="qwen3.5-9b-like,gpt-oss-20b-like", help="which shapes, comma-separated")
    parser.add_argument(
        "--bits", default="16,4", help="weights: 16 (bf16), 4 or 8 (mlx-lm affine), mxfp4; comma-separated"
    )
    parser.add_argument(
        "--official",
        action="store_true",
        help="time the official Z Lab MLX loop's cycle too (pip install --no-deps dflash==0.1.0)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default 256; 32 with --small)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds, each timing both plain steps and every cycle in turn; medians of the times and of "
        "each round's ratios (for a machine whose speed drifts)",
    )
    parser.add_argument(
        "--rollbacks",
        default="default",
        help=f"the hybrid's delta-net rollbacks to time, comma-separated: default (this machine's), {', '.join(ROLLBACKS)}",
    )
    args = parser.parse_args()
    n = 3 if args.small else 32
    blocks = [b if b.startswith("t") else int(b) for b in args.blocks.split(",")]
    rollbacks = [r.strip() for r in args.rollbacks.split(",") if r.strip()]
    if not rollbacks or any(r not in ("default", *ROLLBACKS) for r in rollbacks):
        parser.error(f"--rollbacks takes default, {', '.join(ROLLBACKS)} (comma-separated), not {args.rollbacks!r}.")
    results = {
        "machine": f"{platform.node()} {platform.machine()} {mx.default_device()}",
        "mlx": mx.__version__,
        "rows": [],
    }
    print(results["machine"])
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    if not chosen or any(m not in FAMILIES for m in chosen):
        parser.error(f"--models takes {', '.join(FAMILIES)} (comma-separated), not {args.models!r}.")
    weights = [None if b.strip() == "16" else b.strip() for b in args.bits.split(",") if b.strip()]
    if not weights or any(b is not None and b not in QUANTIZATIONS for b in weights):
        parser.error(f"--bits takes 16, {', '.join(QUANTIZATIONS)} (comma-separated), not {args.bits!r}.")
    dtype = mx.float32 if args.small else mx.bfloat16  # MLX's CPU backend gathers MoE experts in float32 only
    for name in chosen:
        cfg = FAMILIES[name](args.small)
        for bits in weights:
            model, draft = build(cfg, bits, dtype)
            tok = make_tokenizer(cfg["vocab_size"])
            prompt = [(7 * i) % (cfg["vocab_size"] - 1) for i in range(32 if args.small else args.prompt_tokens)]
            hybrid = any(isinstance(c, DeltaCache) for c in adapt(model).make_cache())
            cases = [(bs, r) for bs in blocks for r in (rollbacks if hybrid else ["default"])]
            rounds = []
            for _ in range(max(1, args.repeat)):  # in turn, so that a drifting machine moves each alike
                plain, ours = plain_ms(model, prompt, n), adapter_plain_ms(model, prompt, n)
                rounds.append(
                    (
                        plain,
                        ours,
                        {case: cycle_ms(model, draft, tok, prompt, case[0], n, strategy(case[1])) for case in cases},
                    )
                )
            plain = statistics.median(r[0] for r in rounds)
            ours = statistics.median(r[1] for r in rounds)
            row = {
                "model": name,
                "weights": (bits if bits == "mxfp4" else f"{bits}-bit")
                if bits
                else ("float32" if args.small else "bf16"),
                "plain_ms": plain,
                "adapter_plain_ms": ours,
                "rounds": len(rounds),
                "blocks": {},
            }
            label = f"{name:18} {row['weights']:7}"
            print(f"{label} plain: mlx-lm {plain:7.2f} ms/token, our adapter {ours:7.2f} ms/token")
            for bs in blocks:
                cells = row["blocks"][bs] = {}
                for rollback in rollbacks if hybrid else ["default"]:
                    # (a tree keeps its accepted path, not a prefix of a block: no block rollback to time)
                    tree = str(bs).startswith("t")
                    rb = None if tree else rollback_ms(model, prompt, bs, 3 if args.small else 10, strategy(rollback))
                    times = [r[2][bs, rollback] for r in rounds]
                    c = statistics.median(times)
                    in_steps = statistics.median(t / r[0] for t, r in zip(times, rounds))
                    in_ours = statistics.median(t / r[1] for t, r in zip(times, rounds))
                    cells[rollback] = {
                        "rollback_ms": rb,
                        "cycle_ms": c,
                        "cycle_in_steps": in_steps,
                        "cycle_in_adapter_steps": in_ours,
                    }
                    print(
                        f"{label} block {bs:>3}"
                        + (f" {rollback:8}" if hybrid else "")
                        + f": cycle {c:7.2f} ms = {in_steps:4.2f} mlx-lm steps = {in_ours:4.2f} adapter steps"
                        + (f" | rollback {rb:7.3f} ms ({rb / c:.1%} of the cycle)" if rb is not None else "")
                    )
                if args.official and not str(bs).startswith("t"):
                    o = official_cycle_ms(cfg, bits, dtype, tok, prompt, bs, n)
                    cells["official_cycle_ms"] = o
                    print(
                        f"{label} official loop, block {bs:2}: "
                        + (f"cycle {o:7.2f} ms = {o / plain:4.2f} steps" if o is not None else "did not run")
                    )
            results["rows"].append(row)
            del model, draft
            mx.clear_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
