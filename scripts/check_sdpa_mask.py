"""Does mx.fast.scaled_dot_product_attention honour a per-batch boolean mask
[B, 1, L, K] (the trainer's block masks) on this backend? Prints the largest
difference from the attention written out, for a few mask layouts."""

import mlx.core as mx

mx.random.seed(0)
B, H, KV, L, K, D = 64, 4, 2, 16, 400, 64
q = mx.random.normal((B, H, L, D))
k = mx.random.normal((B, KV, K, D))
v = mx.random.normal((B, KV, K, D))
anchor = mx.random.randint(10, K - L, (B,))
j = mx.arange(K)[None, None]
mask = (j < anchor[:, None, None]) | (j >= K - L)  # context before the anchor + the block
mask = mx.broadcast_to(mask, (B, L, K))[:, None]


def reference(m):
    kr, vr = mx.repeat(k, H // KV, axis=1), mx.repeat(v, H // KV, axis=1)
    s = (q * D**-0.5) @ kr.swapaxes(-1, -2)
    s = mx.where(m, s, -1e30)
    return mx.softmax(s, axis=-1) @ vr


want = reference(mask)
print(mx.default_device())
for name, m in [
    ("bool [B,1,L,K]", mask),
    ("bool [B,H,L,K]", mx.broadcast_to(mask, (B, H, L, K))),
    ("additive [B,1,L,K]", mx.where(mask, 0.0, -1e30).astype(q.dtype)),
]:
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=m)
    print(f"{name}: max |diff| {mx.abs(got - want).max().item():.2e}")
