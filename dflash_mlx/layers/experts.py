"""A MoE layer's experts at a verify. A plain step sends its row to its top-k
experts through MLX's one-row gather product; a verify's 2-32 rows take the
quantized expert verify product (kernels/quantized_gather.py) where it
checked out, each (row, expert) pair bit for bit the plain step's, and the
router's product the exact verify product (linear.apply_linear). Prompts,
one row and the CPU run mlx-lm's modules as they are."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.gpt_oss import MLPBlock, mlx_topk
from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import SwitchGLU

from ..kernels import quantized_gather
from .linear import apply_linear, verify_rows


def takes(glu: nn.Module, x: mx.array) -> bool:
    """Whether ``switch_glu`` sends x's rows through the expert verify product."""
    if type(glu) is not SwitchGLU or not verify_rows(x):
        return False
    rows = x.size // x.shape[-1]
    return (
        quantized_gather.serves(glu.gate_proj, rows, x.shape[-1], x.dtype)
        and quantized_gather.serves(glu.up_proj, rows, x.shape[-1], x.dtype)
        and quantized_gather.serves(glu.down_proj, rows, glu.down_proj.input_dims, x.dtype)
    )


def switch_glu(glu: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """mlx-lm's ``glu(x, indices)`` ([..., K] rows, [..., top k] experts ->
    [..., top k, K]), through the expert verify product where ``takes``."""
    if not takes(glu, x):
        return glu(x, indices)
    *lead, k = x.shape
    top_k = indices.shape[-1]
    rhs = indices.flatten()
    # pairs sorted by expert, so a tile's pairs share each read of an expert's weights
    order = mx.argsort(rhs)
    rhs = rhs[order]
    lhs = order // top_k
    rows = x.reshape(-1, k)
    up = quantized_gather.product(glu.up_proj, rows, lhs, rhs)
    gate = quantized_gather.product(glu.gate_proj, rows, lhs, rhs)
    hidden = glu.activation(up, gate)
    y = quantized_gather.product(glu.down_proj, hidden, mx.arange(rhs.size, dtype=mx.int32), rhs)
    return y[mx.argsort(order)].reshape(*lead, top_k, -1)


def top_k_softmax(block: nn.Module, x: mx.array) -> tuple[mx.array, mx.array]:
    """The experts a Qwen3-MoE / Qwen3-Next router picks for each row and their
    weights, op for op as mlx-lm's blocks compute them, the router's product
    through the verify products."""
    gates = apply_linear(block.gate, x)
    gates = mx.softmax(gates, axis=-1, precise=True)
    k = block.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def qwen3_moe(block: nn.Module, x: mx.array) -> mx.array:
    """mlx-lm's ``Qwen3MoeSparseMoeBlock`` forward, op for op, its router and
    experts through the verify products."""
    inds, scores = top_k_softmax(block, x)
    y = switch_glu(block.switch_mlp, x, inds)
    return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


def gpt_oss(block: nn.Module, x: mx.array) -> mx.array:
    """mlx-lm's gpt-oss ``MLPBlock`` forward, op for op, its router and
    experts through the verify products."""
    g = apply_linear(block.router, x)
    experts, indices = mlx_topk(g, k=block.num_experts_per_tok, axis=-1)
    expert_weights = mx.softmax(experts, axis=-1, precise=True)
    x = switch_glu(block.experts, x, indices)
    x = x * mx.expand_dims(expert_weights, axis=-1)
    return x.sum(axis=-2)


def qwen3_next(block: nn.Module, x: mx.array) -> mx.array:
    """mlx-lm's ``Qwen3NextSparseMoeBlock`` forward (Qwen3-Next, Qwen3.5/3.6
    MoE), op for op, its router, experts and shared expert through the verify products."""
    inds, scores = top_k_softmax(block, x)
    y = switch_glu(block.switch_mlp, x, inds)
    y = (y * scores[..., None]).sum(axis=-2)
    shared = block.shared_expert
    shared_y = apply_linear(
        shared.down_proj, swiglu(apply_linear(shared.gate_proj, x), apply_linear(shared.up_proj, x))
    )
    shared_y = mx.sigmoid(apply_linear(block.shared_expert_gate, x)) * shared_y
    return y + shared_y


FORWARDS = {Qwen3MoeSparseMoeBlock: qwen3_moe, MLPBlock: gpt_oss, Qwen3NextSparseMoeBlock: qwen3_next}


def mlp(module: nn.Module) -> Callable[[mx.array], mx.array]:
    """A layer's MLP as x -> y: a sparse MoE block mlx-lm defines through
    ``FORWARDS`` (a sharded one, as mlx-lm runs it), any other as itself."""
    forward = FORWARDS.get(type(module))
    if forward is None or getattr(module, "sharding_group", None) is not None:
        return module
    return lambda x: forward(module, x)
