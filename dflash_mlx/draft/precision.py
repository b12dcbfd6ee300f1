"""The drafter's precision: as stored, or its linear layers quantized at load
by mlx-lm's affine quantization. The target verifies every drafted token, so
output is the same whatever the drafter's precision; only speed and the
tokens a cycle commits change.

A decode cycle on a Mac costs about the bytes it reads, and the drafter's
weights are read every cycle: fewer bits read fewer bytes. But a quantized
product of a few rows can cost more than a dense one on some machines, so
``auto`` quantizes only where this machine measured the drafter's forward
faster that way (kernels/decisions.py), and only beside a quantized target.
The drafter's embedding and head are the target's, shared: never touched here.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..kernels import decisions

WIDTHS = (4, 8)
CHOICES = (None, *WIDTHS, "auto")
GROUPS = (64, 32)  # the first that divides a layer's input size
DECISION = "drafter precision"


def check(draft_bits, flags: bool = False) -> None:
    """Raise ValueError unless ``draft_bits`` is one of CHOICES."""
    if draft_bits in CHOICES and not isinstance(draft_bits, bool):
        return
    if flags:
        raise ValueError(f"--draft-bits must be 4, 8, 16 (as stored) or auto, got {draft_bits!r}.")
    raise ValueError(f"draft_bits must be None (as stored), 4, 8 or 'auto', got {draft_bits!r}.")


def from_flag(text: str) -> int | str | None:
    """--draft-bits as ``load`` takes it: '16' is None (as stored)."""
    word = str(text).strip().lower()
    value = {"16": None, "auto": "auto"}.get(word, word)
    if value is not None and value != "auto":
        value = int(value) if value.isdigit() else value
    check(value, flags=True)
    return value


def bits_of(drafter: nn.Module) -> int | None:
    """The bits a drafter's linear layers are held in (quantized on disk by
    convert -q, or at load), else None."""
    for _, module in drafter.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            return module.bits
    return None


def refuse_conflict(drafter: nn.Module, draft_bits, flags: bool = False) -> None:
    """Refuse an explicit width other than the one a drafter was stored in."""
    stored = bits_of(drafter)
    if stored is None or draft_bits in (None, "auto", stored):
        return
    keep = f"--draft-bits 16 or {stored}" if flags else f"draft_bits=None or {stored}"
    raise ValueError(
        f"this drafter is stored quantized to {stored} bits and cannot be requantized to {draft_bits}; "
        f"pass {keep}, or its unquantized checkpoint."
    )


def group_size(module: nn.Module) -> int | None:
    """The group a dense linear layer is quantized in, None where none fits its input size."""
    if type(module) is not nn.Linear:
        return None
    inputs = module.weight.shape[-1]
    return next((g for g in GROUPS if inputs % g == 0), None)


def quantize(drafter: nn.Module, bits: int) -> nn.Module:
    """``drafter`` with each of its dense linear layers quantized to ``bits``
    (in place); layers whose input size fits no group stay as they are."""

    def predicate(_, module):
        group = group_size(module)
        return False if group is None else {"group_size": group, "bits": bits, "mode": "affine"}

    nn.quantize(drafter, class_predicate=predicate)
    mx.eval(drafter.parameters())
    return drafter


def quantized_bits(model: nn.Module) -> set[int]:
    """The widths of a model's quantized layers (empty: not quantized)."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return {m.bits for _, m in model.named_modules() if isinstance(m, kinds)}


def candidates(target: nn.Module) -> tuple[int, ...]:
    """The widths ``auto`` weighs for a drafter beside ``target``: 8 bits
    beside any quantized target, and 4 beside a 4-bit one; none beside a dense one."""
    bits = quantized_bits(target)
    if not bits:
        return ()
    return (8, 4) if 4 in bits else (8,)


def case(drafter: nn.Module, bits: int) -> str:
    """The shape class a decision holds for."""
    cfg = drafter.config
    floating = (a.dtype for _, a in tree_flatten(drafter.parameters()) if mx.issubdtype(a.dtype, mx.floating))
    dtype = str(next(floating)).removeprefix("mlx.core.")
    return (
        f"{bits}-bit against {dtype}: hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
        f"{cfg.num_hidden_layers} layers, block {cfg.block_size}"
    )


def copy(drafter: nn.Module, bits: int | None = None) -> nn.Module:
    """A drafter of the same config bound to the same target, sharing
    ``drafter``'s arrays; ``bits``: quantized (new arrays)."""
    from .dflash2 import draft_model

    twin = draft_model(drafter.config)
    twin.load_weights(tree_flatten(drafter.parameters()))
    twin.eval()
    twin.bind(drafter.target)
    return twin if bits is None else quantize(twin, bits)


def forward(drafter: nn.Module):
    """One draft of a block of the drafter's trained size over as many new
    context rows, into a fresh context cache: what a cycle's drafter call
    reads when the previous cycle committed a whole block."""
    cfg = drafter.config
    dtype = drafter.target.dtype
    block = mx.full((1, cfg.block_size), cfg.mask_token_id, mx.int32)
    taps = mx.random.normal((1, cfg.block_size, len(cfg.target_layer_ids) * cfg.hidden_size), key=mx.random.key(0))
    taps = taps.astype(dtype)
    fused = drafter.fused_projections()
    mx.eval(taps)

    def call():
        return drafter.hidden_states(block, taps, drafter.make_cache(), fused)

    return call


def choose(drafter: nn.Module, target: nn.Module, store: decisions.Decisions) -> int | None:
    """The width ``auto`` takes for ``drafter`` (bound, as stored) beside
    ``target`` on this machine: the fastest width measured faster than the
    stored one, measuring each candidate once a machine and shape class
    (outside compiled traces); None keeps it as stored. A strategy, not a
    kernel: the policies ``on`` and ``off`` keep it as stored (decisions.py)."""
    if bits_of(drafter) is not None or store.policy != "measure":
        return None
    stored = None
    taken = []
    for bits in candidates(target):
        shape = case(drafter, bits)
        ours = theirs = None
        if store.needs(DECISION, shape):
            # (the drafter itself: fusing its projections, as decoding will, costs no memory)
            stored = stored or forward(drafter)
            ours, theirs = forward(copy(drafter, bits)), stored
        if store.decide(DECISION, shape, ours, theirs):
            found = store.measured(DECISION, shape)
            taken.append((found.ours if found else 0.0, bits))
    return min(taken)[1] if taken else None


def apply(drafter: nn.Module, target: nn.Module, draft_bits, store: decisions.Decisions | None = None) -> int | None:
    """Set the bound ``drafter``'s precision as ``draft_bits`` says (passed
    ``check`` and ``refuse_conflict``; ``auto`` by ``choose`` with ``store``,
    this machine's decisions by default); returns the width it now has (None:
    as stored, dense). A drafter stored quantized keeps its width."""
    stored = bits_of(drafter)
    if stored is not None:
        return stored
    bits = choose(drafter, target, store or decisions.current()) if draft_bits == "auto" else draft_bits
    if bits is not None:
        quantize(drafter, bits)
    return bits
