"""Dense decoder layers with fused projections: q, k and v as one product,
gate and up as another, with the same arithmetic per output element (a
verify's cycle is bound by its launches). mlx-lm's projections become views
of the fused weights, so memory does not grow and mlx-lm still runs them.
A prompt chunk (more rows than any verify's) runs them: one launch more a
product costs it nothing, and its fused outputs, split and copied, would
raise its peak above mlx-lm's."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen3

from ..kernels import decisions, dispatch
from .blocks import dense_block, own_block
from .linear import apply_linear, apply_linear_swiglu, in_prompt, prepare_products

# The most rows fused products serve: a verify's block or draft tree (at most
# arguments.MAX_TREE_BUDGET rows); longer inputs run the layer's own modules.
MOST_FUSED_ROWS = 64

# Layers whose attention and MLP are qwen3's (projection names and forward);
# a drafter's layer says so itself with ``fusable_projections``.
FUSABLE_BLOCKS = (qwen3.TransformerBlock, llama.TransformerBlock)


@dataclass
class FusedProjections:
    kvq: nn.Module  # k, v and q side by side, in that order
    kvq_splits: list[int]  # where v and q start in kvq's output
    kv: nn.Module  # the first rows of kvq (a view): keys and values alone, for the drafter's context
    gate_up: nn.Module  # gate's rows, then up's (as many)
    own: tuple  # the layer's q, k and v modules (views of kvq), for more than MOST_FUSED_ROWS rows

    def qkv(self, x: mx.array, norm: nn.Module | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """The q, k and v projections of ``norm(x)``, from one product up to MOST_FUSED_ROWS rows."""
        if not fused_rows(x):
            x = x if norm is None else norm(x)
            return tuple(m(x) for m in self.own)
        k, v, q = mx.split(apply_linear(self.kvq, x, norm=norm), self.kvq_splits, axis=-1)
        return q, k, v

    def keys_values(self, x: mx.array, norm: nn.Module | None = None) -> tuple[mx.array, mx.array]:
        """The k and v projections of ``norm(x)`` alone (the drafter's context),
        from one product up to MOST_FUSED_ROWS rows."""
        if not fused_rows(x, exact=False):
            x = x if norm is None else norm(x)
            return self.own[1](x), self.own[2](x)
        k, v = mx.split(apply_linear(self.kv, x, norm=norm), self.kvq_splits[:1], axis=-1)
        return k, v

    def mlp(
        self, mlp: nn.Module, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None
    ) -> mx.array:
        """mlx-lm's SwiGLU MLP ``mlp`` on ``norm(x)`` (plus ``residual``), gate
        and up in one product up to MOST_FUSED_ROWS rows."""
        if not fused_rows(x):
            y = mlp(x if norm is None else norm(x))
            return y if residual is None else residual + y
        return apply_linear(mlp.down_proj, apply_linear_swiglu(self.gate_up, x, norm), residual)


def fused_rows(x: mx.array, exact: bool = True) -> bool:
    """Whether ``x``'s rows go through the fused products. Not a target's
    (``exact``) lone row where exactness comes first: MLX picks a one-row
    product's order by its width, so a fused one rounds unlike mlx-lm's step;
    nor a prompt's chunk (linear.prompt_products)."""
    if exact and in_prompt():
        return False
    rows = x.size // x.shape[-1]
    if rows == 1 and exact:
        return not decisions.current().exact_first(dispatch.backend())
    return rows <= MOST_FUSED_ROWS


# id(layer) -> (the layer, what was made, what it was made from)
_fused: dict[int, tuple[weakref.ref, FusedProjections | None, tuple]] = {}


def fuse(linears: list[nn.Module]) -> nn.Module | None:
    """One linear layer whose output is ``linears``' outputs side by side, or
    None if they differ in kind, input size, bias or quantization. Each of
    ``linears`` is left holding views of its rows of the fused arrays."""
    kind = type(linears[0])
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not kind for m in linears):
        return None
    names = sorted(k for k, v in linears[0].items() if isinstance(v, mx.array))
    if any(sorted(k for k, v in m.items() if isinstance(v, mx.array)) != names for m in linears):
        return None
    if any(m.weight.shape[1:] != linears[0].weight.shape[1:] for m in linears):
        return None
    if kind is nn.QuantizedLinear:
        spec = lambda m: (m.group_size, m.bits, getattr(m, "mode", "affine"))  # noqa: E731
        if any(spec(m) != spec(linears[0]) for m in linears):
            return None
    wholes = {name: mx.concatenate([m[name] for m in linears], axis=0) for name in names}
    mx.eval(wholes)
    rows = [m.weight.shape[0] for m in linears]
    for name, whole in wholes.items():
        start = 0
        for m, n in zip(linears, rows):
            m[name] = whole[start : start + n]
            start += n
    mx.eval([m.parameters() for m in linears])
    return linear_like(linears[0], wholes)


def first_rows(linear: nn.Module, n: int) -> nn.Module:
    """A linear layer of views of ``linear``'s first ``n`` output rows,
    evaluated: a lazy view would belong to the stream of the thread that made
    it, and projections made while loading serve a server's decode thread."""
    views = {k: v[:n] for k, v in linear.items() if isinstance(v, mx.array)}
    mx.eval(views)
    return linear_like(linear, views)


def linear_like(like: nn.Module | type, arrays: dict[str, mx.array]) -> nn.Module:
    """A linear layer of ``like``'s kind and quantization holding ``arrays``."""
    kind = like if isinstance(like, type) else type(like)
    made = kind.__new__(kind)  # no weights of its own: ``arrays`` are them
    nn.Module.__init__(made)
    if kind is nn.QuantizedLinear:
        made.group_size, made.bits = like.group_size, like.bits
        made.mode = getattr(like, "mode", "affine")
    for name, value in arrays.items():
        made[name] = value
    if kind is nn.QuantizedLinear:
        made.freeze()
    return made


def projections(layer: nn.Module) -> FusedProjections | None:
    """A layer's fused projections (None: not fusable), remade when its projections change."""
    key = id(layer)
    entry = _fused.get(key)
    if entry is not None and entry[0]() is layer and _unchanged(entry[2], _sources(layer)):
        return entry[1]
    made = None
    if type(layer) in FUSABLE_BLOCKS or getattr(type(layer), "fusable_projections", False):
        attn, mlp = layer.self_attn, layer.mlp
        kvq = fuse([attn.k_proj, attn.v_proj, attn.q_proj])
        gate_up = fuse([mlp.gate_proj, mlp.up_proj]) if kvq is not None else None
        if gate_up is not None:
            # (a quantized weight packs along its columns: rows are still outputs)
            nk, nv = attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]
            own = (attn.q_proj, attn.k_proj, attn.v_proj)
            made = FusedProjections(kvq, [nk, nk + nv], first_rows(kvq, nk + nv), gate_up, own)
            # the fused shapes are new ones: check and time their verify products too
            norm = getattr(layer, "input_layernorm", None)
            if norm is not None:
                for fused in (kvq, gate_up):
                    prepare_products(fused, norm.weight.dtype)
    _fused[key] = (weakref.ref(layer, lambda _, key=key: _fused.pop(key, None)), made, _sources(layer))
    return made


def _sources(layer: nn.Module) -> tuple:
    """The projection modules of a layer and the arrays they hold now."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    mods += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    return tuple(
        x
        for m in mods
        if isinstance(m, nn.Module)
        for x in (m, *(m[k] for k in sorted(m) if isinstance(m[k], mx.array)))
    )


def _unchanged(then: tuple, now: tuple) -> bool:
    return len(then) == len(now) and all(a is b for a, b in zip(then, now))


def block(layer: nn.Module, window: int | None = None) -> Callable:
    """``layer``'s forward (h, mask, cache) -> h through fused projections,
    else through its own (still our forward, which rotates a tree's rows at
    their depths), else mlx-lm's layer itself."""
    fused = projections(layer)
    if fused is None:
        if type(layer) not in FUSABLE_BLOCKS:
            return layer
        return own_block(layer, window)

    return dense_block(layer, fused.qkv, lambda h, norm: fused.mlp(layer.mlp, h, h, norm), window)
