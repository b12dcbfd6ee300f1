"""Training a DFlash drafter against a frozen target (the DFlash recipe).

Each step runs the target once over self-distilled sequences for its tapped
states, and the drafter predicts ``blocks_per_seq`` sampled blocks per
sequence (forward.py). Position i's cross-entropy is weighted by
exp(-(i-1)/gamma): a draft is accepted only up to its first miss. The
held-out acceptance estimate uses sequences never trained on. The target's
embedding and head are shared through the adapter and never trained.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic_dir import partial_dir, remove_dead_leftovers, replace_dir
from ..draft.dflash import MAX_BLOCK_SIZE, DFlashDraft, DraftConfig, default_target_layer_ids
from .data import Sequence
from .forward import draft_logits, target_taps

CHECKPOINT = "checkpoint"
TRAIN_ARGS = "train_args.json"


@dataclass
class TrainConfig:
    model: str
    data: str
    out: str
    block_size: int = 16
    draft_layers: int = 5
    target_layer_ids: list[int] | None = None
    steps: int = 2000
    batch_size: int = 8
    blocks_per_seq: int = 16
    lr: float = 6e-4
    seq_len: int = 512  # prompt + response tokens
    resume: bool = False
    seed: int = 0
    gamma: float | None = None  # None: default_gamma(block_size)
    warmup: int | None = None  # None: 4% of steps
    save_every: int = 200
    gen_batch: int = 32
    max_prompts: int | None = None
    mask_token_id: int | None = None
    min_block_size: int | None = None  # None: all blocks full
    val_fraction: float | None = None  # None: 0.05, or the resumed run's
    compile: bool = True

    def check(self) -> None:
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v}.")

        for name in ("draft_layers", "steps", "batch_size", "blocks_per_seq", "save_every", "gen_batch"):
            positive(name)
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"--block-size must be at least 2 (the anchor token plus one draft) and at most "
                f"{MAX_BLOCK_SIZE}, got {self.block_size}."
            )
        if self.seq_len < 8:
            raise ValueError(f"--seq-len must be at least 8 tokens, got {self.seq_len}.")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}.")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"--gamma must be positive, got {self.gamma}.")
        if self.min_block_size is not None and not 2 <= self.min_block_size <= self.block_size:
            raise ValueError(
                f"--min-block-size must be between 2 and --block-size ({self.block_size}), got {self.min_block_size}."
            )
        if self.val_fraction is not None and not 0 <= self.val_fraction < 0.5:
            raise ValueError(f"--val-fraction must be in [0, 0.5), got {self.val_fraction}.")


def default_gamma(block_size: int) -> float:
    """The loss weights' decay: the DFlash paper's 7 at block 16, scaled with
    the drafted positions elsewhere."""
    return 7.0 * (block_size - 1) / 15.0


def position_weights(block_size: int, gamma: float) -> mx.array:
    return mx.exp(-mx.arange(block_size - 1, dtype=mx.float32) / gamma)


def choose_mask_token(tokenizer, vocab_size: int) -> tuple[int, str]:
    """A token id for the MASK slots, and why: preferably one the data never
    holds (the tokenizer's mask token, the first embedding row past its
    vocabulary, an unused special token), else the last id."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    mask = getattr(hf, "mask_token_id", None)
    if isinstance(mask, int) and 0 <= mask < vocab_size:
        return mask, f"the tokenizer's mask token {hf.mask_token!r}"
    try:
        n = len(hf)
    except TypeError:
        n = vocab_size
    if n < vocab_size:
        return n, f"the first embedding row past the tokenizer's {n} tokens (never produced by the tokenizer)"
    used = {getattr(hf, a, None) for a in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")}
    used |= set(getattr(tokenizer, "eos_token_ids", []) or [])
    added = getattr(hf, "added_tokens_decoder", {}) or {}
    spare = sorted(i for i in added if i not in used and 0 <= i < vocab_size)
    if spare:
        return spare[-1], f"the unused special token {str(added[spare[-1]])!r}"
    return vocab_size - 1, "the last token id (the vocabulary has no spare or mask token)"


def new_draft_config(target_model, adapter, tokenizer, cfg: TrainConfig) -> tuple[DraftConfig, str]:
    """A fresh drafter config shaped after the target, with ``draft_layers`` layers."""
    args = target_model.args
    n = adapter.num_layers
    if cfg.target_layer_ids:
        taps = list(cfg.target_layer_ids)
        bad = [t for t in taps if not 0 <= t < n]
        if bad:
            raise ValueError(f"--target-layer-ids {bad} do not exist in the {n}-layer target; use ids 0..{n - 1}.")
    else:
        taps = sorted({min(max(t, 0), n - 1) for t in default_target_layer_ids(n, cfg.draft_layers)})
    if cfg.mask_token_id is not None:
        if not 0 <= cfg.mask_token_id < adapter.vocab_size:
            raise ValueError(f"--mask-token-id must be in [0, {adapter.vocab_size}), got {cfg.mask_token_id}.")
        mask_id, why = cfg.mask_token_id, "given with --mask-token-id"
    else:
        mask_id, why = choose_mask_token(tokenizer, adapter.vocab_size)
    heads = int(args.num_attention_heads)
    rope_scaling = getattr(args, "rope_scaling", None)
    draft_cfg = DraftConfig(
        hidden_size=adapter.hidden_size,
        num_hidden_layers=cfg.draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(args, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(args, "head_dim", None) or adapter.hidden_size // heads),
        intermediate_size=int(args.intermediate_size),
        vocab_size=adapter.vocab_size,
        rms_norm_eps=float(args.rms_norm_eps),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        max_position_embeddings=int(getattr(args, "max_position_embeddings", None) or 32768),
        block_size=cfg.block_size,
        num_target_layers=n,
        target_layer_ids=taps,
        mask_token_id=int(mask_id),
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
    )
    return draft_cfg, f"mask token id {mask_id}: {why}"


def make_batch(seqs: list[Sequence], rng: np.random.Generator, cfg: TrainConfig, mask_id: int) -> dict[str, mx.array]:
    """Sample ``batch_size`` sequences and ``blocks_per_seq`` anchors in each:
    tokens [N, T] right-padded (harmless: the target is causal), block [B, bs],
    anchor, seq, length [B], and labels/valid [B, bs-1] for a+1..a+bs-1."""
    N, K, bs, T = cfg.batch_size, cfg.blocks_per_seq, cfg.block_size, cfg.seq_len
    picks = rng.integers(0, len(seqs), size=N)
    tokens = np.zeros((N, T), dtype=np.int32)
    anchors = np.zeros((N, K), dtype=np.int32)
    for r, i in enumerate(picks):
        s = seqs[i]
        L = len(s.tokens)
        tokens[r, :L] = s.tokens
        cands = np.arange(s.prompt_len, L - 1)  # the anchor's next token must exist
        anchors[r] = rng.choice(cands, size=K, replace=len(cands) < K)
    padded = np.concatenate([tokens, np.full((N, bs), -1, dtype=np.int32)], axis=1)
    offs = anchors[..., None] + np.arange(1, bs)  # [N, K, bs-1]
    labels = np.take_along_axis(padded, offs.reshape(N, -1), axis=1).reshape(N * K, bs - 1)
    lengths = np.array([len(seqs[i].tokens) for i in picks])
    valid = (offs < lengths[:, None, None]).reshape(N * K, bs - 1)
    low = cfg.min_block_size or bs
    own = rng.integers(low, bs + 1, size=N * K) if low < bs else np.full(N * K, bs)
    valid &= np.arange(1, bs)[None] < own[:, None]
    labels = np.where(valid, labels, 0)
    block = np.full((N * K, bs), mask_id, dtype=np.int32)
    block[:, 0] = np.take_along_axis(tokens, anchors, axis=1).reshape(-1)
    return {
        "tokens": mx.array(tokens),
        "block": mx.array(block),
        "anchor": mx.array(anchors.reshape(-1)),
        "seq": mx.array(np.repeat(np.arange(N, dtype=np.int32), K)),
        "length": mx.array(own.astype(np.int32)),
        "labels": mx.array(labels.astype(np.int32)),
        "valid": mx.array(valid.astype(np.float32)),
    }


def loss_and_stats(draft, taps, batch, weights):
    """Weighted cross-entropy, the acceptance estimate 1 / mean(1 / (1 + a_b))
    (a_b block b's accepted prefix; the plain mean overstates it when it
    varies), and the top-1 rate per position."""
    logits = draft_logits(draft, taps, batch).astype(mx.float32)
    labels, valid = batch["labels"], batch["valid"]
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    w = weights[None] * valid
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1.0)
    hit = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32) * valid
    accepted = mx.cumprod(hit, axis=-1).sum(axis=-1)
    tau = 1.0 / (1.0 / (1.0 + accepted)).mean()
    return loss, (tau, (hit.sum(axis=0) / mx.maximum(valid.sum(axis=0), 1.0)))


def split_held_out(seqs: list[Sequence], fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(training, held-out): a fixed random ``fraction`` of the sequences never
    trained on (none below 20 sequences)."""
    if fraction <= 0 or len(seqs) < 20:
        return seqs, []
    n = max(1, round(len(seqs) * fraction))
    order = np.random.default_rng([seed, 7]).permutation(len(seqs))
    held = set(order[:n].tolist())
    return [s for i, s in enumerate(seqs) if i not in held], [seqs[i] for i in sorted(held)]


def held_out_acceptance(
    draft, adapter, seqs: list[Sequence], cfg: TrainConfig, mask_id: int, weights, *, batches: int = 4
) -> dict:
    """Loss and acceptance estimate on held-out sequences, full blocks, fixed anchors."""
    full = TrainConfig(**{**asdict(cfg), "min_block_size": None})
    inv, losses = [], []
    taps_ids = list(draft.config.target_layer_ids)
    for k in range(batches):
        batch = make_batch(seqs, np.random.default_rng([cfg.seed, 99, k]), full, mask_id)
        taps = target_taps(adapter, batch["tokens"], taps_ids)
        loss, (tau, _) = loss_and_stats(draft, taps, batch, weights)
        mx.eval(loss, tau)
        losses.append(loss.item())
        inv.append(1.0 / tau.item())
    return {"acceptance": 1.0 / float(np.mean(inv)), "loss": float(np.mean(losses))}


def save_checkpoint(out: Path, draft: DFlashDraft, optimizer, step: int, extra: dict) -> None:
    tmp = partial_dir(out / CHECKPOINT)
    mx.save_safetensors(str(tmp / "draft.safetensors"), dict(tree_flatten(draft.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "config.json").write_text(json.dumps(draft.config.to_dict(), indent=2))
    (tmp / "state.json").write_text(json.dumps({"step": step, **extra}))
    replace_dir(tmp, out / CHECKPOINT)


def load_checkpoint(out: Path, draft: DFlashDraft, optimizer) -> dict:
    ck = out / CHECKPOINT
    draft.load_weights(list(mx.load(str(ck / "draft.safetensors")).items()))
    optimizer.state = tree_unflatten(list(mx.load(str(ck / "optimizer.safetensors")).items()))
    return json.loads((ck / "state.json").read_text())


def save_draft(out: Path, draft: DFlashDraft, dtype=mx.bfloat16) -> None:
    """config.json + model.safetensors in the Z Lab layout (``load_draft`` reads it)."""
    cfg = draft.config.to_dict()
    cfg["torch_dtype"] = {mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype, "float32")
    weights = {k: v.astype(dtype) for k, v in tree_flatten(draft.parameters())}
    tmp = partial_dir(out / "model.safetensors")
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    # Each rename is atomic, and config.json goes last: it never changes within
    # a run, so once it exists out/ holds a complete drafter.
    os.replace(tmp / "model.safetensors", out / "model.safetensors")
    os.replace(tmp / "config.json", out / "config.json")
    tmp.rmdir()


_SAME_ON_RESUME = (
    "block_size",
    "draft_layers",
    "target_layer_ids",
    "seq_len",
    "mask_token_id",
    "min_block_size",
    "val_fraction",
)
DEFAULT_VAL_FRACTION = 0.05

# progress(stage, done, total, info), stage "distill" or "train".
Log = Callable[[str], None]
StageProgress = Callable[[str, int, int, str], None]


def _nothing(*args) -> None:
    pass


def _resolve_out(cfg: TrainConfig) -> tuple[TrainConfig, Path]:
    """Check and create --out; returns a copy of the config with what it did not
    give filled in (on --resume, from the resumed run) and the directory."""
    out = Path(cfg.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory for the drafter.")
    if out.exists() and any(out.iterdir()) and not cfg.resume:
        raise ValueError(
            f"the output directory {out} already exists; pass --resume to continue training there, or choose a new --out."
        )
    out.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(out)
    filled = {}
    args_file = out / TRAIN_ARGS
    if cfg.resume and args_file.is_file():
        old = json.loads(args_file.read_text())
        changed = [k for k in _SAME_ON_RESUME if k in old and old[k] != getattr(cfg, k) and getattr(cfg, k) is not None]
        if changed:
            k = changed[0]
            raise ValueError(
                f"--{k.replace('_', '-')} is {getattr(cfg, k)} but {out} was trained with {old[k]}; "
                "resume with the same value or choose a new --out."
            )
        filled = {
            k: old.get(k) for k in ("target_layer_ids", "mask_token_id", "min_block_size") if getattr(cfg, k) is None
        }
        if cfg.val_fraction is None:  # a run from before the held-out split had none
            filled["val_fraction"] = old.get("val_fraction", 0.0)
    if cfg.val_fraction is None and "val_fraction" not in filled:
        filled["val_fraction"] = DEFAULT_VAL_FRACTION
    return replace(cfg, **filled), out


@dataclass
class Prepared:
    """What ``fit`` trains from."""

    cfg: TrainConfig  # every default and resumed value filled in
    out: Path
    adapter: Any
    draft_cfg: DraftConfig
    seqs: list[Sequence]
    held_out: list[Sequence]
    resuming: bool


@dataclass
class Fitted:
    """What ``fit`` did."""

    steps: int
    history: list  # [step, loss, acceptance estimate, seconds]
    held_out: list  # [step, acceptance estimate, loss] on the held-out sequences
    ema: tuple[float, float] | None  # (loss, acceptance estimate)
    top1_by_position: list | None
    seconds: float


def prepare(cfg: TrainConfig, *, target=None, log: Log = _nothing, progress: StageProgress = _nothing) -> Prepared:
    """Check the config and data, set up --out, load the target unless given
    as (model, tokenizer, adapter), shape the drafter and distill. A mistake
    found before any work leaves nothing behind."""
    from ..loading import load_target
    from ..prompts import read_prompts
    from ..targets import adapt
    from .data import data_fingerprint, distill, encode_prompts

    cfg.check()
    items = read_prompts(cfg.data)  # before touching --out, so bad data leaves nothing behind
    if cfg.max_prompts:
        items = items[: cfg.max_prompts]
    fresh_out = not Path(cfg.out).expanduser().exists()
    cfg, out = _resolve_out(cfg)
    try:
        if target is None:
            model, tokenizer = load_target(cfg.model)
            target = (model, tokenizer, adapt(model))
        model, tokenizer, adapter = target
        resuming = (out / CHECKPOINT / "state.json").is_file()
        if resuming:
            draft_cfg = DraftConfig.from_dict(json.loads((out / CHECKPOINT / "config.json").read_text()))
            why = f"mask token id {draft_cfg.mask_token_id} (from the checkpoint)"
        else:
            draft_cfg, why = new_draft_config(model, adapter, tokenizer, cfg)
        prompts = encode_prompts(items, tokenizer, max_prompt_len=cfg.seq_len // 2)
        if not prompts:
            raise ValueError(f"every prompt in {cfg.data} encodes to no tokens; give prompts with text.")
    except ValueError:
        if fresh_out:
            shutil.rmtree(out, ignore_errors=True)
        raise
    cfg = replace(cfg, target_layer_ids=list(draft_cfg.target_layer_ids), mask_token_id=draft_cfg.mask_token_id)
    (out / TRAIN_ARGS).write_text(json.dumps(asdict(cfg), indent=2))
    layers = draft_cfg.num_hidden_layers
    log(
        f"drafter: {layers} layer{'s' if layers > 1 else ''}, block {draft_cfg.block_size}, taps {draft_cfg.target_layer_ids}, {why}"
    )

    meta = {
        "data": data_fingerprint(cfg.data),
        "model": str(cfg.model),
        "seq_len": cfg.seq_len,
        "prompts": len(prompts),
    }
    seqs = distill(
        model,
        tokenizer,
        prompts,
        cfg.seq_len,
        out,
        meta,
        gen_batch=cfg.gen_batch,
        progress=lambda done, total: progress("distill", done, total, ""),
    )
    seqs = [s for s in seqs if len(s.tokens) - s.prompt_len >= 2]
    if not seqs:
        raise ValueError(
            "the target's responses are all shorter than 2 tokens, so there is nothing to learn; give longer prompts or a larger --seq-len."
        )
    seqs, held_out = split_held_out(seqs, cfg.val_fraction, cfg.seed)
    return Prepared(cfg, out, adapter, draft_cfg, seqs, held_out, resuming)


def _optimizer(cfg: TrainConfig, draft: DFlashDraft) -> optim.Optimizer:
    """AdamW, the learning rate warmed up linearly then decayed on a cosine."""
    warmup = cfg.warmup if cfg.warmup is not None else max(1, int(0.04 * cfg.steps))
    warmup = min(warmup, cfg.steps)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warmup),
            optim.cosine_decay(cfg.lr, max(1, cfg.steps - warmup), cfg.lr * 0.1),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=0.01)
    optimizer.init(draft.trainable_parameters())
    return optimizer


def fit(prep: Prepared, *, log: Log = _nothing, progress: StageProgress = _nothing) -> Fitted:
    """Run the optimizer to ``cfg.steps``, saving every ``save_every`` steps and at the end."""
    cfg, out, adapter, draft_cfg = prep.cfg, prep.out, prep.adapter, prep.draft_cfg
    mx.random.seed(cfg.seed)
    draft = DFlashDraft(draft_cfg)
    draft.set_dtype(mx.float32)
    draft.bind(adapter)
    optimizer = _optimizer(cfg, draft)
    step, history, ema, val_history = 0, [], None, []
    if prep.resuming:
        state = load_checkpoint(out, draft, optimizer)
        step, history, ema = state["step"], state.get("history", []), state.get("ema")
        val_history = state.get("held_out", [])
    weights = position_weights(cfg.block_size, cfg.gamma or default_gamma(cfg.block_size))
    taps_ids = list(draft_cfg.target_layer_ids)
    value_and_grad = nn.value_and_grad(draft, lambda d, t, b: loss_and_stats(d, t, b, weights))

    def one_step(batch):
        taps = target_taps(adapter, batch["tokens"], taps_ids)
        (loss, stats), grads = value_and_grad(draft, taps, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(draft, grads)
        return loss, stats

    if cfg.compile:  # every batch has the same shapes, so this compiles once
        one_step = mx.compile(one_step, inputs=[draft.state, optimizer.state], outputs=[draft.state, optimizer.state])

    log(
        f"{len(prep.seqs)} sequences for training, {len(prep.held_out)} held out; training steps {step}..{cfg.steps} "
        f"({cfg.batch_size} sequences x {cfg.blocks_per_seq} blocks per step)"
    )
    tic, done_here, by_position = time.perf_counter(), 0, None
    val_note = f" held-out≈{val_history[-1][1]:.2f}" if val_history else ""
    progress("train", step, cfg.steps, "")
    while step < cfg.steps:
        rng = np.random.default_rng([cfg.seed, step])  # per-step RNG: resume is exact
        batch = make_batch(prep.seqs, rng, cfg, draft_cfg.mask_token_id)
        loss, (accepted, by_pos) = one_step(batch)
        mx.eval(loss, accepted, by_pos, draft.parameters(), optimizer.state)
        step += 1
        done_here += 1
        loss_v, acc_v = loss.item(), accepted.item()
        ema = (loss_v, acc_v) if ema is None else (0.95 * ema[0] + 0.05 * loss_v, 0.95 * ema[1] + 0.05 * acc_v)
        by_position = by_pos.tolist()
        history.append([step, round(loss_v, 5), round(acc_v, 4), round(time.perf_counter() - tic, 3)])
        rate = done_here / (time.perf_counter() - tic)
        if step % cfg.save_every == 0 or step == cfg.steps:
            if prep.held_out:
                val = held_out_acceptance(draft, adapter, prep.held_out, cfg, draft_cfg.mask_token_id, weights)
                val_history.append([step, round(val["acceptance"], 4), round(val["loss"], 5)])
                val_note = f" held-out≈{val['acceptance']:.2f}"
            save_checkpoint(
                out, draft, optimizer, step, {"seed": cfg.seed, "history": history, "ema": ema, "held_out": val_history}
            )
            save_draft(out, draft, _out_dtype(adapter))
        progress(
            "train",
            step,
            cfg.steps,
            f"loss {ema[0]:.3f} accept≈{ema[1]:.2f}{val_note} /{cfg.block_size} {rate:.1f} step/s",
        )
    # A run killed between its last checkpoint and drafter saves resumes here
    # with no steps left; the drafter must still come from that checkpoint.
    if done_here == 0:
        save_draft(out, draft, _out_dtype(adapter))
    return Fitted(step, history, val_history, ema, by_position, time.perf_counter() - tic)


def summarize(prep: Prepared, fitted: Fitted, *, log: Log = _nothing) -> dict[str, Any]:
    """The run's summary (final loss, acceptance estimates, history), said in one line too."""
    cfg, ema = prep.cfg, fitted.ema
    summary = {
        "out": str(prep.out),
        "steps": fitted.steps,
        "loss": ema[0] if ema else None,
        "acceptance_estimate": ema[1] if ema else None,
        "top1_by_position": fitted.top1_by_position,
        "history": fitted.history,
        "held_out": fitted.held_out,
        "held_out_acceptance": fitted.held_out[-1][1] if fitted.held_out else None,
        "sequences": len(prep.seqs),
        "held_out_sequences": len(prep.held_out),
        "train_seconds": fitted.seconds,
    }
    if not ema:
        log(f"drafter saved to {prep.out}")
        return summary
    lengths = f" (blocks of {cfg.min_block_size}-{cfg.block_size})" if cfg.min_block_size else ""
    held = (
        f", {summary['held_out_acceptance']:.2f} on {len(prep.held_out)} held-out sequences"
        if summary["held_out_acceptance"] is not None
        else ""
    )
    log(
        f"drafter saved to {prep.out} (loss {summary['loss']:.3f}, estimated acceptance length "
        f"{summary['acceptance_estimate']:.2f} on training batches{lengths}{held} at block {cfg.block_size})"
    )
    return summary


def train(cfg: TrainConfig, *, target=None, log: Log = _nothing, progress: StageProgress = _nothing) -> dict[str, Any]:
    """The whole recipe, prepare -> fit -> summarize; returns the summary."""
    prep = prepare(cfg, target=target, log=log, progress=progress)
    return summarize(prep, fit(prep, log=log, progress=progress), log=log)


def _out_dtype(adapter):
    """Save in the target's floating dtype (bf16 targets get bf16 drafters)."""
    dt = adapter.dtype
    return dt if dt in (mx.bfloat16, mx.float16, mx.float32) else mx.bfloat16
