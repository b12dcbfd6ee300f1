"""Turn dflash-mlx's small GPU kernels off and on within one process, so a
benchmark can put rows with and without them side by side (or alternate).

    from kernel_switches import add_kernel_arguments, kernel_settings, use_kernels
    add_kernel_arguments(ap, "one table each")         # --norm-rope, --products
    for norm, products in kernel_settings(args):        # every pair of their values
        use_kernels(norm_rope=norm, products=products)  # then forget_traces(draft)

Off ("ops" / "mlx"), a kernel reads as not checked out and its layers run
MLX's own ops; "kernel" uses it where its self-check passed, as dflash-mlx
itself does. Compiled cycles keep what they were traced with: forget them
after a switch.
"""

from dflash_mlx.kernels import attention as _kernel
from dflash_mlx.kernels import dispatch as _dispatch
from dflash_mlx.kernels import norm_rope as _norm_rope
from dflash_mlx.kernels.cuda import products as _products

_CHECKED = {_norm_rope: _norm_rope.passed, _products: _products.passed}


CHOICES = {"norm_rope": ("kernel", "ops"), "products": ("kernel", "kernel-norms-apart", "mlx")}
MEANING = {
    "norm_rope": "'kernel' (q/k norms and RoPE in one launch on a GPU where that kernel checked out), 'ops' (MLX's "
    "rms_norm and rope)",
    "products": "'kernel' (a verify's 2-16-row products in one launch each on CUDA where that kernel checked out; "
    "'kernel@TxWxA' launches the products that are neither down-shaped nor gate/up with SwiGLU with T "
    "tiles a warp, W warps, A loads ahead: block_products.SHAPE and WIDE_SHAPE), 'kernel-norms-apart' (the "
    "kernel, each RMSNorm before a product a launch of its own: block_products.NORMS_IN_PRODUCTS off), "
    "'mlx' (MLX's products, cuBLASLt)",
}


def add_kernel_arguments(ap, each: str, products: str = "kernel") -> None:
    """--norm-rope and --products, comma-separated (repeat a value to
    alternate); ``each`` says what one value gets ("one table each")."""
    for name, default in (("norm_rope", "kernel"), ("products", products)):
        ap.add_argument(
            "--" + name.replace("_", "-"),
            default=default,
            help=f"comma-separated, {each}, crossed with the other's: {MEANING[name]}; default {default}",
        )


def kernel_settings(args) -> list[tuple[str, str]]:
    """Every (norm_rope, products) pair of the two arguments' values."""
    return [(n, p) for n in args.norm_rope.split(",") for p in args.products.split(",")]


def use_kernels(*, norm_rope: str = "kernel", products: str = "kernel") -> None:
    """norm_rope: 'kernel' or 'ops'; products: 'kernel' or 'mlx'."""
    products, shape = product_shape(products)
    _products.SHAPE, _products.WIDE_SHAPE = (shape, shape) if shape else _SHAPES
    _products.NORMS_IN_PRODUCTS = products != "kernel-norms-apart"
    for (name, choice), module in zip((("norm_rope", norm_rope), ("products", products)), (_norm_rope, _products)):
        if choice not in CHOICES[name]:
            raise SystemExit(f"--{name.replace('_', '-')} takes {' or '.join(CHOICES[name])}, not {choice!r}.")
        module.passed = _CHECKED[module] if choice.startswith("kernel") else (lambda *args: None)


def product_shape(choice: str) -> tuple[str, tuple | None]:
    """'kernel@TxWxA' -> ('kernel', (T, W, A)): the launch shape of every
    product but down-shaped ones and the gate/up with SwiGLU (SHAPE and
    WIDE_SHAPE); any other choice -> (choice, None): the shipped shapes."""
    route, sep, shape = choice.partition("@")
    if not sep:
        return choice, None
    parts = shape.split("x")
    if route != "kernel" or len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise SystemExit(
            f"--products takes kernel@TxWxA (tiles, warps, loads ahead, e.g. kernel@2x8x4), not {choice!r}."
        )
    return route, tuple(int(p) for p in parts)


_SHAPES = (_products.SHAPE, _products.WIDE_SHAPE)  # the shipped launch shapes, before any switch


def use_fused_projections(on: bool) -> None:
    """Fused q/k/v and gate/up products in qwen3/llama targets' layers (the
    default), or mlx-lm's own three and two; before the pair is loaded (an
    adapter makes its layers when made)."""
    from dflash_mlx.targets import LlamaTarget, Qwen3Target

    for cls in (Qwen3Target, LlamaTarget):
        cls.fuse_projections = on


ATTENTION = ("table", "kernel", "fused")


def add_attention_argument(ap, each: str) -> None:
    """--attention, comma-separated: where the block-attention kernel runs."""
    ap.add_argument(
        "--attention",
        default="table",
        help=f"comma-separated, {each}: 'table' (the block-attention kernel where its measured table "
        "picks it: the default), 'kernel' (for every call of up to 256 query rows a kv head, short prefill "
        "chunks too), 'fused' (never: MLX's attention); '@N' after 'table' or 'kernel' sets the "
        "kernel's fewest keys a chunk (kernel.TILE_CHUNK_FLOOR) to N, e.g. table@64",
    )


def use_attention(choice: str) -> None:
    """Route attention as ``choice`` says (ATTENTION, '@N': the kernel's
    fewest keys a chunk); the caller then forgets compiled cycles
    (forget_traces), which hold the routing they were traced with."""
    route, sep, floor = choice.partition("@")
    if route not in ATTENTION or (sep and not (floor.isdigit() and int(floor) >= 1)):
        raise SystemExit(f"--attention takes {', '.join(ATTENTION)} (with @N keys a chunk), not {choice!r}.")
    _dispatch.KERNEL_WINS = {"table": _TABLE, "kernel": ((256, 0),), "fused": ()}[route]
    _kernel.TILE_CHUNK_FLOOR = int(floor) if floor else _FLOOR


_TABLE = _dispatch.KERNEL_WINS  # the shipped table, before any switch
_FLOOR = _kernel.TILE_CHUNK_FLOOR


SCALARS = ("wide", "narrow")


def add_scalars_argument(ap, each: str) -> None:
    """--scalars, comma-separated: where a cycle's lengths live for its kernels."""
    ap.add_argument(
        "--scalars",
        default="wide",
        help=f"comma-separated, {each}: 'wide' (a cycle's lengths in 16-byte arrays the device writes, "
        "device.device_scalar: the default), 'narrow' (4-byte arrays, which MLX's CUDA backend keeps "
        "in managed memory)",
    )


def use_scalars(choice: str) -> None:
    """Lengths as ``choice`` says (SCALARS); the caller then forgets compiled cycles."""
    from dflash_mlx import device

    if choice not in SCALARS:
        raise SystemExit(f"--scalars takes {' or '.join(SCALARS)}, not {choice!r}.")
    device.WIDE_SCALARS = choice == "wide"
