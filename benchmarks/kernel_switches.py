"""Turn dflash-mlx's small GPU kernels off and on within one process, so a
benchmark can put rows with and without them side by side (or alternate).

    from kernel_switches import use_kernels
    use_kernels(norm_rope="kernel", products="mlx")   # then forget_traces(draft)

Off ("ops" / "mlx"), a kernel reads as not checked out and its layers run
MLX's own ops; "kernel" uses it where its self-check passed, as dflash-mlx
itself does. Compiled cycles keep what they were traced with: forget them
after a switch.
"""

from dflash_mlx.kernels import block_products as _products
from dflash_mlx.kernels import norm_rope as _norm_rope

_CHECKED = {_norm_rope: _norm_rope.passed, _products: _products.passed}


CHOICES = {"norm_rope": ("kernel", "ops"), "products": ("kernel", "mlx")}


def use_kernels(*, norm_rope: str = "kernel", products: str = "kernel") -> None:
    """norm_rope: 'kernel' or 'ops'; products: 'kernel' or 'mlx'."""
    for (name, choice), module in zip((("norm_rope", norm_rope), ("products", products)), (_norm_rope, _products)):
        if choice not in CHOICES[name]:
            raise SystemExit(f"--{name.replace('_', '-')} takes {' or '.join(CHOICES[name])}, not {choice!r}.")
        module.passed = _CHECKED[module] if choice == "kernel" else (lambda *args: None)
