"""Rebuild the built-in pair shipped in dflash_mlx/builtin/: a small Qwen3
target trained from scratch on the Python standard library, its byte-level BPE
tokenizer, and its DFlash drafter trained with ``dflash_mlx.train``.

    python scripts/build_builtin.py all --extra-code DIR   # every stage on one machine

How the shipped pair was made (tokenizer and corpus on a CPU, the rest on one H200):

    python scripts/build_builtin.py tokenizer
    python scripts/build_builtin.py corpus --corpus build/corpus.npz
    python scripts/build_builtin.py target --target-minutes 1.3 --corpus build/corpus.npz
    SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
    python scripts/build_builtin.py draft --extra-code $SP --gen-batch 2048 --draft-minutes 12
    python scripts/build_builtin.py draft --extra-code $SP --gen-batch 2048 --draft-steps 30000

Each stage resumes where a run cut short left it (the last line above extended
the finished 15,355-step run to 30,000 steps).

Stages (each reads what the one before wrote into --dest):
    tokenizer  byte-level BPE (4096 ids, ChatML template, <|mask|>), on CPU in a minute
    corpus     (optional) the tokenized corpus in one .npz (--corpus), to train elsewhere on the same text
    target     Qwen3 (8 layers, hidden 256, ~7M parameters), trained for --target-minutes
    draft      self-distillation prompts (stdlib, plus --extra-code files the target never saw)
               + ``dflash_mlx.train`` for --draft-minutes or --draft-steps

Training wants a GPU (MLX's CUDA backend or Apple silicon); the CPU works but
gets far fewer steps in the same minutes. Steps are fitted to the time budget
after a short calibration, so a rebuild on other hardware trains longer or
shorter; BUILD.json records what was done.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from builtin_corpus import (  # noqa: E402
    chat_request,
    code_prompts,
    functions,
    mixed_prompts,
    python_files,
    stdlib_files,
    stdlib_root,
)

DEST = ROOT / "dflash_mlx" / "builtin"
VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TARGET = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=768,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=[0, 2],
    torch_dtype="bfloat16",
)
SEQ = 512
CALIBRATE = 60  # steps timed before the step count is fitted to the budget
WARM = 10


def log(*a):
    print(*a, flush=True)


def record(dest: Path, key: str, value) -> None:
    f = dest / "BUILD.json"
    info = json.loads(f.read_text()) if f.is_file() else {}
    info[key] = value
    f.write_text(json.dumps(info, indent=2) + "\n")


def machine() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    name = ""
    if dev.type == mx.gpu:
        try:
            name = mx.device_info().get("device_name", "")
        except Exception:
            name = ""
    return f"{platform.machine()} {platform.system()}, MLX {mx.__version__} {dev} {name}".strip()


# -- tokenizer --------------------------------------------------------------------


def build_tokenizer(dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [t for _, t in stdlib_files()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=TARGET["max_position_embeddings"],
    )
    hf.chat_template = CHAT_TEMPLATE
    out = dest / "target"
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    # The chat template lives in tokenizer_config.json, readable by transformers 4 and 5 alike.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "<|mask|>",
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "model_max_length": TARGET["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    n = sum(len(t) for t in texts)
    ids = tok.encode_batch(texts[:200])
    ratio = sum(len(t) for t in texts[:200]) / sum(len(e.ids) for e in ids)
    log(f"tokenizer: {tok.get_vocab_size()} ids from {len(texts)} files ({n / 1e6:.1f} MB), {ratio:.2f} chars/token")
    record(
        dest,
        "tokenizer",
        {
            "vocab": tok.get_vocab_size(),
            "files": len(texts),
            "chars_per_token": round(ratio, 2),
            "python": platform.python_version(),
        },
    )


# -- target -------------------------------------------------------------------------


def chat_text(request: str, answer: str) -> str:
    return f"<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def token_stream(tok, files, seed: int, chat: bool = True):
    import numpy as np

    docs = [t for _, t in files]
    if chat:
        for _, t in files:
            docs += [chat_text(chat_request(sig, doc), src) for sig, doc, src in functions(t)]
    random.Random(seed).shuffle(docs)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for enc in tok._tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32), len(docs)


def load_or_make_corpus(tok, corpus: Path | None, seed: int):
    """(training ids, held-out ids, documents): read from ``corpus`` (.npz) if
    it exists, else tokenized from this Python's stdlib and saved there."""
    import numpy as np

    if corpus is not None and corpus.is_file():
        saved = np.load(corpus)
        return saved["train"].astype(np.int32), saved["val"].astype(np.int32), int(saved["docs"])
    train_ids, n_docs = token_stream(tok, stdlib_files(), seed)
    val_ids, _ = token_stream(tok, stdlib_files(held_out=True), seed, chat=False)
    if corpus is not None:
        corpus.parent.mkdir(parents=True, exist_ok=True)
        np.savez(corpus, train=train_ids.astype(np.uint16), val=val_ids.astype(np.uint16), docs=n_docs)
    return train_ids, val_ids, n_docs


def train_target(dest: Path, minutes: float, seed: int, batch: int, corpus: Path | None = None) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3 import Model, ModelArgs
    from transformers import AutoTokenizer

    out = dest / "target"
    tok = AutoTokenizer.from_pretrained(str(out))
    t0 = time.perf_counter()
    train_ids, val_ids, n_docs = load_or_make_corpus(tok, corpus, seed)
    log(
        f"corpus: {len(train_ids) / 1e6:.2f}M training tokens ({n_docs} documents), "
        f"{len(val_ids) / 1e6:.2f}M held-out tokens, tokenized in {time.perf_counter() - t0:.0f}s"
    )

    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(TARGET))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"target: {n_params / 1e6:.2f}M parameters on {machine()}")
    peak, warmup = 2e-3, 100
    optimizer = optim.AdamW(learning_rate=peak, betas=[0.9, 0.95], weight_decay=0.1)

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    from functools import partial

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)

    def sample(ids, n):
        starts = rng.integers(0, len(ids) - SEQ - 1, size=n)
        win = np.stack([ids[s : s + SEQ + 1] for s in starts])
        return mx.array(win[:, :-1]), mx.array(win[:, 1:])

    budget = minutes * 60
    tic = time.perf_counter()
    total, i, losses = None, 0, []
    while total is None or i < total:
        if total is None:
            lr = peak * min(1.0, (i + 1) / warmup)
        else:
            frac = min(1.0, max(0.0, (i - warmup) / max(1, total - warmup)))
            lr = peak * min(1.0, (i + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        x, y = sample(train_ids, batch)
        loss = step(x, y)
        mx.eval(state)
        i += 1
        if i % 50 == 0 or i == 1:
            losses.append((i, loss.item()))
            el = time.perf_counter() - tic
            log(f"step {i}{'/' + str(total) if total else ''} loss {losses[-1][1]:.3f} lr {lr:.2e} {el:.0f}s")
        if i == WARM:
            warm_tic = time.perf_counter()  # the first steps include compiling
        if total is None and i == CALIBRATE:
            rate = (i - WARM) / (time.perf_counter() - warm_tic)
            total = i + int((budget - (time.perf_counter() - tic)) * rate)
            log(f"{rate:.2f} steps/s: training {total} steps")
    train_s = time.perf_counter() - tic

    model.eval()
    val = []
    for _ in range(8):
        x, y = sample(val_ids, 16)
        val.append(loss_fn(model, x, y).item())
    val_loss = float(np.mean(val))
    log(f"held-out loss {val_loss:.3f} (perplexity {math.exp(val_loss):.1f}) after {total} steps, {train_s:.0f}s")

    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(TARGET, indent=2) + "\n")
    record(
        dest,
        "target",
        {
            "parameters": n_params,
            "steps": total,
            "batch": f"{batch}x{SEQ}",
            "train_tokens": len(train_ids),
            "seconds": round(train_s),
            "final_train_loss": round(losses[-1][1], 3),
            "held_out_loss": round(val_loss, 3),
            "machine": machine(),
            "python": platform.python_version(),
        },
    )


# -- drafter ------------------------------------------------------------------------


def draft_data(path: Path, args, seed: int) -> dict:
    """The drafter's training prompts (JSONL), and what went into them.

    Code prefixes and chat requests from the stdlib's training files, plus
    (--extra-code) the same from .py files the target never saw, such as an
    installed package tree: the target's answers to unseen code are what the
    drafter meets at inference, and they differ from its near-verbatim
    continuations of the files it was trained on. Held-out stdlib files are
    never used."""
    stdlib = stdlib_files()
    extra = []
    for d in args.extra_code or []:
        extra += [f for f in python_files(Path(d), args.extra_files, seed) if not f[0].startswith(str(stdlib_root()))]
    if extra:
        pools = [("stdlib", stdlib, 1.0 - args.extra_share), ("extra", extra, args.extra_share)]
    else:
        pools = [("stdlib", stdlib, 1.0)]
    rows, counts = [], {}
    for name, files, share in pools:
        n_code = int(args.code_prompts * share)
        n_mixed = n_code // 2
        code = code_prompts(files, n_code - n_mixed, seed) + mixed_prompts(files, n_mixed, seed)
        fns = [f for _, t in files for f in functions(t)]
        random.Random(seed).shuffle(fns)
        chat = [
            {"messages": [{"role": "user", "content": chat_request(sig, doc)}]}
            for sig, doc, _ in fns[: int(args.chat_prompts * share)]
        ]
        rows += [{"prompt": p} for p in code] + chat
        counts[name] = {"files": len(files), "code_prompts": len(code), "chat_prompts": len(chat)}
    random.Random(seed + 1).shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return counts


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def train_draft(dest: Path, work: Path, minutes: float, seed: int, args) -> None:
    from rich.console import Console

    from dflash_mlx.train.trainer import TrainConfig, train

    work.mkdir(parents=True, exist_ok=True)
    data = work / "draft_data.jsonl"
    sources = draft_data(data, args, seed)
    log(f"prompts: {sources}")
    console = Console(force_terminal=False, width=120)
    taps = _ids(args.taps)

    def cfg(out, steps):
        return TrainConfig(
            model=str(dest / "target"),
            data=str(data),
            out=str(out),
            block_size=16,
            draft_layers=args.draft_layers,
            target_layer_ids=taps,
            steps=steps,
            batch_size=args.draft_batch,
            blocks_per_seq=16,
            seq_len=args.seq_len,
            lr=args.draft_lr,
            seed=seed,
            save_every=args.save_every,
            gen_batch=args.gen_batch,
            min_block_size=args.min_block,
            val_fraction=args.val_fraction,
        )

    # Calibration run: makes the self-distilled data and times a few steps.
    cal = work / "calibrate"
    tic = time.perf_counter()
    c = cfg(cal, 40)
    c.resume = cal.is_dir()  # a run cut short goes on with the data already written
    first = train(c, log=console.print)
    distill_s = time.perf_counter() - tic - first["train_seconds"]
    h = first["history"]
    rate = 30 / (h[39][3] - h[9][3])  # the first steps include building kernels
    steps = args.draft_steps or max(50, int(rate * (minutes * 60 - (time.perf_counter() - tic))))
    run = work / "draft"
    if (run / "train_args.json").is_file() and not args.draft_steps:  # a run cut short keeps its step count
        steps = json.loads((run / "train_args.json").read_text())["steps"]
    log(
        f"self-distillation {distill_s:.0f}s for {first['sequences'] + first['held_out_sequences']} sequences; "
        f"{rate:.2f} steps/s: training {steps} steps"
    )
    if not (run / "checkpoint").is_dir():  # a run cut short resumes where it stopped
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        for f in ("distill.jsonl", "distill.meta.json"):
            shutil.copy(cal / f, run / f)
    c = cfg(run, steps)
    c.resume = True  # reuse the copied self-distilled data
    summary = train(c, log=console.print)
    out = dest / "draft"
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(run / f, out / f)
    record(
        dest,
        "draft",
        {
            "layers": args.draft_layers,
            "block_size": 16,
            "min_block_size": args.min_block,
            "taps": taps,
            "steps": steps,
            "batch": f"{args.draft_batch} sequences x 16 blocks",
            "prompts": sources,
            "sequences": summary["sequences"],
            "held_out_sequences": summary["held_out_sequences"],
            "seq_len": args.seq_len,
            "seconds": round(summary["train_seconds"]),
            "distill_seconds": round(distill_s),
            "final_loss": round(summary["loss"], 3),
            "acceptance_estimate_b16": round(summary["acceptance_estimate"], 2),
            "held_out_acceptance_b16": summary["held_out_acceptance"],
            "held_out_history": summary["held_out"],
            "machine": machine(),
        },
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["tokenizer", "corpus", "target", "draft", "all"])
    ap.add_argument("--dest", type=Path, default=DEST)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "builtin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-minutes", type=float, default=1.3)
    ap.add_argument("--target-batch", type=int, default=64)
    ap.add_argument("--draft-minutes", type=float, default=12.0)
    ap.add_argument("--draft-steps", type=int, help="optimizer steps (default: as many as --draft-minutes allow)")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--taps", default="1,3,5,7", help="target layers the drafter reads")
    ap.add_argument(
        "--min-block", type=int, default=4, help="blocks of random length min..16, so block sizes 4-16 all work"
    )
    ap.add_argument("--draft-batch", type=int, default=64)
    ap.add_argument("--draft-lr", type=float, default=1e-3)
    ap.add_argument("--seq-len", type=int, default=320, help="prompt + response tokens per distilled sequence")
    ap.add_argument("--code-prompts", type=int, default=120000, help="half of them mixed (scripts/builtin_corpus.py)")
    ap.add_argument("--chat-prompts", type=int, default=30000)
    ap.add_argument(
        "--extra-code",
        action="append",
        type=Path,
        help="a directory of .py files the target never saw (e.g. an installed package tree): --extra-share "
        "of the prompts come from it (repeatable)",
    )
    ap.add_argument("--extra-files", type=int, default=20000, help="at most this many files from --extra-code")
    ap.add_argument("--extra-share", type=float, default=0.5)
    ap.add_argument("--gen-batch", type=int, default=1024, help="prompts the target answers at once")
    ap.add_argument("--val-fraction", type=float, default=0.02)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument(
        "--corpus",
        type=Path,
        help="token ids of the stdlib corpus (.npz): read if it exists, else made "
        "from this Python's stdlib and saved there (lets another machine train on the same text)",
    )
    ap.add_argument("--smoke", action="store_true", help="a toy-sized run that only checks the script works")
    args = ap.parse_args()
    if args.smoke:
        global SEQ, CALIBRATE, WARM
        TARGET.update(hidden_size=64, num_hidden_layers=8, intermediate_size=128, head_dim=16)
        SEQ, CALIBRATE, WARM = 64, 5, 2
        args.code_prompts, args.chat_prompts, args.draft_batch, args.gen_batch = 24, 8, 4, 8
        args.draft_layers, args.taps, args.seq_len, args.save_every = 2, "1,4,6", 96, 50
    args.dest.mkdir(parents=True, exist_ok=True)
    if args.stage in ("tokenizer", "all"):
        build_tokenizer(args.dest)
    if args.stage == "corpus":
        if args.corpus is None:
            ap.error("the corpus stage needs --corpus PATH.npz")
        from transformers import AutoTokenizer

        ids, val, docs = load_or_make_corpus(
            AutoTokenizer.from_pretrained(str(args.dest / "target")), args.corpus, args.seed
        )
        log(
            f"corpus: {len(ids) / 1e6:.2f}M training tokens ({docs} documents), {len(val) / 1e6:.2f}M held-out -> {args.corpus}"
        )
    if args.stage in ("target", "all"):
        train_target(args.dest, args.target_minutes, args.seed, args.target_batch, args.corpus)
    if args.stage in ("draft", "all"):
        train_draft(args.dest, args.work, args.draft_minutes, args.seed, args)


if __name__ == "__main__":
    main()
