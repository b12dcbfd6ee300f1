"""The block-attention kernel against MLX's fused attention on a GPU: self-checks, errors and ms.

Reported in BENCHMARKS.md, "GPU kernels" (block attention; the table there is
device time from gpu_time.py), and docs/kernels.md.

    python benchmarks/bench_attention.py [--out results.json] [--quick]

Needs only mlx (Metal or CUDA backend). It runs every kernel self-check, then
compares the kernel with ``mx.fast.scaled_dot_product_attention`` (through the
ops path's boolean mask, as block_attention's fallback calls it) and times
both: 2-16 query rows over 256..32k keys, bf16, 32 query / 8 key-value heads,
head dim 128, which locates the crossover in dflash_mlx/kernels/dispatch.py.
Then a draft tree's verify (issue 37): the tree kernel against the block kernel
over the same rows and against MLX's attention with the tree's mask.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import mlx.core as mx

from dflash_mlx.kernels import backend, block_attention, ops_attention, self_check_all
from dflash_mlx.kernels.dispatch import _kernels, check_tree, checked_kernel, ops_tree_attention

CHUNKS = (128, 256, 512, 1024, 2048, 4096)


STAGINGS = ((16, 2), (16, 4), (32, 2), (32, 3), (32, 4), (64, 2), (64, 3))


def rel_err(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-6)).item()


def make(b, hq, hkv, lq, n, d, dtype, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((b, hq, lq, d), key=k1).astype(dtype)
    k = mx.random.normal((b, hkv, n, d), key=k2).astype(dtype)
    v = mx.random.normal((b, hkv, n, d), key=k3).astype(dtype)
    mx.eval(q, k, v)
    return q, k, v


def timed(fn, reps=5, inner=20) -> float:
    """Median over reps of the mean time of `inner` calls evaluated together (ms)."""
    mx.eval(fn())
    mx.eval(fn())
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        times.append((time.perf_counter() - tic) / inner * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a smoke test)")
    args = ap.parse_args()
    where = backend()
    report = {"backend": where, "mlx": mx.__version__, "device": mx.device_info(), "python": platform.python_version()}
    print(f"backend {where}, mlx {mx.__version__}, {report['device'].get('device_name', '?')}", flush=True)
    if where == "cpu":
        print("no GPU backend: nothing to check or time (the CPU always takes the fused op).")
        return 1

    try:  # a build error in full, before the self-checks shorten it to one line
        from dflash_mlx.kernels.attention import BlockAttentionKernel

        q, k, v = make(1, 4, 2, 3, 256, 128, mx.bfloat16)
        mx.eval(BlockAttentionKernel(where)(q, k, v, scale=0.1, q_offset=200, kv_length=203, causal=True))
    except Exception as e:
        print(f"kernel build/launch error:\n{e}", flush=True)

    tic = time.perf_counter()
    checks = self_check_all()
    report["self_check_seconds"] = time.perf_counter() - tic
    print(f"{len(checks)} self-checks (build + 2 cases each) took {report['self_check_seconds']:.1f} s", flush=True)
    report["self_checks"] = [dict(case=c.case, ok=c.ok, detail=c.detail) for c in checks]
    for c in checks:
        print(f"self-check {c.case:45s} {'ok' if c.ok else 'FAILED'}  {c.detail}", flush=True)
    kernel = _kernels.get(where)
    if kernel is None or not all(c.ok for c in checks if c.dtype == "bfloat16" and c.head_dim == 128):
        print("the bf16 head-dim-128 kernel is not usable here; nothing to time.")
        _write(args.out, report)
        return 1

    # Correctness over the shapes and the contract's corners.
    cases = []
    lengths = [1024, 4096] if args.quick else [1024, 4096, 8192, 16384, 32768]
    for n in lengths:
        cases.append(("verify", 1, 32, 8, 16, n, 128, mx.bfloat16, n - 16, n, True, None))
    cases += [
        ("verify L=2", 1, 32, 8, 2, 4096, 128, mx.bfloat16, 4094, 4096, True, None),
        ("verify tail unfilled", 1, 32, 8, 16, 8192, 128, mx.bfloat16, 3000, 3016, True, None),
        ("drafter full", 1, 32, 8, 16, 4096, 128, mx.bfloat16, 2000, 2016, False, None),
        ("drafter window", 1, 32, 8, 16, 8192, 128, mx.bfloat16, 6000, 6016, False, 2048),
        ("verify window", 1, 32, 8, 16, 8192, 128, mx.bfloat16, 6000, 6016, True, 2048),
        ("d64 fp16 B=2", 2, 16, 4, 8, 2048, 64, mx.float16, 1500, 1508, True, None),
        ("d256 fp32", 1, 8, 2, 5, 2048, 256, mx.float32, 1000, 1005, True, None),
        ("MHA d128 L=32", 1, 8, 8, 32, 2048, 128, mx.bfloat16, 1000, 1032, True, None),
        ("GQA 8 L=16 (2 row tiles)", 1, 64, 8, 16, 4096, 128, mx.bfloat16, 4000, 4016, True, None),
        ("fp16 d128 L=16 16k", 1, 32, 8, 16, 16384, 128, mx.float16, 16368, 16384, True, None),
        ("d256 bf16 window", 1, 8, 2, 16, 4096, 256, mx.bfloat16, 3000, 3016, True, 1024),
        ("d64 bf16 L=1", 1, 32, 8, 1, 4096, 64, mx.bfloat16, 4095, 4096, True, None),
        ("prefill-sized L=2048", 1, 32, 8, 2048, 4096, 128, mx.bfloat16, 2048, 4096, True, None),
    ]
    report["correctness"] = []
    for name, b, hq, hkv, lq, n, d, dtype, qo, kl, causal, window in cases:
        q, k, v = make(b, hq, hkv, lq, n, d, dtype)
        kw = dict(scale=d**-0.5, q_offset=mx.array(qo), kv_length=mx.array(kl), causal=causal, window=window)
        if checked_kernel(where, dtype, d, window is not None) is None:
            err = float("nan")
        else:
            err = rel_err(kernel(q, k, v, **kw), ops_attention(q, k, v, **kw))
        report["correctness"].append(dict(case=name, keys=n, rows=lq, head_dim=d, dtype=str(dtype), rel_err=err))
        print(f"check {name:22s} N={n:6d} L={lq:2d} D={d:3d} {str(dtype):14s} max rel err {err:.2e}", flush=True)

    # The matrix-unit pass's staging variants (keys per tile x buffers) over the corners
    # where tiles are partly masked: an unfilled tail, a window, the drafter's block.
    if where == "cuda":
        for name, b, hq, hkv, lq, n, d, dtype, qo, kl, causal, window in cases:
            if d != 128 or dtype != mx.bfloat16 or n > 8192:
                continue
            q, k, v = make(b, hq, hkv, lq, n, d, dtype)
            kw = dict(scale=d**-0.5, q_offset=mx.array(qo), kv_length=mx.array(kl), causal=causal, window=window)
            want = ops_attention(q, k, v, **kw)
            for kt, st in STAGINGS:
                err = rel_err(kernel(q, k, v, tile_keys=kt, stages=st, **kw), want)
                report["correctness"].append(
                    dict(case=f"{name} KT={kt} ST={st}", keys=n, rows=lq, head_dim=d, dtype=str(dtype), rel_err=err)
                )
                print(f"check {name:22s} KT={kt:3d} ST={st} max rel err {err:.2e}", flush=True)

    # Speed: 32/8 heads, D 128, bf16, verify (causal) on a full buffer. "fused+mask" is what
    # block_attention falls back to (a fixed buffer needs the mask); "fused causal" is the
    # fused op's best case, valid only when the buffer holds exactly kv_length keys.
    report["speed"] = []
    print(f"\n{'keys':>6} {'rows':>4} {'fused+mask ms':>14} {'fused causal ms':>16} {'kernel ms':>10} {'vs mask':>8}")
    rows_list = [16] if args.quick else [2, 4, 8, 16]
    keys_list = lengths if args.quick else [256, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384, 32768]
    for lq in rows_list:
        for n in keys_list:
            q, k, v = make(1, 32, 8, lq, n, 128, mx.bfloat16, seed=n)
            kw = dict(scale=128**-0.5, q_offset=mx.array(n - lq), kv_length=mx.array(n), causal=True)
            t_mask = timed(lambda: ops_attention(q, k, v, **kw))
            t_causal = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5, mask="causal"))
            t_kernel = timed(lambda: kernel(q, k, v, **kw))
            report["speed"].append(
                dict(keys=n, rows=lq, fused_mask_ms=t_mask, fused_causal_ms=t_causal, kernel_ms=t_kernel)
            )
            print(
                f"{n:6d} {lq:4d} {t_mask:14.3f} {t_causal:16.3f} {t_kernel:10.3f} {t_mask / t_kernel:7.2f}x", flush=True
            )
        wins = [r["keys"] for r in report["speed"] if r["rows"] == lq and r["kernel_ms"] < r["fused_mask_ms"]]
        print(f"rows {lq}: kernel beats fused+mask up to {max(wins) if wins else 0} keys (full buffer)", flush=True)

    # Keys per threadgroup (the chunk) at the verify shape: what the default picks against the others.
    report["chunks"] = []
    if not args.quick:
        print(f"\n{'keys':>6} " + " ".join(f"{'C=' + str(c):>9}" for c in CHUNKS) + "   (16 rows, kernel ms)")
        for n in (4096, 16384, 32768):
            q, k, v = make(1, 32, 8, 16, n, 128, mx.bfloat16, seed=n)
            kw = dict(scale=128**-0.5, q_offset=mx.array(n - 16), kv_length=mx.array(n), causal=True)
            row = {c: timed(lambda c=c: kernel(q, k, v, chunk=c, **kw)) for c in CHUNKS}
            report["chunks"].append(dict(keys=n, **{str(c): t for c, t in row.items()}))
            print(f"{n:6d} " + " ".join(f"{t:9.3f}" for t in row.values()), flush=True)

    # Buffers holding fewer valid keys: the kernel reads the valid part only.
    report["partly_filled"] = []
    for buf, valid in ((32768, 1024), (32768, 4096), (8192, 2048)):
        q, k, v = make(1, 32, 8, 16, buf, 128, mx.bfloat16)
        kw = dict(scale=128**-0.5, q_offset=mx.array(valid - 16), kv_length=mx.array(valid), causal=True)
        t_mask = timed(lambda: ops_attention(q, k, v, **kw))
        t_kernel = timed(lambda: kernel(q, k, v, **kw))
        report["partly_filled"].append(dict(buffer=buf, kv_length=valid, fused_mask_ms=t_mask, kernel_ms=t_kernel))
        print(
            f"{valid} valid keys in a {buf} buffer, 16 rows: fused+mask {t_mask:.3f} ms, kernel {t_kernel:.3f} ms",
            flush=True,
        )
    # Through block_attention (dispatch included) at verify and drafter shapes, buffer capacity
    # a multiple of 256 above the valid length, offsets as device arrays.
    report["dispatch"] = []
    print(f"\n{'case':34s} {'block_attention ms':>18} {'ops path ms':>12}")
    for name, hq, hkv, lq, cap, valid, causal, window in (
        ("verify 16 rows, 1k", 32, 8, 16, 1280, 1100, True, None),
        ("verify 16 rows, 4k", 32, 8, 16, 4352, 4100, True, None),
        ("verify 4 rows, 8k", 32, 8, 4, 8448, 8200, True, None),
        ("drafter 16 rows, 1k", 32, 8, 16, 1280, 1100, False, None),
        ("drafter 16 rows window 2048, 16k", 32, 8, 16, 16640, 16400, False, 2048),
        ("GQA 8, 16 rows, 1k", 64, 8, 16, 1280, 1100, True, None),
    ):
        q, k, v = make(1, hq, hkv, lq, cap, 128, mx.bfloat16)
        kw = dict(
            scale=128**-0.5, q_offset=mx.array(valid - lq), kv_length=mx.array(valid), causal=causal, window=window
        )
        t_ba = timed(lambda: block_attention(q, k, v, **kw))
        t_ops = timed(lambda: ops_attention(q, k, v, **kw))
        report["dispatch"].append(dict(case=name, block_attention_ms=t_ba, ops_ms=t_ops))
        print(f"{name:34s} {t_ba:18.3f} {t_ops:12.3f}", flush=True)
    report["trees"] = trees(where, kernel, args.quick)
    _write(args.out, report)
    return 0


def trees(where: str, kernel, quick: bool) -> list[dict]:
    """A draft tree's verify against a block of the same rows (the tree's cost
    over the block's is what its mask adds) and against MLX's attention with
    the tree's mask (what a tree ran before): 32/8 heads, D 128, bf16."""
    rows = []
    if checked_kernel(where, mx.bfloat16, 128, False, tree=True) is None:
        print("the bf16 head-dim-128 tree variant failed its self-check; no tree rows.")
        return rows
    print(
        f"\n{'keys':>6} {'nodes':>5} {'tree ms':>8} {'block ms':>9} {'tree/block':>10} {'fused+tree mask ms':>19} {'err':>8}"
    )
    for n in [4096] if quick else [1024, 4096, 16384]:
        for nodes in [16] if quick else [8, 16, 32, 64]:
            q, k, v = make(1, 32, 8, nodes, n, 128, mx.bfloat16, seed=n + nodes)
            tree = check_tree(nodes, seed=nodes)
            mx.eval(tree.ancestors, tree.depths)
            kw = dict(scale=128**-0.5, q_offset=mx.array(n - nodes), kv_length=mx.array(n))
            want = ops_tree_attention(q, k, v, tree=tree, **kw)
            err = rel_err(kernel(q, k, v, causal=True, tree=tree, **kw), want)
            t_tree = timed(lambda: kernel(q, k, v, causal=True, tree=tree, **kw))
            t_block = timed(lambda: kernel(q, k, v, causal=True, **kw))
            t_mask = timed(lambda: ops_tree_attention(q, k, v, tree=tree, **kw))
            rows.append(
                dict(keys=n, nodes=nodes, tree_ms=t_tree, block_ms=t_block, fused_tree_mask_ms=t_mask, rel_err=err)
            )
            print(
                f"{n:6d} {nodes:5d} {t_tree:8.3f} {t_block:9.3f} {t_tree / t_block:9.2f}x {t_mask:19.3f} {err:8.1e}",
                flush=True,
            )
    return rows


def _write(path, report):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
