"""Decoding after long prompts: plain mlx-lm, block 16 and ``auto`` side by
side; or a verify's time as the context grows, and the pieces that grow with it.

Reported in BENCHMARKS.md, "Long contexts".

    python benchmarks/long_context.py --prompt-tokens 8192,16384,32768   # a GPU: Qwen3-8B shapes
    python benchmarks/long_context.py --shape tiny                          # a CPU, in seconds
    python benchmarks/long_context.py --pieces --shape qwen3-8b --prompt-tokens 1024,16384
    python benchmarks/long_context.py --memory --shape tiny --prompt-tokens 1024,16384
    python benchmarks/long_context.py --memory --shape gemma3-27b-kv --prompt-tokens 1024,16384
    python benchmarks/long_context.py --memory --shape gpt-oss-20b-like --bits mxfp4   # a GPU

At each prompt length, random weights (the drafter accepts nothing, so a
cycle commits one token: what ``auto`` must see and leave for plain steps),
greedy, ``--max-tokens`` new tokens a reply, a warm-up round then the median
of ``--repeat``: decode tok/s after the first token of mlx-lm's own decoding,
of our own loop held at plain steps (what ``auto`` runs once it chose plain),
of block 16 and of ``auto``, ``auto``'s share of plain decoding's rate, and
what ``auto`` did in its last reply (plain steps, drafting cycles, why), with
a plain step's launch in our loop, held at plain and inside ``auto``, by round
(where the host is the bottleneck a plain step costs its launch).
``auto``'s chooser is new at each length, as a new process's is: it starts
from what the last one remembered (``DFLASH_MLX_AUTO_MEMORY=0``: from
nothing). The prompt is prefilled once a length, each reply reusing the cache.

``--pieces``, on a target at a model's shapes, synced (built, evaluated
alone, waited for), median of 7:

- verify: the target's forward over one block, as the loop runs it;
- attention: ``layers`` fused attention calls over the cache buffer with the
  verify's mask;
- kernel attention: the same through ``dflash_mlx.kernels.block_attention``
  (GPU only);
- cache writes: every layer's key and value written at a device offset, as
  the cache writes them (``put_positions``);
- plain step: mlx-lm's one-token forward at the same context.

What grows between two lengths is what a long-context cycle pays for; the
rest of the verify (products, norms) does not depend on the context.

``--memory``: the peak memory of one greedy reply (prefill and
``--max-tokens`` new tokens, a fresh cache each, after a short reply that
leaves out the kernels' first-use checks), DFlash at ``--block``
against plain mlx-lm (``generate_step``), each the weights it needs plus the
most it allocated above them, and the drafter's weights; the ratio is DFlash's
peak over plain's plus the drafter's weights (issue 36's goal: at most 1.10).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from contextlib import contextmanager

import mlx.core as mx
from cycle import SHAPES, prefilled, random_pair, synced_ms, synthetic_prompt
from families import FAMILIES, QUANTIZATIONS, build, target
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step


def pieces(model, draft, shape: str, P: int, block: int) -> dict:
    from dflash_mlx.kernels import block_attention
    from dflash_mlx.kv.buffer import positions_mask, put_positions

    _, layers, heads, kv, hd, *_ = SHAPES[shape]
    prompt = synthetic_prompt(draft.config.vocab_size, P)
    target, cache = prefilled(model, draft, prompt)
    taps = list(draft.config.target_layer_ids)
    length = mx.array(P, mx.int32)

    def verify():
        cache.settle()
        for c in cache.target + cache.draft:
            c.set_length(length, P)
        logits, hidden = target(mx.array([[1] * block]), cache.target, taps)
        return [logits, hidden]

    out = {"prompt_tokens": P, "verify_ms": synced_ms(verify)}
    cache.settle()
    first = cache.target[0]
    cap = first.width_after(block)
    k_buf = mx.random.normal((1, kv, cap, hd)).astype(mx.bfloat16)
    v_buf = mx.random.normal((1, kv, cap, hd)).astype(mx.bfloat16)
    q = mx.random.normal((1, heads, block, hd)).astype(mx.bfloat16)
    mx.eval(k_buf, v_buf, q)
    scale = hd**-0.5

    def attention():
        mask = positions_mask(block, length, cap)
        return [mx.fast.scaled_dot_product_attention(q, k_buf, v_buf, scale=scale, mask=mask) for _ in range(layers)]

    out["attention_ms"] = synced_ms(attention)
    if mx.default_device() == mx.gpu:
        out["kernel_attention_ms"] = synced_ms(
            lambda: [
                block_attention(q, k_buf, v_buf, scale=scale, q_offset=length, kv_length=length + block, causal=True)
                for _ in range(layers)
            ]
        )
    new_k = mx.random.normal((1, kv, block, hd)).astype(mx.bfloat16)
    bufs = [[mx.zeros((1, kv, cap, hd), mx.bfloat16) for _ in range(2)] for _ in range(layers)]
    mx.eval(new_k, bufs)
    at = length + mx.arange(block)

    def writes():  # as the cache writes at a device offset
        for pair in bufs:
            pair[0] = put_positions(pair[0], new_k, at)
            pair[1] = put_positions(pair[1], new_k, at)
        return bufs

    out["cache_writes_ms"] = synced_ms(writes)
    bufs.clear()
    from mlx_lm.models.cache import make_prompt_cache as lm_cache

    lm = lm_cache(model)
    mx.eval(model(mx.array([prompt]), cache=lm))

    def plain():
        for c in lm:  # back to the prompt: each step writes position P again
            c.trim(c.offset - P)
        return model(mx.array([[1]]), cache=lm)

    out["plain_step_ms"] = synced_ms(plain)
    out["capacity"] = cap
    return out


# --memory: a model's attention as it holds keys and values (its KV heads,
# head dim, window and layer pattern), the rest small enough for a CPU; what
# decides a long prompt's memory beside the weights, which the ratio leaves out
KV_SHAPES = {
    "gemma3-27b-kv": dict(
        model_type="gemma3_text",
        num_hidden_layers=12,  # 62 in the model: the same 5 sliding layers to a full one
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        sliding_window=1024,
        sliding_window_pattern=6,
        query_pre_attn_scalar=168,
    ),
    "gpt-oss-20b-kv": dict(
        model_type="gpt_oss",
        num_hidden_layers=8,  # 24 in the model: alternating sliding and full layers
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 4,
    ),
}


def kv_pair(shape: str):
    """A random pair with ``shape``'s attention (KV_SHAPES), in the
    device's fast dtype (bf16 on a GPU, float32 on a CPU)."""
    from dflash_mlx.tiny import draft_config, make_draft, random_draft_weights

    cfg = dict(hidden_size=256, intermediate_size=512, vocab_size=1024, rms_norm_eps=1e-6, rope_theta=10000.0)
    cfg.update(KV_SHAPES[shape])
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model = target(cfg, None, dtype)
    dcfg = draft_config(cfg, layers=1, block_size=16, taps=[1, cfg["num_hidden_layers"] - 2])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=4))
    draft.set_dtype(dtype)
    return model, draft


def tiny_pair():
    """A tiny random pair (dflash_mlx.tiny) for a CPU: the same loop, in seconds."""
    from dflash_mlx.tiny import draft_config, make_draft, make_target, random_draft_weights, target_config

    tcfg = target_config("qwen3", vocab=256, layers=4, hidden=64)
    dcfg = draft_config(tcfg, layers=1, block_size=16, taps=[0, 2])
    return make_target(tcfg, seed=3), make_draft(dcfg, random_draft_weights(dcfg, seed=4))


def decode_tps(tokens) -> float:
    """Run a token stream (each item: tokens so far) to its end; tok/s after the first."""
    first = count = None
    for count in tokens:
        if first is None:
            first = time.perf_counter()
            start = count
    return (count - start) / max(time.perf_counter() - first, 1e-9)


def plain_tokens(model, cache, prompt: list[int], n: int):
    """mlx-lm's greedy decoding after ``prompt``, its cache cut back to all but the last token."""
    for c in cache:
        c.trim(c.offset - (len(prompt) - 1))
    k = 0
    for _ in generate_step(
        mx.array(prompt[-1:]), model, max_tokens=n, prompt_cache=cache, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        k += 1
        yield k


def dflash_tokens(model, draft, tokenizer, cache, prompt: list[int], n: int, block):
    from dflash_mlx import stream_generate

    k = 0
    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=n, block_size=block, prompt_cache=cache):
        k += len(r.tokens)
        yield k


def our_plain_tokens(model, draft, cache, prompt: list[int], n: int):
    """Our loop held at plain steps (a block of 1): what ``auto`` runs once it chose plain."""
    from dflash_mlx.decode.loop import decode
    from dflash_mlx.decode.sampling import SamplingParams
    from dflash_mlx.targets import adapt

    target = adapt(model)
    draft.bind(target)
    k = 0
    for step in decode(
        target, draft, cache, prompt, max_tokens=n, sampling=SamplingParams(), seed=0, block=1, eos=set()
    ):
        k += len(step.tokens)
        yield k


@contextmanager
def plain_launches(seconds: list[float]):
    """Append each plain step's launch time in our loop (its graph built and
    handed to the device) to ``seconds``. Where the host is the bottleneck a
    plain step costs its launch, while a compiled drafting cycle's is short."""
    from dflash_mlx.decode.cycle import Cycle

    launch = Cycle.launch

    def timed(self, size, *args, **kwargs):
        tic = time.perf_counter()
        flight = launch(self, size, *args, **kwargs)
        if size == 1:
            seconds.append(time.perf_counter() - tic)
        return flight

    Cycle.launch = timed
    try:
        yield
    finally:
        Cycle.launch = launch


def side_by_side(model, draft, P: int, max_tokens: int, repeat: int) -> dict:
    """Plain mlx-lm, block 16 and auto after a ``P``-token prompt (see the module docstring)."""
    from mlx_lm.models.cache import make_prompt_cache as lm_cache

    from dflash_mlx import make_prompt_cache
    from dflash_mlx.auto.chooser import auto_range, chooser_for, forget
    from dflash_mlx.targets import adapt
    from dflash_mlx.tiny import make_tokenizer

    tokenizer = make_tokenizer(64)
    prompt = synthetic_prompt(draft.config.vocab_size, P)
    lm = lm_cache(model)
    for _ in generate_step(mx.array(prompt), model, max_tokens=1, prompt_cache=lm):
        pass
    ours = make_prompt_cache(model, draft)
    forget(draft)
    block = min(16, draft.config.block_size)
    rates: dict[str, list[float]] = {"plain": [], "our plain": [], "block": [], "auto": []}
    launches: dict[str, list[float]] = {"our plain": [], "auto": []}  # median ms a round
    for round_ in range(repeat + 1):  # the first round warms up
        ours_s, auto_s = [], []
        got = {"plain": decode_tps(plain_tokens(model, lm, prompt, max_tokens))}
        with plain_launches(ours_s):
            got["our plain"] = decode_tps(our_plain_tokens(model, draft, ours, prompt, max_tokens))
        got["block"] = decode_tps(dflash_tokens(model, draft, tokenizer, ours, prompt, max_tokens, block))
        with plain_launches(auto_s):
            got["auto"] = decode_tps(dflash_tokens(model, draft, tokenizer, ours, prompt, max_tokens, "auto"))
        if round_:
            for mode, tps in got.items():
                rates[mode].append(tps)
            for mode, taken in (("our plain", ours_s), ("auto", auto_s)):
                launches[mode].append(round(1000 * statistics.median(taken), 2) if taken else None)
    chooser = chooser_for(draft, *auto_range(adapt(model), draft))
    row = {mode: statistics.median(tps) for mode, tps in rates.items()}
    del lm, ours
    mx.clear_cache()
    return {
        "prompt_tokens": P,
        **row,
        "block_size": block,
        "auto_plain_steps": chooser.reply_plain,
        "auto_drafting_cycles": chooser.reply_drafting,
        "auto_reason": chooser.reason,
        # the chooser's own median cycle times by block (1: its plain step), ms
        "auto_times_ms": {b: round(1000 * t, 2) for b, t in chooser._median_times().items()},
        # a plain step's launch in our loop held at plain and inside auto, median ms by round
        "plain_launch_ms": launches,
    }


def weights_bytes(module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(module.parameters()))


def peak_above_resident(run) -> int:
    """The most bytes ``run`` held at once beyond what was allocated before it."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    run()
    mx.synchronize()
    return mx.get_peak_memory() - resident


def peak_memory(model, draft, P: int, max_tokens: int, block: int) -> dict:
    """Peak bytes of a greedy reply after a ``P``-token prompt: DFlash and plain mlx-lm (see the module docstring)."""
    from dflash_mlx import stream_generate
    from dflash_mlx.tiny import make_tokenizer

    tokenizer = make_tokenizer(64)
    prompt = synthetic_prompt(draft.config.vocab_size, P)

    def plain():
        for _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            pass

    def dflash():
        for _ in stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, block_size=block):
            pass

    target_bytes, draft_bytes = weights_bytes(model), weights_bytes(draft)
    plain_peak = target_bytes + peak_above_resident(plain)
    dflash_peak = target_bytes + draft_bytes + peak_above_resident(dflash)
    return {
        "prompt_tokens": P,
        "dflash": dflash_peak,
        "plain": plain_peak,
        "drafter_weights": draft_bytes,
        "ratio": dflash_peak / (plain_peak + draft_bytes),
    }


def print_memory(model, draft, lengths: list[int], max_tokens: int, block: int) -> None:
    block = min(block, draft.config.block_size)
    peak_memory(model, draft, 64, 8, block)  # first use: kernels checked and measured, not counted
    print(f"greedy, {max_tokens} new tokens, DFlash block {block}; MiB")
    print(f"{'prompt':>8} {'DFlash':>10} {'plain':>10} {'drafter':>10} {'DFlash / (plain + drafter)':>27}")
    mib = 2**20
    for P in lengths:
        r = peak_memory(model, draft, P, max_tokens, block)
        print(
            f"{P:>8} {r['dflash'] / mib:>10.1f} {r['plain'] / mib:>10.1f} "
            f"{r['drafter_weights'] / mib:>10.1f} {r['ratio']:>26.3f}x",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES) + sorted(KV_SHAPES) + sorted(FAMILIES),  # ("tiny": tiny_pair here)
        help="default: qwen3-8b on a GPU, tiny on a CPU; *-kv and *-like (families.py): for --memory",
    )
    ap.add_argument("--bits", choices=sorted(QUANTIZATIONS), help="--memory on a *-like shape: its weights")
    ap.add_argument("--prompt-tokens", help="comma-separated; default: 8192,16384,32768 (tiny: 256,1024)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens a reply")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds after the warm-up one")
    ap.add_argument("--pieces", action="store_true", help="a verify's pieces instead of decoding")
    ap.add_argument("--memory", action="store_true", help="peak memory of DFlash and plain mlx-lm instead")
    ap.add_argument("--block", type=int, default=16, help="--pieces: the verify's block; --memory: DFlash's block")
    args = ap.parse_args()
    shape = args.shape or ("qwen3-8b" if mx.default_device() == mx.gpu else "tiny")
    if args.pieces and shape == "tiny":
        ap.error("--pieces measures a model's shapes: name one with --shape (say small).")
    if args.pieces and args.memory:
        ap.error("--pieces and --memory are separate runs: pass one of them.")
    if args.block < 2:
        ap.error("--block takes 2 or more (a verify of the last token and at least one draft).")
    lengths = args.prompt_tokens or ("256,1024" if shape == "tiny" else "8192,16384,32768")
    try:
        lengths = [int(p) for p in lengths.split(",")]
    except ValueError:
        ap.error("--prompt-tokens takes comma-separated integers, say 8192,16384,32768.")
    if min(lengths) < 2 or args.max_tokens < 2 or args.repeat < 1:
        ap.error("prompts need 2 tokens or more, --max-tokens 2 or more and --repeat 1 or more.")
    if (shape in KV_SHAPES or shape in FAMILIES) and not args.memory:
        ap.error(f"--shape {shape} is for --memory.")
    if shape in KV_SHAPES:
        model, draft = kv_pair(shape)
    elif shape in FAMILIES:
        model, draft = build(FAMILIES[shape](False), args.bits)
    else:
        model, draft = tiny_pair() if shape == "tiny" else random_pair(shape, None)
    print(f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}; {shape}, random weights")
    if args.pieces:
        return print_pieces(model, draft, shape, lengths, args.block)
    if args.memory:
        return print_memory(model, draft, lengths, args.max_tokens, args.block)
    print(f"greedy, {args.max_tokens} new tokens a reply, median of {args.repeat} rounds after a warm-up one")
    head = f"{'prompt':>8} {'plain tok/s':>12} {'ours plain':>11} {'block tok/s':>12} {'auto tok/s':>11} "
    head += f"{'block/plain':>12} {'auto/plain':>11}"
    print(head + "  auto's last reply")
    for P in lengths:
        r = side_by_side(model, draft, P, args.max_tokens, args.repeat)
        did = f"{r['auto_plain_steps']} plain steps, {r['auto_drafting_cycles']} drafting cycles; {r['auto_reason']}"
        did += f"; its times ms {r['auto_times_ms']}"
        did += f"; plain launch ms by round, ours {r['plain_launch_ms']['our plain']}, in auto {r['plain_launch_ms']['auto']}"
        print(
            f"{P:>8} {r['plain']:>12.1f} {r['our plain']:>11.1f} {r['block']:>12.1f} {r['auto']:>11.1f} "
            f"{r['block'] / r['plain']:>11.2f}x {r['auto'] / r['plain']:>10.2f}x  {did}",
            flush=True,
        )


def print_pieces(model, draft, shape: str, lengths: list[int], block: int) -> None:
    print(f"block {block}")
    cols = [
        "prompt_tokens",
        "capacity",
        "plain_step_ms",
        "verify_ms",
        "attention_ms",
        "kernel_attention_ms",
        "cache_writes_ms",
    ]
    print(" ".join(f"{c:>20}" for c in cols))
    for P in lengths:
        row = pieces(model, draft, shape, P, block)
        print(
            " ".join(
                f"{row.get(c, float('nan')):>20.2f}" if c != "prompt_tokens" and c != "capacity" else f"{row[c]:>20}"
                for c in cols
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
