"""The gated delta-net recurrence (Qwen3.5 / 3.6, Qwen3-Next) as one kernel
launch for all of a write's steps, on Metal and CUDA from one body.

mlx-lm runs the recurrence through its own Metal kernel on a Mac and through
a loop of small ops elsewhere (mlx_lm/models/gated_delta.py). This module
adds what a verify and its rollback need:

- on CUDA, a twin of mlx-lm's Metal kernel: the verify's T steps, a plain
  step and a replayed rollback each one launch a layer, instead of ~8 ops a
  step;
- on both, a ``steps`` limit read on the device (an int32 array [1]): the
  state after the first ``steps`` of T steps, which is the replay rollback
  in one launch with no mask;
- on both, a draft tree's nodes in one launch (``tree_recurrence``), each
  from its parent's state (``parents`` read on the device), keeping every
  node's state (per-step rollback) or only those a later node reads again.

Arithmetic: that of mlx-lm's packed Metal kernel, expression for expression
(float32 state; per step the decay, k's dot product, the delta, the update,
q's dot product). Each dot product over Dk is summed as mlx-lm's kernels sum
it: chains of Dk/32 products in order (one lane of its generic kernel), then
the ascending butterfly over the 32 chains (xor 1, 2, 4, 8, 16). Here a lane
holds 32 state elements, so Dk/32 lanes share a value row: the butterfly's
first levels run inside a lane as a pairwise tree, its last ones across the
row's lanes; the sum is the same whatever the split (IEEE addition is
commutative). The state crosses launches as float32, so T steps in one launch
equal T launches of one step bit for bit, and a replay of the first s steps
equals a plain run of them. CUDA contracts products into fused multiply-adds
as Metal may: outputs equal mlx-lm's up to each backend's float rules.

Each variant (backend, dtype, Dk) is used only after its self-check in this
process or an earlier one on this machine (``prepare``, outside any compiled
trace; passed_checks.py): against mlx-lm's ops
path within a tolerance, one launch against step-by-step launches and a
limited run against a plain run of its prefix bit for bit, and on Metal
against mlx-lm's own kernel bit for bit (the replay must reach the states of
the plain steps mlx-lm's kernel computes), and its tree's every node against
a plain launch from its parent's state bit for bit. A variant that fails warns once
and is never used: its callers run mlx-lm's path (``recurrence``).

    y, state = recurrence(q, k, v, g, beta, state)             # [B, T, Hv, Dv], [B, Hv, Dv, Dk]
    _, kept = recurrence(q, k, v, g, beta, state, steps=s)     # the state after s steps (s: int32 [1])
    y, states = tree_recurrence(q, k, v, g, beta, state, parents=parents)  # states [T + 1, B, Hv, Dv, Dk]
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops

from ..device import backend, constant_arange
from .attention import make_factory, unread_input
from .dispatch import TOLERANCE, CheckResult, remembered_pass
from .gated_delta_source import HEADER, INPUTS, OUTPUTS, TREE_INPUTS, TREE_OUTPUTS, VERSION, source
from .launch_source import compacting
from .passed_checks import checked as remembered_or_checked
from .passed_checks import fields_of
from .serving import check_once, failure
from .serving import passed as check_passed

KEY_DIMS = (32, 64, 128, 256)  # Dk: a lane holds 32 state elements, Dk / 32 lanes a value row
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
WARPS = 2  # simdgroups per threadgroup, as mlx-lm's packed kernel


def rows_per_simdgroup(key_dim: int) -> int:
    return 32 // (key_dim // 32)


def fits(q: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> bool:
    """Whether the kernel takes these inputs: scalar gates, a float32 state,
    Dk one of KEY_DIMS, whole simdgroups of value rows (v in device memory)."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    return (
        key_dim in KEY_DIMS
        and value_dim >= 8
        and value_dim % rows_per_simdgroup(key_dim) == 0
        and q.dtype in DTYPES
        and g.ndim == 3
        and g.dtype == mx.float32
        and state.dtype == mx.float32
        and beta.dtype == q.dtype
        and v.shape[-2] % q.shape[-2] == 0
    )


class GatedDeltaKernel:
    """The kernels for one backend, a write's and a tree's, compiled by MLX
    per (dtype, Dk, limited) and (dtype, Dk, all states)."""

    def __init__(self, backend_name: str, factory=None):
        factory = compacting(factory or make_factory(backend_name), backend_name)
        # (the version in the name: MLX caches built kernels by name, not by source)
        self.kernel = factory(
            name=f"dflash_gated_delta_v{VERSION}",
            input_names=INPUTS,
            output_names=OUTPUTS,
            source=source(backend_name),
            header=HEADER[backend_name],
        )
        self.tree_kernel = factory(
            name=f"dflash_gated_delta_tree_v{VERSION}",
            input_names=TREE_INPUTS,
            output_names=TREE_OUTPUTS,
            source=source(backend_name, tree=True),
            header=HEADER[backend_name],
        )
        self._all_steps = unread_input(1, mx.int32)  # (LIMITED is false)

    def __call__(self, q, k, v, g, beta, state, *, steps: mx.array | None = None):
        """(y [B, T, Hv, Dv], the state after all T steps, or after the first
        ``steps`` (int32 [1]); y's rows from ``steps`` on are not written)."""
        return self.kernel(
            inputs=[q, k, v, g, beta, state, self._all_steps if steps is None else steps],
            template=[("InT", q.dtype), ("Dk", q.shape[-1]), ("LIMITED", steps is not None)],
            output_shapes=[v.shape, state.shape],
            output_dtypes=[q.dtype, mx.float32],
            **launch(q, v),
        )

    def tree(self, q, k, v, g, beta, state, *, parents: mx.array, keep_all: bool = True):
        """A draft tree's T nodes, each from its parent's state (``parents``
        [T] int32): (y [B, T, Hv, Dv], states [T + 1, ...]: the state before,
        then each node's after its step; where not ``keep_all``, only the
        nodes a later node other than the next reads, the rest unset)."""
        return self.tree_kernel(
            inputs=[q, k, v, g, beta, state, parents],
            template=[("InT", q.dtype), ("Dk", q.shape[-1]), ("KEEP_ALL", keep_all)],
            output_shapes=[v.shape, (q.shape[1] + 1, *state.shape)],
            output_dtypes=[q.dtype, mx.float32],
            **launch(q, v),
        )


def launch(q: mx.array, v: mx.array) -> dict:
    """The grid: a simdgroup's value rows, batch x value heads."""
    key_dim = q.shape[-1]
    Hv, Dv = v.shape[2:]
    groups = Dv // rows_per_simdgroup(key_dim)
    warps = WARPS if groups % WARPS == 0 else 1
    return {"grid": (32, groups, q.shape[0] * Hv), "threadgroup": (32, warps, 1)}


BUILDERS = {"metal": GatedDeltaKernel, "cuda": GatedDeltaKernel}
_kernels: dict[str, GatedDeltaKernel] = {}
_checks: dict[tuple, CheckResult] = {}


def reset() -> None:
    _kernels.clear()
    _checks.clear()


def mlx_lm_kernel_runs(key_dim: int, use_kernel: bool = True) -> bool:
    """Whether mlx-lm's ``gated_delta_update`` would run its Metal kernel here (its 0.32 rule)."""
    return use_kernel and backend() == "metal" and key_dim >= 32 and key_dim % 32 == 0


def prepare(dtype, key_dim: int, value_dim: int) -> None:
    """Check this backend's variant for (dtype, Dk), a write's and a tree's,
    once, outside compiled traces, so that ``recurrence`` and
    ``tree_recurrence`` may use it."""
    where = backend()
    if where == "cpu" or dtype not in DTYPES or key_dim not in KEY_DIMS:
        return
    if value_dim < 8 or value_dim % rows_per_simdgroup(key_dim):
        return
    instead = "mlx-lm's Metal kernel and per-step rollback" if where == "metal" else "mlx-lm's ops"
    check_once(
        _checks,
        (where, dtype, key_dim),
        lambda: self_check(where, dtype, key_dim, value_dim),
        lambda r: (
            f"dflash_mlx: the {where} {r.dtype} Dk={key_dim} gated delta-net kernel failed its "
            f"self-check ({r.detail}); using {instead} for it instead."
        ),
        kernel=f"gated delta-net Dv={value_dim}",  # (the check's cases and grid follow Dv)
    )


def passed(dtype, key_dim: int) -> GatedDeltaKernel | None:
    """This backend's kernel if the variant passed its check; never checks."""
    where = backend()
    return _kernels.get(where) if check_passed(_checks, (where, dtype, key_dim)) else None


def kernel_for(q, v, g, beta, state, use_kernel: bool = True) -> GatedDeltaKernel | None:
    """The checked kernel for these inputs, or None."""
    if not use_kernel or not fits(q, v, g, beta, state):
        return None
    return passed(q.dtype, q.shape[-1])


def one_launch_replay(q, v, g, beta, state, use_kernel: bool = True) -> bool:
    """Whether a replayed rollback of these inputs is one exact kernel launch
    here (the checked kernel), so replay is the cheapest rollback."""
    return kernel_for(q, v, g, beta, state, use_kernel) is not None


def recurrence(q, k, v, g, beta, state, *, steps: mx.array | None = None, use_kernel: bool = True):
    """mlx-lm's recurrence (q, k normalized, g and beta made): y [B, T, Hv,
    Dv] and the state after all T steps, or after the first ``steps`` (an
    int32 array [1], never read back: rows of y from there on are unset).

    On Metal mlx-lm's kernel runs a whole write (a plain step is mlx-lm's own
    step); a limited run takes this module's kernel where checked, else
    mlx-lm's masked kernel. On CUDA this module's kernel runs every write
    where checked. Elsewhere, and for inputs no kernel takes: mlx-lm's ops."""
    kernel = kernel_for(q, v, g, beta, state, use_kernel)
    metal = mlx_lm_kernel_runs(q.shape[-1], use_kernel)
    if kernel is not None and (steps is not None or not metal):
        return kernel(q, k, v, g, beta, state, steps=steps)
    mask = None if steps is None else mx.broadcast_to(constant_arange(q.shape[1]) < steps, q.shape[:2])
    if metal:
        return gated_delta_kernel(q, k, v, g, beta, state, mask)
    return gated_delta_ops(q, k, v, g, beta, state, mask)


def tree_recurrence(q, k, v, g, beta, state, *, parents: mx.array, keep_all: bool = True, use_kernel: bool = True):
    """The recurrence over a draft tree's T nodes in node order, each from its
    parent's state after the parent's step (``parents`` [T] int32, the root
    its own parent; never read by the host): y [B, T, Hv, Dv] and, where
    ``keep_all``, the states [T + 1, B, Hv, Dv, Dk] (the state before, then
    each node's after its step), else None. Node i's are a plain run's over
    its root-to-i path. The checked kernel runs it in one launch; elsewhere a
    node is one ``recurrence`` step from its parent's state."""
    kernel = kernel_for(q, v, g, beta, state, use_kernel)
    if kernel is not None:
        y, states = kernel.tree(q, k, v, g, beta, state, parents=parents, keep_all=keep_all)
        return y, states if keep_all else None
    after, ys = [], []
    for t in range(q.shape[1]):
        before = state if t == 0 else mx.take(mx.stack(after), parents[t], axis=0)
        one = slice(t, t + 1)
        y, s = recurrence(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], before, use_kernel=use_kernel)
        ys.append(y)
        after.append(s)
    return mx.concatenate(ys, axis=1), mx.stack([state, *after]) if keep_all else None


# --- self-check ----------------------------------------------------------------------------------


def check_cases(dtype, key_dim: int, value_dim: int):
    """Verify-like and prefill-like inputs at (dtype, Dk, Dv): grouped heads,
    gates and betas of a real layer's range, a non-zero state; one batch of
    two with few heads (gates in Metal's constant memory)."""
    for seed, (B, T, Hk, Hv) in enumerate(((1, 7, 2, 4), (1, 33, 2, 2), (2, 3, 1, 1))):
        kq, kk, kv, ka, kb, ks = mx.random.split(mx.random.key(key_dim + value_dim + seed), 6)
        scale = key_dim**-0.5
        q = mx.random.normal((B, T, Hk, key_dim), key=kq)
        k = mx.random.normal((B, T, Hk, key_dim), key=kk)
        q = (scale * scale * mx.fast.rms_norm(q, None, 1e-6)).astype(dtype)
        k = (scale * mx.fast.rms_norm(k, None, 1e-6)).astype(dtype)
        v = mx.random.normal((B, T, Hv, value_dim), key=kv).astype(dtype)
        g = mx.exp(-mx.exp(mx.random.uniform(-3.0, 0.5, (B, T, Hv), key=ka)))
        beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=kb)).astype(dtype)
        state = 0.1 * mx.random.normal((B, Hv, value_dim, key_dim), key=ks)
        yield q, k, v, g, beta, state


def _bitwise(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


def self_check(where: str, dtype, key_dim: int, value_dim: int) -> CheckResult:
    """``run_check``, or inside serving.check_once a pass remembered on this machine."""

    def restore(fields: dict) -> CheckResult | None:
        return remembered_pass(fields, where, str(dtype).split(".")[-1], key_dim, False)

    check = (where, dtype, key_dim, value_dim)
    return remembered_or_checked(where, (_kernels, BUILDERS), lambda: run_check(*check), fields_of, restore)


def run_check(where: str, dtype, key_dim: int, value_dim: int) -> CheckResult:
    """The kernel against mlx-lm's ops within TOLERANCE; a whole write
    against step-by-step launches and a limited run against its prefix's
    plain run bit for bit; on Metal against mlx-lm's kernel bit for bit."""
    name = str(dtype).split(".")[-1]

    def result(ok: bool, detail: str) -> CheckResult:
        return CheckResult(where, name, key_dim, False, ok, detail)

    try:
        kernel = _kernels.get(where)
        if kernel is None:
            kernel = _kernels[where] = GatedDeltaKernel(where)
        worst = 0.0
        for q, k, v, g, beta, state in check_cases(dtype, key_dim, value_dim):
            T = q.shape[1]
            y, last = kernel(q, k, v, g, beta, state)
            for got, want in zip((y, last), gated_delta_ops(q, k, v, g, beta, state)):
                got, want = got.astype(mx.float32), want.astype(mx.float32)
                if got.shape != want.shape:
                    return result(False, f"output shape {got.shape} != {want.shape}")
                err = (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()
                worst = max(worst, err if err == err else float("inf"))
            if worst > TOLERANCE[dtype]:
                return result(False, f"max relative error {worst:.1e} > {TOLERANCE[dtype]:.0e}")
            stepped, ys = state, []
            for t in range(T):
                y1, stepped = kernel(
                    q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], stepped
                )
                ys.append(y1)
            if not (_bitwise(mx.concatenate(ys, axis=1), y) and _bitwise(stepped, last)):
                return result(False, "one launch of T steps differs from T launches of one step")
            for s in (0, 1, T // 2, T):
                _, kept = kernel(q, k, v, g, beta, state, steps=mx.array([s], mx.int32))
                if s == 0:
                    want = [state]
                else:
                    prefix = q[:, :s], k[:, :s], v[:, :s], g[:, :s], beta[:, :s], state
                    want = [kernel(*prefix)[1]] + ([gated_delta_kernel(*prefix)[1]] if where == "metal" else [])
                if not all(_bitwise(kept, w) for w in want):
                    return result(False, f"the state after {s} of {T} steps differs from a plain run of {s}")
            if where == "metal":
                theirs = gated_delta_kernel(q, k, v, g, beta, state)
                if not (_bitwise(y, theirs[0]) and _bitwise(last, theirs[1])):
                    return result(False, "not bit for bit mlx-lm's Metal kernel")
            differs = tree_difference(kernel, (q, k, v, g, beta, state))
            if differs is not None:
                return result(False, differs)
        mlx_lm = ", bit for bit mlx-lm's kernel" if where == "metal" else ""
        return result(True, f"max relative error {worst:.1e}, exact replay and trees{mlx_lm}")
    except Exception as e:  # a build or launch error: the kernel is not used
        return result(False, failure(e))


def check_parents(n: int) -> mx.array:
    """A tree of ``n`` nodes with chains, siblings and branches back to the root."""
    return mx.array([0] + [max(0, t - 1 - t * 5 % 3) for t in range(1, n)], mx.int32)


def tree_difference(kernel: GatedDeltaKernel, inputs: tuple) -> str | None:
    """None where the tree kernel's every node equals one plain launch from its
    parent's state bit for bit, keeping every state or only those read again."""
    q, k, v, g, beta, state = inputs
    parents = check_parents(q.shape[1])
    y, states = kernel.tree(q, k, v, g, beta, state, parents=parents)
    y_read, _ = kernel.tree(q, k, v, g, beta, state, parents=parents, keep_all=False)
    if not (_bitwise(states[0], state) and _bitwise(y_read, y)):
        return "a tree keeping only the states it reads again differs from one keeping all"
    for t, parent in enumerate(parents.tolist()):
        one = slice(t, t + 1)
        y1, after = kernel(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], states[parent + 1 if t else 0])
        if not (_bitwise(y[:, one], y1) and _bitwise(states[t + 1], after)):
            return f"tree node {t} differs from a plain step from its parent's state"
    return None


def self_check_all(report=None) -> list[CheckResult]:
    """Check every (dtype, Dk) variant on this backend (for `dflash-mlx
    doctor`) at Dv = Dk; [] on the CPU. ``report(result)`` hears each."""
    where = backend()
    if where == "cpu":
        return []
    for dtype in DTYPES:
        for d in KEY_DIMS:
            prepare(dtype, d, d)
            if report is not None:
                report(_checks[(where, dtype, d)])
    return [r for (w, *_), r in _checks.items() if w == where]


def record_variants(factory, backend_name: str) -> None:
    """Launch every variant this kernel can build, through ``factory`` (a
    recorder's stand-in for mx.fast.metal_kernel or cuda_kernel, launches
    returning zeros): each dtype and Dk, limited or not, and a tree's keeping
    every state or not, over the self-check's cases (gates and parents in
    device and in constant memory)."""
    kernel = GatedDeltaKernel(backend_name, factory=factory)
    for dtype in DTYPES:
        for d in KEY_DIMS:
            for q, k, v, g, beta, state in check_cases(dtype, d, d):
                kernel(q, k, v, g, beta, state)
                kernel(q, k, v, g, beta, state, steps=mx.array([1], mx.int32))
                for keep_all in (True, False):
                    kernel.tree(q, k, v, g, beta, state, parents=check_parents(q.shape[1]), keep_all=keep_all)
