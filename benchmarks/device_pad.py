"""How long a running cycle keeps the GPU busy, and how long the GPU waits for the host.

    from device_pad import DevicePad
    pad = DevicePad()          # a one-thread spinning kernel, calibrated on this GPU
    pad.add_to(Cycle, 2.0)     # every cycle also queues 2 ms of device time
    pad.add_to(Cycle, 0.0)     # ... and none

A cycle on the wall clock is about max(host, device) once the host builds the
next cycle while the device runs this one; neither the loop's own clocks
(the host's time includes waits inside async_eval) nor a profiler (kernels
run alone there) splits it. This does: each cycle queues one more kernel that
keeps the device busy for a known time and nothing else (one thread, no
memory traffic). While the device idles part of each cycle, waiting for the
host, the pad fills that idle time and the cycle does not grow; once the pad
is longer than the idle time, the cycle grows with it, one for one. So at a
pad P large enough to grow the cycle C(P):

- device busy per cycle = C(P) - P (the cycle's own kernels);
- device idle per cycle = C(0) - (C(P) - P): the host's time on the critical
  path, what issue 9's goal bounds by 1 ms.

Two pads in the growing range give the same busy time; the benchmark prints
the busy time for each pad so the reader can see which pads grew the cycle.
GPUs only (Metal or CUDA kernels).
"""

from __future__ import annotations

import time

import mlx.core as mx

# One thread steps a linear congruential generator ``n`` times (the count is
# an input, so one compiled kernel serves every pad): a chain of dependent
# integer multiply-adds that no compiler can shorten, touching no memory.
SOURCE = """
    unsigned int n = count[0];
    unsigned int h = seed[0];
    for (unsigned int i = 0; i < n; ++i) {
        h = h * 1664525u + 1013904223u;
    }
    out[0] = h;
"""


class DevicePad:
    """A kernel that keeps the device busy for a requested time, calibrated
    against the wall clock on first use."""

    def __init__(self):
        backend = "cuda" if mx.cuda.is_available() else ("metal" if mx.metal.is_available() else None)
        if backend is None:
            raise SystemExit("the device pad needs a GPU (Metal or CUDA); drop --pad-ms on a CPU.")
        factory = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
        self._kernel = factory(
            name="dflash_device_pad", input_names=["count", "seed"], output_names=["out"], source=SOURCE
        )
        self._seed = mx.array([7], dtype=mx.uint32)
        self._counts: dict[float, mx.array] = {}
        self.steps_per_ms = self._calibrate()

    def run(self, count: mx.array) -> mx.array:
        (out,) = self._kernel(
            inputs=[count, self._seed],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.uint32],
        )
        return out

    def _synced_ms(self, steps: int, repeat: int = 5) -> float:
        count = mx.array([steps], dtype=mx.uint32)
        mx.eval(count)
        times = []
        for _ in range(repeat + 1):
            tic = time.perf_counter()
            mx.eval(self.run(count))
            times.append(time.perf_counter() - tic)
        return 1000 * sorted(times[1:])[repeat // 2]

    def _calibrate(self) -> float:
        """Steps per device millisecond, from two lengths (the launch's own
        cost cancels): grown until the longer one takes at least 20 ms."""
        steps = 1 << 16
        while True:
            short, long = self._synced_ms(steps), self._synced_ms(4 * steps)
            if long >= 20.0 or steps >= 1 << 30:
                return 3 * steps / max(long - short, 1e-6)
            steps *= 4

    def measured_ms(self, ms: float) -> float:
        """What a pad of ``ms`` takes when run alone (launch included)."""
        return self._synced_ms(max(1, round(ms * self.steps_per_ms)))

    def count(self, ms: float) -> mx.array:
        if ms not in self._counts:
            self._counts[ms] = mx.array([max(0, round(ms * self.steps_per_ms))], dtype=mx.uint32)
            mx.eval(self._counts[ms])
        return self._counts[ms]

    def add_to(self, cycle_class, ms: float) -> None:
        """Every ``cycle_class.launch`` from now on also queues ``ms`` of
        device time after the cycle's own kernels (0: no pad)."""
        real = getattr(cycle_class, "_unpadded_launch", None) or cycle_class.launch
        cycle_class._unpadded_launch = real
        if not ms:
            cycle_class.launch = real
            return
        pad, count = self, self.count(ms)

        def padded(*args, **kwargs):
            flight = real(*args, **kwargs)
            mx.async_eval(pad.run(count))
            return flight

        cycle_class.launch = padded
