"""Where the q/k norm + RoPE kernel (kernels/norm_rope.py) changes what the built-in pair decodes (a GPU).

    python benchmarks/kernel_sides.py

Greedy decoding of the held-out code prompts at block 16 with the kernel in
both models, the target only, the drafter only and neither: each setting's
mean acceptance length, per prompt, and how many texts equal the first
setting's. Then the drafter's logits on one prompt with and without the
kernel (largest difference, argmax agreement). On a CPU the kernel never
runs and every row is the same.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx.core as mx
from bench_builtin import PROMPTS, prompt_sets

import dflash_mlx.draft.dflash as dm
import dflash_mlx.layers.blocks as tl
from dflash_mlx import load, stream_generate
from dflash_mlx.decode.traces import forget_traces
from dflash_mlx.kernels import norm_rope as nr

model, draft, tok = load("builtin")
texts = json.loads(PROMPTS.read_text())
sets = prompt_sets(tok, {k: texts[k] for k in ("code", "chat")}, 8)
ops = lambda q, k, qn, kn, rope, off: nr.ops_norm_rope(q, k, qn, kn, rope, off)
for name, t_fn, d_fn in (
    ("both", nr.norm_rope, nr.norm_rope),
    ("target only", nr.norm_rope, ops),
    ("drafter only", ops, nr.norm_rope),
    ("neither", ops, ops),
):
    tl.norm_rope, dm.norm_rope = t_fn, d_fn
    forget_traces(draft)
    accs, toks = [], []
    for p in sets["code"]:
        rs = list(stream_generate(model, draft, tok, p, max_tokens=128, block_size=16))
        accs.append(round(rs[-1].acceptance_length, 2))
        toks.append([t for r in rs for t in r.tokens])
    print(name, sum(accs) / len(accs), accs, flush=True)
    if name == "both":
        ref = toks
    print("   same text as 'both':", sum(a == b for a, b in zip(toks, ref)), "of", len(toks))
# the drafter's proposals on the same inputs: kernel against ops, eagerly
from dflash_mlx.cache.prompt import PromptCache
from dflash_mlx.decode.loop import prefill
from dflash_mlx.targets import adapt

target = adapt(model)
p = sets["code"][0]
outs = {}
for name, fn in (("kernel", nr.norm_rope), ("ops", ops)):
    dm.norm_rope = fn
    cache = PromptCache(model, draft)
    prefill(target, draft, cache, p, 2048, None)
    block = mx.array([[p[-1]] + [draft.config.mask_token_id] * 15])
    outs[name] = draft(block, None, cache.draft).astype(mx.float32)
a, b = outs["kernel"], outs["ops"]
print(
    "drafter logits max diff", mx.abs(a - b).max().item(), "argmax agree", (a.argmax(-1) == b.argmax(-1)).mean().item()
)
