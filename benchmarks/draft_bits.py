"""The drafter's precision (--draft-bits): what a cycle gains in bytes and
what it loses in acceptance. Reported in BENCHMARKS.md, "The drafter's
precision".

    python benchmarks/draft_bits.py --prompts 6 --max-tokens 96 --repeat 3

(a) tokens a cycle and tok/s of a pair (the built-in one by default) on the
held-out prompts at block 16, the drafter as stored (16), at 8 and at 4 bits,
beside plain mlx-lm decoding of the same target; medians over --repeat runs,
the widths taking turns on each prompt.
(b) the bytes a cycle reads, by arithmetic: the target's weights once, the
drafter's once, the shared head once more for the drafter's rows, both KV
caches at --prompt-length; against a plain step's (the target's weights and
KV), at Qwen3-8B shapes beside a 4-bit target and at the built-in pair's.
(c) the drafter's forward at each width against its stored precision on
this machine: what ``--draft-bits auto`` measures (draft/precision.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WIDTHS = (16, 8, 4)


@dataclass(frozen=True)
class Shapes:
    """What a decoder's bytes follow; ``taps``: a drafter's tapped target layers."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 0
    taps: int = 0

    def linear_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.taps * self.hidden * self.hidden

    def kv_bytes(self, positions: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * positions * 2  # bf16 keys and values


QWEN3_8B = Shapes(4096, 36, 12288, 32, 8, 128, vocab=151936)
QWEN3_8B_DRAFTER = Shapes(4096, 5, 12288, 32, 8, 128, taps=5)  # z-lab/Qwen3-8B-DFlash-b16


def bytes_per_weight(bits: int, group: int = 64) -> float:
    """Affine quantization stores a bf16 scale and bias a group; 16: bf16."""
    return 2.0 if bits == 16 else (bits + 32 / group) / 8


def cycle_bytes(target: Shapes, target_bits: int, drafter: Shapes, draft_bits: int, prompt: int) -> dict:
    """A plain step's and a DFlash cycle's bytes read (the drafter's context at ``prompt`` positions)."""
    t = bytes_per_weight(target_bits)
    head = target.vocab * target.hidden * t
    step = target.linear_params() * t + head + target.kv_bytes(prompt)
    drafter_weights = drafter.linear_params() * bytes_per_weight(draft_bits)
    cycle = step + drafter_weights + head + drafter.kv_bytes(prompt)
    return {
        "draft_bits": draft_bits,
        "step_gb": step / 1e9,
        "drafter_gb": drafter_weights / 1e9,
        "cycle_gb": cycle / 1e9,
        "cycle_in_steps": cycle / step,
    }


def shapes_of(cfg: dict, taps: int = 0) -> Shapes:
    heads = cfg["num_attention_heads"]
    return Shapes(
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["intermediate_size"],
        heads,
        cfg["num_key_value_heads"],
        cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
        taps=taps,
    )


def bytes_table(prompt: int) -> list[dict]:
    from dflash_mlx import builtin

    rows = [
        {"pair": "Qwen3-8B 4-bit + Z Lab drafter", **cycle_bytes(QWEN3_8B, 4, QWEN3_8B_DRAFTER, bits, prompt)}
        for bits in WIDTHS
    ]
    target = json.loads((builtin.TARGET / "config.json").read_text())
    draft = json.loads((builtin.DRAFT / "config.json").read_text())
    taps = len(draft["dflash_config"]["target_layer_ids"])
    for bits in WIDTHS:
        got = cycle_bytes(shapes_of(target), 16, shapes_of(draft, taps), bits, prompt)
        rows.append({"pair": "built-in (bf16 target)", **got})
    return rows


def decode_rows(args, prompts: list[list[int]]) -> list[dict]:
    """Tokens a cycle and tok/s at each width, and plain mlx-lm's tok/s."""
    from bench_builtin import dflash, plain

    from dflash_mlx import load

    loaded = {bits: load(args.model, args.draft_model, draft_bits=None if bits == 16 else bits) for bits in WIDTHS}
    model, _, tokenizer = loaded[16]
    runs = {bits: [] for bits in (*WIDTHS, "plain")}
    for _ in range(args.repeat):
        for prompt in prompts:
            n, s = plain(model, tokenizer, prompt, args.max_tokens, 0.0, 0)
            runs["plain"].append((n, s, None))
            for bits in WIDTHS:
                target, draft, tok = loaded[bits]
                n, s, accepted = dflash(target, draft, tok, prompt, args.max_tokens, 0.0, args.block, 0, Counter())
                runs[bits].append((n, s, accepted))
    rows = []
    plain_rate = statistics.median(n / s for n, s, _ in runs["plain"])
    for bits in WIDTHS:
        rate = statistics.median(n / s for n, s, _ in runs[bits])
        accepted = statistics.mean(a for _, _, a in runs[bits])
        rows.append(
            {
                "draft_bits": bits,
                "tokens_a_cycle": accepted,
                "tok_s": rate,
                "plain_tok_s": plain_rate,
                "speedup": rate / plain_rate,
            }
        )
    return rows


def qwen3_8b_drafter():
    """A bf16 drafter at z-lab/Qwen3-8B-DFlash-b16's shapes, random weights,
    bound to a stand-in target of Qwen3-8B's hidden size and vocabulary (its
    layers' sizes do not enter the drafter's forward)."""
    import mlx.core as mx

    from dflash_mlx.targets import adapt
    from dflash_mlx.tiny import draft_config, make_target, target_config

    d = QWEN3_8B_DRAFTER
    tcfg = target_config("qwen3", vocab=QWEN3_8B.vocab, layers=d.taps + 1, hidden=d.hidden)
    target = make_target(dict(tcfg, intermediate_size=128))
    target.set_dtype(mx.bfloat16)
    cfg = draft_config(
        tcfg,
        layers=d.layers,
        block_size=16,
        taps=list(range(d.taps)),
        intermediate_size=d.intermediate,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=d.head_dim,
    )
    from dflash_mlx.draft.dflash import DFlashDraft, DraftConfig

    draft = DFlashDraft(DraftConfig.from_dict(cfg))
    draft.set_dtype(mx.bfloat16)
    mx.eval(draft.parameters())
    return draft.bind(adapt(target))


def forward_rows(args) -> list[dict]:
    """The drafter's forward at 8 and 4 bits against its stored precision, as auto times it."""
    from dflash_mlx import load
    from dflash_mlx.draft import precision
    from dflash_mlx.kernels import decisions

    if args.shape == "qwen3-8b":
        draft = qwen3_8b_drafter()
    else:
        _, draft, _ = load(args.model, args.draft_model, draft_bits=None)
    stored = precision.forward(precision.copy(draft))
    rows = []
    for bits in (8, 4):
        times = [decisions.seconds_per_call(precision.forward(precision.copy(draft, bits)), stored)]
        for _ in range(args.repeat - 1):
            times.append(decisions.seconds_per_call(precision.forward(precision.copy(draft, bits)), stored))
        ours, theirs = (statistics.median(t[i] for t in times) for i in (0, 1))
        rows.append({"draft_bits": bits, "quantized_ms": ours * 1e3, "stored_ms": theirs * 1e3, "ratio": ours / theirs})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts per set (code, chat)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt-length", type=int, default=1024, help="context positions the bytes count KV for")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument(
        "--shape",
        choices=("pair", "qwen3-8b"),
        default="pair",
        help="the drafter (c) times: the pair's, or Z Lab's Qwen3-8B one's shapes",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from bench_builtin import PROMPTS, machine, prompt_sets

    from dflash_mlx import load

    out = {"machine": machine(), "args": vars(args), "bytes": bytes_table(args.prompt_length)}
    out["forward"] = forward_rows(args)
    if not args.skip_decode:
        _, _, tokenizer = load(args.model, args.draft_model, draft_bits=None)
        sets = prompt_sets(tokenizer, json.loads(PROMPTS.read_text()), args.prompts)
        out["decode"] = decode_rows(args, sets["code"] + sets["chat"])
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(out["machine"])
    print(f"\nbytes a cycle (block {args.block}, prompt {args.prompt_length}), by arithmetic:")
    print("| pair | drafter bits | plain step GB | drafter GB | cycle GB | cycle in plain steps |")
    print("|---|---|---|---|---|---|")
    for r in out["bytes"]:
        print(
            f"| {r['pair']} | {r['draft_bits']} | {r['step_gb']:.4f} | {r['drafter_gb']:.4f} | "
            f"{r['cycle_gb']:.4f} | {r['cycle_in_steps']:.2f} |"
        )
    print("\nthe drafter's forward (block and context rows of its trained block), median ms:")
    print("| drafter bits | quantized ms | stored ms | quantized / stored |")
    print("|---|---|---|---|")
    for r in out["forward"]:
        print(f"| {r['draft_bits']} | {r['quantized_ms']:.3f} | {r['stored_ms']:.3f} | {r['ratio']:.2f} |")
    if "decode" in out:
        print(f"\ndecoding, block {args.block}, {args.max_tokens} tokens, greedy, median tok/s:")
        print("| drafter bits | tokens a cycle | tok/s | plain tok/s | speedup |")
        print("|---|---|---|---|---|")
        for r in out["decode"]:
            print(
                f"| {r['draft_bits']} | {r['tokens_a_cycle']:.2f} | {r['tok_s']:.1f} | "
                f"{r['plain_tok_s']:.1f} | {r['speedup']:.2f} |"
            )


if __name__ == "__main__":
    main()
