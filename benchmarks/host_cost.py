"""What each kind of operation costs the host to launch, against the device's time for it.

    python benchmarks/host_cost.py                      # Qwen3-8B shapes, bf16
    python benchmarks/host_cost.py --hidden 2560 --ffn 9728 --json

A DFlash cycle at real model sizes on MLX's CUDA backend is bound by the host
(benchmarks/cycle.py: ~15 ms of launching per cycle against a device that
would be done sooner). This script says which operations that time is spent
on: for each kind it builds ``--repeat`` independent copies (as a 36-layer
forward would), then times

- build: Python building the graph;
- launch: inside ``mx.async_eval`` (the backend encoding the kernels);
- total: build + launch + waiting for the device;

per operation, in microseconds, the median of ``--runs`` runs. An operation
whose launch is far above another's for the same work is where a cycle's
host time goes, and what to fuse, replace or avoid.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import mlx.core as mx
import mlx.nn as nn


def cases(args):
    """(name, make) pairs; make(i) builds one copy's output from fresh inputs."""
    H, F, hq, hkv, D, dt = args.hidden, args.ffn, args.heads, args.kv_heads, 128, getattr(mx, args.dtype)
    keys = args.keys
    B = args.block
    r = lambda *s: (mx.random.normal(s) * 0.02).astype(dt)  # noqa: E731
    w_h, w_qkv, w_f, w_gu = r(H, H), r(H + 2 * hkv * D, H), r(F, H), r(2 * F, H)
    x1, xb = r(1, 1, H), r(1, B, H)
    qw = nn.QuantizedLinear(H, H, bias=False, group_size=64, bits=4)
    kbuf, vbuf = r(1, hkv, keys + 256, D), r(1, hkv, keys + 256, D)
    q1, qb = r(1, hq, 1, D), r(1, hq, B, D)
    length = mx.array(keys, mx.int32)
    norm_w = r(H)
    from dflash_mlx.cache.buffer import positions_mask
    from dflash_mlx.kernels.dispatch import block_attention

    mask = positions_mask(B, length, keys + 256)
    mx.eval(w_h, w_qkv, w_f, w_gu, x1, xb, qw.parameters(), kbuf, vbuf, q1, qb, length, norm_w, mask)
    scale = D**-0.5
    upd = r(1, hkv, B, D)
    mx.eval(upd)

    yield "matmul 1 row (H x H)", lambda i: (x1 + i) @ w_h.T
    yield f"matmul {B} rows (H x H)", lambda i: (xb + i) @ w_h.T
    yield f"matmul {B} rows (fused qkv)", lambda i: (xb + i) @ w_qkv.T
    yield f"matmul {B} rows (H x F)", lambda i: (xb + i) @ w_f.T
    yield f"matmul {B} rows (fused gate+up)", lambda i: (xb + i) @ w_gu.T
    yield "4-bit matmul 1 row", lambda i: qw(x1 + i)
    yield f"4-bit matmul {B} rows", lambda i: qw(xb + i)
    yield f"rms_norm {B} rows", lambda i: mx.fast.rms_norm(xb + i, norm_w, 1e-6)
    yield f"rope {B} rows", lambda i: mx.fast.rope(qb + i, D, traditional=False, base=1e6, scale=1.0, offset=length)
    yield "add (elementwise)", lambda i: xb + i
    yield (
        "sdpa 1 row, exact keys",
        lambda i: mx.fast.scaled_dot_product_attention(q1 + i, kbuf[:, :, :keys], vbuf[:, :, :keys], scale=scale),
    )
    yield (
        f"sdpa {B} rows, causal, exact keys",
        lambda i: mx.fast.scaled_dot_product_attention(
            qb + i, kbuf[:, :, : keys + B], vbuf[:, :, : keys + B], scale=scale, mask="causal"
        ),
    )
    yield (
        f"sdpa {B} rows, bool mask, buffer",
        lambda i: mx.fast.scaled_dot_product_attention(qb + i, kbuf, vbuf, scale=scale, mask=mask),
    )
    yield (
        f"mask + sdpa {B} rows, buffer",
        lambda i: mx.fast.scaled_dot_product_attention(
            qb + i, kbuf, vbuf, scale=scale, mask=positions_mask(B, length + i, keys + 256)
        ),
    )
    yield (
        f"block_attention kernel {B} rows",
        lambda i: block_attention(qb + i, kbuf, vbuf, scale=scale, q_offset=length, kv_length=length + B, causal=True),
    )
    yield (
        "slice_update at an array offset",
        lambda i: mx.slice_update(kbuf, upd + i, mx.reshape(length, (1,)), axes=(2,)),
    )
    yield "slice assignment at an int offset", lambda i: _assign(kbuf, upd + i, keys)


def _assign(buf, new, at):
    out = mx.array(buf)
    out[..., at : at + new.shape[2], :] = new
    return out


def measure(make, repeat: int, runs: int) -> dict:
    rows = []
    for _ in range(runs + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [make(i) for i in range(repeat)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t0))
    rows = rows[1:]  # the first run builds kernels
    med = lambda k: 1e6 * sorted(r[k] for r in rows)[len(rows) // 2] / repeat  # noqa: E731
    return {"build_us": med(0), "launch_us": med(1), "total_us": med(2)}


def add_shape_arguments(ap) -> None:
    """A layer's sizes, Qwen3-8B's by default: --hidden, --ffn, --heads, --kv-heads."""
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--keys", type=int, default=1024, help="cached positions attention reads")
    ap.add_argument("--block", type=int, default=16, help="query rows of a verify")
    ap.add_argument("--repeat", type=int, default=36, help="copies per graph (one per layer)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--only", default="", help="comma-separated substrings: only cases whose name has one")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    want = [w for w in args.only.split(",") if w]
    results = []
    for name, make in cases(args):
        if want and not any(w in name for w in want):
            continue
        results.append({"op": name, **{k: round(v, 1) for k, v in measure(make, args.repeat, args.runs).items()}})
    machine = f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}"
    if args.json:
        print(json.dumps({"machine": machine, "args": vars(args), "rows": results}, indent=2))
        return
    print(machine)
    print(
        f"hidden {args.hidden}, ffn {args.ffn}, heads {args.heads}/{args.kv_heads}, keys {args.keys}, "
        f"{args.repeat} copies per graph; microseconds per operation (median of {args.runs})"
    )
    print(f"{'operation':<40} {'build':>8} {'launch':>8} {'total':>8}")
    for r in results:
        print(f"{r['op']:<40} {r['build_us']:>8.1f} {r['launch_us']:>8.1f} {r['total_us']:>8.1f}")


if __name__ == "__main__":
    main()
