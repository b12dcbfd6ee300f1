"""Trainer throughput and what it learns: a tiny drafter's steps/s, loss and acceptance length.

Reported in BENCHMARKS.md, "Training a drafter".

    python benchmarks/bench_train_tiny.py --steps 200

On a tiny random target (CPU-sized): self-distillation, ``--steps`` optimizer
steps, then the trained drafter's acceptance length against an untrained one
of the same shape, on prompts the training never saw.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=8)
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from dflash_mlx import load_draft
    from dflash_mlx.draft.dflash import DFlashDraft
    from dflash_mlx.tiny import make_target, make_tokenizer, mean_acceptance, target_config, write_target
    from dflash_mlx.train.trainer import TrainConfig, train

    vocab = 32
    root = Path(tempfile.mkdtemp())
    tcfg = target_config(vocab=vocab, layers=6, hidden=64)
    write_target(root / "target", tcfg, make_target(tcfg), make_tokenizer(vocab))
    rng = np.random.default_rng(0)
    (root / "data.jsonl").write_text(
        "".join(
            json.dumps({"prompt": " ".join(f"w{t}" for t in rng.integers(0, vocab, size=int(rng.integers(3, 10))))})
            + "\n"
            for _ in range(64)
        )
    )
    tic = time.perf_counter()
    summary = train(
        TrainConfig(
            model=str(root / "target"),
            data=str(root / "data.jsonl"),
            out=str(root / "out"),
            block_size=args.block_size,
            draft_layers=2,
            steps=args.steps,
            batch_size=4,
            blocks_per_seq=8,
            seq_len=48,
            lr=3e-3,
            save_every=args.steps,
        )
    )
    seconds = time.perf_counter() - tic

    model, tok = load(str(root / "target"))
    trained = load_draft(root / "out")
    untrained = DFlashDraft(trained.config)
    mx.eval(untrained.parameters())
    rng = np.random.default_rng(123)
    prompts = [[int(t) for t in rng.integers(0, vocab, size=6)] for _ in range(16)]

    h = summary["history"]
    print(
        f"tiny target (6 layers, hidden 64, vocab 32), drafter 2 layers, block {args.block_size}, "
        f"{args.steps} steps in {seconds:.1f}s (self-distillation included) on {mx.default_device()}"
    )
    print(
        f"loss: first 10 steps {np.mean([x[1] for x in h[:10]]):.3f}, last 10 steps {np.mean([x[1] for x in h[-10:]]):.3f}"
    )
    print(f"training estimate of acceptance: {summary['acceptance_estimate']:.2f}")
    print(
        f"acceptance length on 16 unseen prompts (greedy, 40 tokens): trained {mean_acceptance(model, trained, tok, prompts):.2f}, "
        f"untrained {mean_acceptance(model, untrained, tok, prompts):.2f}"
    )


if __name__ == "__main__":
    main()
