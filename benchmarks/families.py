"""Target families on a GPU: a DFlash cycle in plain decode steps, and the
hybrid rollback's own cost, at real shapes with random weights.

    PYTHONPATH=$PWD python benchmarks/families.py [--small] [--out results.json]

Shapes: a Qwen3.5-9B-like hybrid (gated delta-net layers, full attention
every 4th) and a gpt-oss-20b-like MoE (32 experts, top 4, sliding layers with
sinks), each in bf16 and 4-bit. For each it times

- plain: mlx-lm's own decoding (generate_step), ms per token;
- cycle: one DFlash verify cycle (drafter + target over a block + rollback)
  at block sizes 4, 8, 16, through the library's own loop, in ms and in
  plain decode steps (random drafter: the cycle's cost does not depend on how
  many drafts are accepted);
- rollback (hybrid), for each strategy of ``--rollback`` (default both):
  what keeping the first half of a verify's steps adds to the delta-net
  layers' own verify work, ms per cycle, summed over the layers: for
  ``replay`` the re-run of the kept steps from the saved state, for
  ``per-step`` running the recurrence one step at a time, keeping every
  state, and taking the kept one. The hybrid's cycle is timed under each
  strategy too.

    PYTHONPATH=$PWD python benchmarks/families.py --rollback replay,per-step --out rollback.json
    PYTHONPATH=$PWD python benchmarks/families.py --models gpt-oss-20b-like --bits 4 --official
    PYTHONPATH=$PWD python benchmarks/families.py --models gpt-oss-20b-like --bits 16 --prompt-tokens 8192 \
        --attention table,fused

``--attention`` times the cycle with the block-attention kernel where its table picks it
(``table``, the default) and with mlx-lm's fused attention everywhere (``fused``), side by
side; the kernel's table takes a block of 4 at GQA 4 from 1k keys (a block of 16 at any length on
CUDA), so give ``--prompt-tokens`` past 1k to see it everywhere (a hybrid's
prefill off Metal steps its recurrence token by token: keep its prompts short).

``--official`` times the official Z Lab MLX loop's cycle beside ours (same shapes, its own copy of
the target, a random drafter of the same shape in Z Lab's layout); ``--models`` and ``--bits``
choose what to run.

Needs only mlx, mlx-lm and this repository. --small runs tiny shapes (a CPU
smoke test in float32; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from kernel_switches import use_attention
from mlx_lm.generate import generate_step

from dflash_mlx import stream_generate
from dflash_mlx.decode.traces import forget_traces
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


def target(cfg: dict, bits: int | None, dtype=mx.bfloat16):
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(dict(cfg)))
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


def drafter_config(cfg: dict) -> dict:
    n = cfg["num_hidden_layers"]
    return draft_config(
        cfg, layers=1 if cfg["hidden_size"] < 1024 else 5, block_size=16, taps=sorted({1, n // 2, n - 2})
    )


def build(cfg: dict, bits: int | None, dtype=mx.bfloat16):
    model = target(cfg, bits, dtype)
    dcfg = drafter_config(cfg)
    draft = make_draft(dcfg, random_draft_weights(dcfg))
    draft.set_dtype(dtype)
    if bits:
        nn.quantize(draft, group_size=64, bits=bits)
    mx.eval(draft.parameters())
    return model, draft


def official_cycle_ms(cfg: dict, bits: int | None, dtype, tok, prompt, bs: int, n: int) -> float | None:
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
        official.snapshot_download = lambda *a, **k: str(path)  # a local directory, not a Hub id
        try:
            draft = official.load_draft(str(path))
            mx.eval(draft.parameters())  # read before the directory goes
        except Exception as e:
            print(f"official loop: its drafter did not load ({type(e).__name__}: {e})", file=sys.stderr)
            return None
    if bits:
        nn.quantize(draft, group_size=64, bits=bits)
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


def plain_ms(model, prompt, n: int) -> float:
    steps = generate_step(mx.array(prompt), model, max_tokens=n + 4, sampler=lambda x: mx.argmax(x, axis=-1))
    for _ in range(4):
        next(steps)
    t = time.perf_counter()
    for _ in range(n):
        next(steps)
    return (time.perf_counter() - t) * 1000 / n


def cycle_ms(model, draft, tok, prompt, bs: int, n: int) -> float:
    stamps = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=n * bs, block_size=bs):
        stamps.append((time.perf_counter(), r.cycles if hasattr(r, "cycles") else len(stamps)))
    (t0, c0), (t1, c1) = stamps[2], stamps[-1]
    return (t1 - t0) * 1000 / max(c1 - c0, 1)


def rollback_ms(model, prompt, bs: int, reps: int, strategies: list[str]) -> dict[str, float] | None:
    """Per strategy: the delta-net layers' verify of ``bs`` steps then a cut
    to half of them, less the same verify with replay's bookkeeping and no
    cut (the plain work); ms per cycle, over all the layers."""
    target = adapt(model)
    cache = target.make_cache()
    deltas = [(c, layer.linear_attn) for c, layer in zip(cache, target.inner.layers) if isinstance(c, DeltaCache)]
    if not deltas:
        return None
    target(mx.array(prompt)[None], cache, [0])
    mx.eval([c.state for c, _ in deltas])
    n = len(prompt)
    x = (0.1 * mx.random.normal((1, bs, target.hidden_size))).astype(target.dtype)

    def verify(strategy: str, cut: bool) -> float:
        def once():
            out = []
            for c0, layer in deltas:
                c = DeltaCache(strategy)
                c.conv, c.ssm, c.offset, c.bound = c0.conv, c0.ssm, n, n
                y = c.forward(layer, x)
                if cut:
                    c.set_length(mx.array(n + bs // 2, mx.int32), n + bs)
                out += [y, c.conv, c.ssm]
            mx.eval(out)

        once()
        t = time.perf_counter()
        for _ in range(reps):
            once()
        return (time.perf_counter() - t) * 1000 / reps

    plain = verify("replay", cut=False)
    return {strategy: verify(strategy, cut=True) - plain for strategy in strategies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--blocks", default="4,8,16")
    parser.add_argument("--models", default="qwen3.5-9b-like,gpt-oss-20b-like", help="which shapes, comma-separated")
    parser.add_argument("--bits", default="16,4", help="weights: 16 (bf16) and/or 4 (mlx-lm 4-bit), comma-separated")
    parser.add_argument(
        "--official",
        action="store_true",
        help="time the official Z Lab MLX loop's cycle too (pip install --no-deps dflash==0.1.0)",
    )
    parser.add_argument(
        "--rollback",
        default=",".join(ROLLBACKS),
        help=f"the hybrid's rollback strategies to time, comma-separated ({', '.join(ROLLBACKS)})",
    )
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default 256; 32 with --small)")
    parser.add_argument(
        "--attention",
        default="table",
        help="comma-separated, side by side: 'table' (the block-attention kernel where its measured "
        "table picks it: the default) and/or 'fused' (mlx-lm's attention everywhere)",
    )
    args = parser.parse_args()
    attentions = [a.strip() for a in args.attention.split(",") if a.strip()]
    if not attentions or any(a not in ("table", "fused") for a in attentions):
        parser.error(f"--attention takes table and/or fused (comma-separated), not {args.attention!r}.")
    strategies = [r.strip() for r in args.rollback.split(",") if r.strip()]
    unknown = [r for r in strategies if r not in ROLLBACKS]
    if unknown or not strategies:
        parser.error(f"--rollback takes {', '.join(ROLLBACKS)} (comma-separated), not {args.rollback!r}.")
    n = 3 if args.small else 32
    blocks = [int(b) for b in args.blocks.split(",")]
    default_rollback = DeltaCache.rollback
    results = {
        "rollback_default": default_rollback,
        "machine": f"{platform.node()} {platform.machine()} {mx.default_device()}",
        "mlx": mx.__version__,
        "rows": [],
    }
    print(results["machine"])
    shapes = {"qwen3.5-9b-like": qwen35_9b, "gpt-oss-20b-like": gpt_oss_20b}
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    if not chosen or any(m not in shapes for m in chosen):
        parser.error(f"--models takes {', '.join(shapes)} (comma-separated), not {args.models!r}.")
    weights = [None if b.strip() == "16" else int(b) for b in args.bits.split(",") if b.strip()]
    for name in chosen:
        cfg = shapes[name](args.small)
        for bits in weights:
            # MLX's CPU backend gathers MoE experts in float32 only.
            model, draft = build(cfg, bits, mx.float32 if args.small else mx.bfloat16)
            tok = make_tokenizer(cfg["vocab_size"])
            prompt = [(7 * i) % (cfg["vocab_size"] - 1) for i in range(32 if args.small else args.prompt_tokens)]
            plain = plain_ms(model, prompt, n)
            row = {
                "model": name,
                "weights": f"{bits}-bit" if bits else ("float32" if args.small else "bf16"),
                "plain_ms": plain,
                "blocks": {},
            }
            hybrid = any(isinstance(c, DeltaCache) for c in adapt(model).make_cache())
            for bs in blocks:
                rb = rollback_ms(model, prompt, bs, 3 if args.small else 10, strategies)
                cell = row["blocks"][bs] = {"rollback_ms": rb, "cycle_ms": {}, "cycle_in_steps": {}}
                for strategy in strategies if hybrid else ["-"]:
                    DeltaCache.rollback = strategy if hybrid else DeltaCache.rollback
                    for attention in attentions:
                        use_attention(attention)
                        forget_traces(draft)  # compiled cycles hold the attention they were traced with
                        if len(attentions) > 1:
                            cycle_ms(model, draft, tok, prompt, bs, 2)  # this setting's graphs
                        c = cycle_ms(model, draft, tok, prompt, bs, n)
                        key = strategy if len(attentions) == 1 else f"{strategy} {attention}"
                        cell["cycle_ms"][key], cell["cycle_in_steps"][key] = c, c / plain
                        print(
                            f"{name:18} {row['weights']:7} plain {plain:7.2f} ms/token | block {bs:2}: cycle {c:7.2f} ms"
                            f" = {c / plain:4.2f} steps"
                            + (f", attention {attention}" if len(attentions) > 1 else "")
                            + (
                                f" | rollback {strategy:8} {rb[strategy]:7.3f} ms per cycle"
                                f" ({rb[strategy] / c:.1%} of the cycle)"
                                if hybrid
                                else ""
                            )
                        )
                    use_attention("table")
                DeltaCache.rollback = default_rollback
                if args.official:
                    o = official_cycle_ms(cfg, bits, mx.float32 if args.small else mx.bfloat16, tok, prompt, bs, n)
                    cell["official_cycle_ms"] = o
                    print(
                        f"{name:18} {row['weights']:7} official loop, block {bs:2}: "
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
