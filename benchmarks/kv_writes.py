"""What writing a verify block into a KV cache buffer costs, by the way it is written.

    python benchmarks/kv_writes.py                      # buffers of 1280 and 16640 positions
    python benchmarks/kv_writes.py --capacities 1280,65792

72 buffers [1, 8 kv heads, capacity, 128] (a 36-layer target's keys and
values) each take 16 new positions per round, written

- dynamic: ``mx.slice_update`` at an array offset (what the cache did before);
- put_along: ``mx.put_along_axis`` at array positions (``kv_cache.put_positions``,
  what the cache does now);
- setitem: ``buffer[:, :, positions, :] = new`` with array positions;
- static: ``buffer[..., 100:116, :] = new`` (a host-known offset: mlx-lm's way,
  which a pipelined cycle cannot use);

alone, then each followed by an attention read of the buffer (as a verify
does), then pipelined (the next round queued before the last is read).
A write whose cost grows with the capacity copies the whole buffer. Each
row also checks that the write landed. Median of 8 rounds, ms per round.
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx

from dflash_mlx.cache.buffer import put_positions

KV_HEADS, HEAD_DIM, BUFFERS, BLOCK, AT = 8, 128, 72, 16, 100


def write(buf: mx.array, new: mx.array, start: mx.array, how: str) -> mx.array:
    if how == "dynamic":
        return mx.slice_update(buf, new, mx.reshape(start, (1,)), axes=(2,))
    if how == "put_along":
        return put_positions(buf, new, start + mx.arange(BLOCK))
    if how == "setitem":
        buf[:, :, start + mx.arange(BLOCK), :] = new
        return buf
    buf[..., AT : AT + BLOCK, :] = new
    return buf


def rounds(capacity: int, how: str, read: bool, pipelined: bool) -> tuple[float, bool]:
    bufs = [mx.zeros((1, KV_HEADS, capacity, HEAD_DIM), mx.bfloat16) for _ in range(BUFFERS)]
    new = mx.ones((1, KV_HEADS, BLOCK, HEAD_DIM), mx.bfloat16)
    start = mx.array(AT, mx.int32)
    q = mx.ones((1, 4 * KV_HEADS, BLOCK, HEAD_DIM), mx.bfloat16)
    mx.eval(bufs, new, start, q)
    times, previous = [], None
    for _ in range(10):
        tic = time.perf_counter()
        outs = []
        for i in range(BUFFERS):
            bufs[i] = write(bufs[i], new, start, how)
            if read:
                outs.append(mx.fast.scaled_dot_product_attention(q, bufs[i], bufs[i], scale=HEAD_DIM**-0.5))
        if pipelined:
            mx.async_eval(bufs, outs)
            if previous is not None:
                mx.eval(previous)
            previous = outs + bufs[:1]
        else:
            mx.eval(bufs, outs)
        times.append(time.perf_counter() - tic)
    mx.synchronize()
    landed = bool(mx.all(bufs[0][0, :, AT : AT + BLOCK] == 1).item()) and bool(
        mx.all(bufs[0][0, :, AT + BLOCK :] == 0).item()
    )
    return 1000 * sorted(times[2:])[4], landed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacities", default="1280,16640")
    args = ap.parse_args()
    caps = [int(c) for c in args.capacities.split(",")]
    print(f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}")
    print(f"{'write':>10} {'read':>5} {'pipelined':>9} " + " ".join(f"{c:>10}" for c in caps) + "  landed")
    for how in ("dynamic", "put_along", "setitem", "static"):
        for read, pipelined in ((False, False), (True, False), (True, True)):
            cells = [rounds(c, how, read, pipelined) for c in caps]
            print(
                f"{how:>10} {str(read):>5} {str(pipelined):>9} "
                + " ".join(f"{ms:>10.2f}" for ms, _ in cells)
                + f"  {all(ok for _, ok in cells)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
