"""A verify's dense products: 2-32 rows times an ``nn.Linear``'s bf16, fp16 or
float32 weight, each row bit for bit what MLX's one-row product computes
(Metal, CUDA).

A plain step multiplies one row by each weight; a verify multiplies its block
(2-16 rows, a draft tree up to 32). MLX's product of a few rows takes another
kernel (Metal's gemv_wide or steel GEMM, CUDA's cuBLASLt) that sums in
another order, so at a near-tie a greedy verify could pick another token than
the plain step. This kernel (exact_products_source.py, which names the order
it follows and where in MLX's sources it comes from) reads each weight once
for all the rows and reduces each row in the one-row kernel's own order.

Which (dtype, K, one-row order, bias) a machine serves with it is decided once,
outside compiled traces (``prepare``): its rows must equal ``x[i:i+1] @ w.T``
(``mx.addmm`` with a bias, as ``nn.Linear`` calls it) of each row alone, bit for
bit, on random cases of every row tile; a failure keeps MLX's product for that
variant, with one warning. Where MLX sends the one-row product to a library
(CUDA's cuBLASLt for a layer with a bias) no order can be known: the check
fails there and MLX's product stays. A checked variant serves a layer's
shape on Metal wherever it checked out (exactness first), elsewhere only
where this machine measured it faster than MLX's product at a verify's rows
(decisions.serves_exact). The CPU never runs it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..device import backend
from .attention import make_factory, unread_input
from .exact_products_source import HEADER, INPUTS, OUTPUTS, SIMD, VERSION, source
from .launch_source import compacting
from .serving import CheckedVariants, checked_here, first_exact, passed

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
FEWEST_ROWS, MOST_ROWS = 2, 32
# Rows a self-check runs: one case of each row tile (tile()), partial ones too.
CHECK_ROWS = (3, 8, 13, 27)
# (most rows, x rows a threadgroup, outputs a lane group): a lane's
# accumulators (rows x outputs, one float each) stay at most 64.
TILES = ((4, 4, 8), (8, 8, 4), (16, 16, 2), (32, 32, 2))
GROUPS = 8  # simdgroups a threadgroup per K part (fewer where the order splits K: 1024 threads at most)
# Steps a chunk: a lane's weights loaded a chunk ahead (registers: twice AHEAD x
# values a step x outputs a lane group), x staged a chunk at a time.
AHEAD = {"metal": 2, "cuda": 2}
# Bytes of float x a threadgroup stages at a time: half of Metal's 32 KiB a threadgroup
# (the split order's partial sums take the rest), within CUDA's 48 KiB of static shared memory.
STAGED_BYTES = {"metal": 16384, "cuda": 32768}
MOST_THREADS = 1024  # a threadgroup's
MOST_SHARED_BYTES = 32768  # a threadgroup's memory on Metal (CUDA's static limit is higher)


@dataclass(frozen=True)
class Order:
    """How MLX's one-row kernel splits and sums an output's K (see exact_products_source)."""

    lanes: int  # lanes sharing an output's K
    vpt: int  # consecutive values a lane takes a step
    split: int  # simdgroups sharing an output's K, summed in order
    every_lane: bool  # in the last step, lanes past K still add zero products (Metal)


def one_row_order(backend_name: str, k: int, n: int) -> Order:
    """The order of MLX's one-row product of an [n, k] weight on its backend
    (Metal: gemv_axbpy's choice; CUDA: gemv's n_per_thread)."""
    if backend_name == "metal":
        if k <= 64:
            return Order(4, 4, 1, True)
        return Order(32, 4, 8 if k >= 16 * n else 1, True)
    return Order(32, 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1, 1, False)


@dataclass(frozen=True)
class Variant:
    """What one self-check covers: products of a K in one order at any 2-32 rows."""

    dtype: mx.Dtype
    k: int
    order: Order
    bias: bool

    @property
    def case(self) -> str:
        dtype = str(self.dtype).split(".")[-1]
        o = self.order
        split = f" split {o.split}" if o.split > 1 else ""
        return f"{dtype} K={self.k} lanes {o.lanes} x {o.vpt}{split}" + (" + bias" if self.bias else "")


@dataclass
class ExactCheck:
    backend: str
    variant: Variant
    ok: bool
    detail: str
    form: int = 0  # the multiply-add form that matched (exact_products_source: FORM)

    @property
    def case(self) -> str:
        return f"{self.backend} {self.variant.case}"


def tile(rows: int) -> tuple[int, int]:
    """(x rows a threadgroup, outputs a lane group) for ``rows`` rows."""
    return next((mr, rs) for most, mr, rs in TILES if rows <= most)


@dataclass(frozen=True)
class Launch:
    """How the kernel is launched for some rows in one order (the order of each sum is the same whatever it is)."""

    rows: int  # x rows a threadgroup
    outputs: int  # outputs a lane group
    ahead: int  # steps a chunk
    groups: int = GROUPS  # simdgroups a threadgroup per K part


def launch_for(backend_name: str, order: Order, rows: int, override: tuple | None = None) -> Launch:
    """The launch for ``rows`` rows: the row tile's, with the x rows and the steps
    of a chunk cut until a chunk of staged x fits the backend's bytes.
    ``override``: (outputs a lane group, steps a chunk[, simdgroups]) instead of
    the shipped ones (benchmarks/block_products.py --launches)."""
    mr, rs = tile(rows)
    ahead, groups = AHEAD[backend_name], GROUPS
    if override is not None:
        rs, ahead, groups = (*override, GROUPS)[:3]
    step_bytes = order.split * order.lanes * order.vpt * 4
    budget = STAGED_BYTES[backend_name]
    mr = min(mr, max(1, budget // step_bytes))
    groups = min(groups, MOST_THREADS // (SIMD * order.split))
    at = Launch(mr, rs, max(1, min(ahead, budget // (mr * step_bytes))), groups)
    if min(rs, ahead, groups) < 1 or shared_bytes(order, at) > MOST_SHARED_BYTES:
        raise ValueError(f"no launch of {at} fits a threadgroup in the {order} order; take fewer outputs or rows.")
    return at


def shared_bytes(order: Order, at: Launch) -> int:
    """Threadgroup memory a launch takes: the staged x chunk, and the split order's partial sums."""
    staged = at.rows * at.ahead * order.split * order.lanes * order.vpt * 4
    parts = order.split * at.groups * at.rows * (SIMD // order.lanes) * at.outputs * 4 if order.split > 1 else 0
    return staged + parts


class ExactProductKernel:
    """The kernel for one backend, compiled by MLX per (T, order, form, tile, bias)."""

    def __init__(self, backend_name: str, factory=None):
        self.backend = backend_name
        factory = compacting(factory or make_factory(backend_name), backend_name)
        # (the version in the name: MLX caches built kernels on disk by name, not by source)
        self.kernel = factory(
            name=f"dflash_exact_product_v{VERSION}",
            input_names=INPUTS,
            output_names=OUTPUTS,
            source=source(backend_name),
            header=HEADER[backend_name],
        )
        self._no_bias = {dtype: unread_input(8, dtype) for dtype in DTYPES}

    def __call__(
        self, x: mx.array, weight: mx.array, bias: mx.array | None, *, form: int = 0, launch: tuple | None = None
    ) -> mx.array:
        """x [..., K] of 2-32 rows times the [N, K] weight (plus ``bias``): [..., N].
        ``launch``: another launch shape (``launch_for``'s override)."""
        *lead, k = x.shape
        rows = x.size // k
        n = weight.shape[0]
        order = one_row_order(self.backend, k, n)
        at = launch_for(self.backend, order, rows, launch)
        per_group = SIMD // order.lanes * at.outputs
        (y,) = self.kernel(
            inputs=[x.reshape(rows, k), weight, self._no_bias[x.dtype] if bias is None else bias],
            template=[
                ("T", x.dtype),
                ("LANES", order.lanes),
                ("VPT", order.vpt),
                ("SPLIT", order.split),
                ("EVERY_LANE", order.every_lane),
                ("FORM", form),
                ("MR", at.rows),
                ("RS", at.outputs),
                ("GROUPS", at.groups),
                ("HAS_BIAS", bias is not None),
                ("AHEAD", at.ahead),
            ],
            grid=(-(-n // (at.groups * per_group)) * at.groups * order.split * SIMD, -(-rows // at.rows), 1),
            threadgroup=(at.groups * order.split * SIMD, 1, 1),
            output_shapes=[(rows, n)],
            output_dtypes=[x.dtype],
        )
        return y.reshape(*lead, n)


def variant_of(module: nn.Module, dtype, backend_name: str) -> Variant | None:
    """The variant serving ``module``'s products of ``dtype`` rows on
    ``backend_name``, or None where the kernel never does."""
    if type(module) is not nn.Linear or dtype not in DTYPES:
        return None
    weight = module["weight"]
    bias = module["bias"] if "bias" in module else None
    if weight.ndim != 2 or weight.dtype != dtype:
        return None
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype):
        return None
    return Variant(dtype, k, one_row_order(backend_name, k, n), bias is not None)


BUILDERS = {"metal": ExactProductKernel, "cuda": ExactProductKernel}
_kernels: dict[str, ExactProductKernel] = {}
_variants = CheckedVariants("exact verify product", "MLX's matmul", "dense verify")
_checks: dict[tuple[str, Variant], ExactCheck] = _variants.checks


_shapes = _variants.shapes


def reset() -> None:
    _kernels.clear()
    _variants.clear()


def orders_at(backend_name: str, k: int) -> list[Order]:
    """Every order MLX's one-row product takes at K on the backend (whatever N)."""
    return sorted({one_row_order(backend_name, k, n) for n in (1, max(1, k // 16), k // 16 + 1)}, key=repr)


# (MLX's product, the kernel's, the one-row products) of a layer, as LayerShapes.prepare runs them
RUNS = (
    lambda m, x: m(x),
    lambda m, x: product(m, x, measuring=True),
    lambda m, x: one_row_products(x, m["weight"], m["bias"] if "bias" in m else None),
)


def prepare(model: nn.Module, dtype) -> None:
    """Check every variant ``model``'s linear layers can reach (each K, at each
    order N can give it: fused projections change N) once, and time each
    checked (variant, N) against MLX's product; call it outside compiled traces."""
    where = backend()
    if where not in BUILDERS:
        return
    for _, module in model.named_modules():
        if type(module) is not nn.Linear or variant_of(module, dtype, where) is None:
            continue
        k, bias = module.weight.shape[1], "bias" in module
        for order in orders_at(where, k):
            checked(where, Variant(dtype, k, order, bias))
        variant = variant_of(module, dtype, where)
        if _checks[(where, variant)].ok:
            _shapes.prepare((where, variant, module.weight.shape[0]), module, RUNS, dtype)


def checked(where: str, variant: Variant) -> ExactCheck:
    """The variant's self-check on backend ``where``, run once (warning once where it fails)."""
    return _variants.checked(where, variant, lambda: self_check(where, variant))


def use_exact_kernel(where: str, variant: Variant, n: int, rows: int) -> bool:
    """Whether ``rows`` rows of ``variant`` with ``n`` outputs take the kernel on
    backend ``where``: where it passed its self-check and serves that shape here."""
    return _variants.serves(where, variant, n, rows)


def takes(module: nn.Module, x: mx.array, measuring: bool = False) -> bool:
    """Whether ``product(module, x)`` runs the kernel; never checks."""
    return serves(module, x.size // x.shape[-1], x.shape[-1], x.dtype, measuring)


def serves(module: nn.Module, rows: int, k: int, dtype, measuring: bool = False) -> bool:
    """Whether the kernel takes ``rows`` rows of length ``k`` in ``dtype`` through
    ``module`` (``measuring``: a checked variant, not asking whether it is faster)."""
    if type(module) is not nn.Linear or not FEWEST_ROWS <= rows <= MOST_ROWS:
        return False
    where = backend()
    if where not in BUILDERS:
        return False
    variant = variant_of(module, dtype, where)
    if variant is None or k != variant.k:
        return False
    if measuring:
        return passed(_checks, (where, variant))
    return use_exact_kernel(where, variant, module.weight.shape[0], rows)


# The multiply-add forms a backend's check tries, in order (exact_products_source: FORM):
# Metal: as MLX writes it (the compiler's choice), one fma, two roundings; CUDA: the fma nvcc
# contracts MLX's to, then two roundings.
FORMS = {"metal": (0, 1, 2), "cuda": (1, 2)}


def product(module: nn.Module, x: mx.array, measuring: bool = False) -> mx.array | None:
    """``module(x)`` through the kernel for 2-32 rows of a checked variant that
    serves here (``measuring``: not asking), else None (the caller runs MLX's
    product); never checks."""
    if not takes(module, x, measuring):
        return None
    where = backend()
    variant = variant_of(module, x.dtype, where)
    bias = module["bias"] if "bias" in module else None
    return _kernels[where](x, module["weight"], bias, form=_checks[(where, variant)].form)


def one_row_products(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """Each row of x [rows, K] through MLX's product alone, as ``nn.Linear`` calls
    it: what a plain step computes."""
    rows = [x[i : i + 1] for i in range(x.shape[0])]
    if bias is None:
        return mx.concatenate([r @ weight.T for r in rows])
    return mx.concatenate([mx.addmm(bias, r, weight.T) for r in rows])


def check_sizes(where: str, variant: Variant) -> tuple[int, ...]:
    """Output counts that give the variant's order at its K, neither a whole
    number of threadgroups' outputs (the last one partial)."""
    k = variant.k
    if where == "metal" and k > 64:
        if variant.order.split > 1:
            most = max(1, k // 16)
            return tuple(sorted({min(most, 44), max(1, min(most, 44) - 5)}))
        least = k // 16 + 1
        return (max(least, 68), max(least, 68) + 5)
    return (68, 73)


def check_cases(where: str, variant: Variant):
    """(x, weight, bias): weights of the variant's K and order, rows of every tile."""
    for n in check_sizes(where, variant):
        key = variant.k + n + 7 * variant.bias
        w = (variant.k**-0.5 * mx.random.normal((n, variant.k), key=mx.random.key(key))).astype(variant.dtype)
        bias = mx.random.normal((n,), key=mx.random.key(key + 1)).astype(variant.dtype) if variant.bias else None
        for rows in CHECK_ROWS:
            x = mx.random.normal((rows, variant.k), key=mx.random.key(1000 * rows + variant.k)).astype(variant.dtype)
            yield x, w, bias


def self_check(where: str, variant: Variant) -> ExactCheck:
    """The kernel's rows against MLX's one-row products of the same rows, bit
    for bit, with each multiply-add form in turn, keeping the first that matches."""

    def pairs(kernel, form: int):
        for x, w, bias in check_cases(where, variant):
            yield kernel(x, w, bias, form=form), one_row_products(x, w, bias), ""

    return first_exact(
        where,
        FORMS.get(where, (0,)),
        (_kernels, BUILDERS),
        pairs,
        lambda ok, detail, form=0: ExactCheck(where, variant, ok, detail, form),
        passed="every row equal to MLX's one-row product",
    )


def self_check_all(report=None) -> list[ExactCheck]:
    """The variants checked here so far (for `dflash-mlx doctor`); [] where the kernel does not run."""
    return checked_here(_checks, backend(), report)


def record_variants(factory, backend_name: str) -> None:
    """Launch every variant the kernel can (each dtype, one-row order, form,
    row tile, bias) through ``factory``, a stand-in for MLX's kernel factory
    that records them (scripts/check_metal_kernels.py, check_cuda_kernels.py)."""
    kernel = ExactProductKernel(backend_name, factory=factory)
    # K of each order: Metal's SN = 4 (K <= 64), split and not (by N); CUDA's 4, 2 and 1 values a lane
    shapes = ((64, 8), (512, 8), (512, 64)) if backend_name == "metal" else ((512, 8), (576, 8), (520, 8))
    for dtype, (k, n), bias in itertools.product(DTYPES, shapes, (False, True)):
        weight = mx.zeros((n, k), dtype)
        b = mx.zeros((n,), dtype) if bias else None
        for rows in range(FEWEST_ROWS, MOST_ROWS + 1):
            for form in FORMS[backend_name]:
                kernel(mx.zeros((rows, k), dtype), weight, b, form=form)
