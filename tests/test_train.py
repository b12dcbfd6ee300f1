"""The drafter trainer on tiny random targets (CPU, a minute or so in all)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.draft.dflash import DFlashDraft, DraftConfig
from dflash_mlx.prompts import read_prompts
from dflash_mlx.targets import adapt
from dflash_mlx.tiny import draft_config, make_target, make_tokenizer, mean_acceptance, target_config, write_target
from dflash_mlx.train.data import Sequence
from dflash_mlx.train.forward import draft_logits, target_taps
from dflash_mlx.train.trainer import TrainConfig, make_batch, train

VOCAB = 32


def _prompt(rng, n):
    return " ".join(f"w{t}" for t in rng.integers(0, VOCAB, size=n))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tcfg = target_config(vocab=VOCAB, layers=6, hidden=64)
    model = make_target(tcfg)
    tok = make_tokenizer(VOCAB)
    write_target(root / "target", tcfg, model, tok)
    rng = np.random.default_rng(0)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": _prompt(rng, int(rng.integers(3, 10)))}) + "\n" for _ in range(64)))
    return root


def _cfg(tiny, out, **kw):
    base = dict(
        model=str(tiny / "target"),
        data=str(tiny / "data.jsonl"),
        out=str(out),
        block_size=8,
        draft_layers=2,
        steps=20,
        batch_size=4,
        blocks_per_seq=8,
        seq_len=48,
        lr=3e-3,
        save_every=10,
    )
    base.update(kw)
    return TrainConfig(**base)


# -- the training forward is the inference forward -------------------------------


@pytest.mark.parametrize("sliding,min_block", [(False, None), (True, None), (False, 2), (True, 3)])
def test_training_blocks_match_inference(sliding, min_block):
    tcfg = target_config(vocab=VOCAB, layers=6, hidden=64)
    target = adapt(make_target(tcfg))
    extra = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6} if sliding else {}
    mx.random.seed(3)
    draft = DFlashDraft(DraftConfig.from_dict(draft_config(tcfg, layers=2, block_size=5, **extra))).bind(target)
    rng = np.random.default_rng(1)
    seqs = [Sequence([int(t) for t in rng.integers(0, VOCAB, size=n)], 3) for n in (20, 14)]
    cfg = TrainConfig(
        model="", data="", out="", block_size=5, batch_size=2, blocks_per_seq=4, seq_len=24, min_block_size=min_block
    )
    batch = make_batch(seqs, rng, cfg, draft.config.mask_token_id)
    taps = target_taps(target, batch["tokens"], draft.config.target_layer_ids)
    got = draft_logits(draft, taps, batch)
    B = batch["block"].shape[0]
    lengths = batch["length"].tolist()
    if min_block is None:
        assert lengths == [5] * B
    else:
        assert min(lengths) >= min_block and len(set(lengths)) > 1
    for b in range(B):
        n, a, L = int(batch["seq"][b]), int(batch["anchor"][b]), lengths[b]
        cache = draft.make_cache()
        draft.extend(taps[n : n + 1, :a], cache)
        want = draft(batch["block"][b : b + 1, :L], None, cache)[0]  # inference with a block of length L
        assert mx.allclose(got[b, : L - 1], want, atol=1e-4).item(), (b, a, L)
        # positions past the block's own length carry no label
        assert batch["valid"][b, L - 1 :].sum().item() == 0


# -- it learns ------------------------------------------------------------------


def test_loss_falls_and_acceptance_rises(tiny, tmp_path):
    summary = train(_cfg(tiny, tmp_path / "d", steps=200, save_every=200))
    losses = [h[1] for h in summary["history"]]
    assert np.mean(losses[-30:]) < 0.6 * np.mean(losses[:10])

    from mlx_lm import load

    model, tok = load(str(tiny / "target"))
    trained = load_draft(tmp_path / "d")
    untrained = DFlashDraft(trained.config)
    rng = np.random.default_rng(123)  # prompts the training never saw
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=6)] for _ in range(6)]
    acc_trained = mean_acceptance(model, trained, tok, prompts)
    acc_untrained = mean_acceptance(model, untrained, tok, prompts)
    assert acc_trained > acc_untrained + 1.0, (acc_trained, acc_untrained)


def test_compiled_step_equals_plain_step(tiny, tmp_path):
    a = train(_cfg(tiny, tmp_path / "a", steps=6, min_block_size=3))
    b = train(_cfg(tiny, tmp_path / "b", steps=6, min_block_size=3, compile=False))
    assert np.allclose([h[1] for h in a["history"]], [h[1] for h in b["history"]], atol=1e-4)
    wa = dict(tree_flatten(load_draft(tmp_path / "a").parameters()))
    wb = dict(tree_flatten(load_draft(tmp_path / "b").parameters()))
    assert all(mx.allclose(wa[k], wb[k], atol=1e-3).item() for k in wa)


def test_held_out_sequences_never_train(tiny, tmp_path):
    from dflash_mlx.train.data import load_distilled
    from dflash_mlx.train.trainer import split_held_out

    summary = train(_cfg(tiny, tmp_path / "d", steps=10, save_every=5, val_fraction=0.1))
    seqs = load_distilled(tmp_path / "d")
    kept, held = split_held_out(seqs, 0.1, 0)
    assert len(held) == round(0.1 * len(seqs)) and summary["held_out_sequences"] == len(held)
    assert not {tuple(s.tokens) for s in held} & {tuple(s.tokens) for s in kept}
    # measured at every checkpoint, and no training batch ever draws a held-out sequence
    assert [h[0] for h in summary["held_out"]] == [5, 10]
    assert 1.0 <= summary["held_out_acceptance"] <= 8.0
    rng = np.random.default_rng(5)
    cfg = _cfg(tiny, tmp_path / "x")
    batch = make_batch(kept, rng, cfg, 0)
    rows = {tuple(r[r != 0].tolist()) for r in np.array(batch["tokens"])}
    assert not rows & {tuple(t for t in s.tokens if t != 0) for s in held}
    none = train(_cfg(tiny, tmp_path / "e", steps=2, val_fraction=0.0))
    assert none["held_out_sequences"] == 0 and none["held_out_acceptance"] is None


# -- checkpoints and output ------------------------------------------------------------


def test_resume_continues_exactly(tiny, tmp_path, monkeypatch):
    straight = train(_cfg(tiny, tmp_path / "a", steps=20))

    import dflash_mlx.train.trainer as trainer

    save = trainer.save_checkpoint

    def save_then_stop(out, draft, optimizer, step, extra):
        save(out, draft, optimizer, step, extra)
        if step == 10:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C here

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny, tmp_path / "b", steps=20))
    monkeypatch.setattr(trainer, "save_checkpoint", save)
    state = json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 10
    resumed = train(_cfg(tiny, tmp_path / "b", steps=20, resume=True))
    assert [h[0] for h in resumed["history"]] == list(range(1, 21))
    assert np.allclose([h[1] for h in resumed["history"]], [h[1] for h in straight["history"]], atol=1e-4)
    a = dict(tree_flatten(load_draft(tmp_path / "a").parameters()))
    b = dict(tree_flatten(load_draft(tmp_path / "b").parameters()))
    assert all(mx.allclose(a[k], b[k], atol=1e-5).item() for k in a)
    # The self-distilled data was made once and reused.
    assert (tmp_path / "b" / "distill.jsonl").is_file()


KILLED_TRAIN = """
import json, sys, time
from pathlib import Path
import mlx.core as mx
from dflash_mlx.train.trainer import TrainConfig, train

save, calls = mx.save_safetensors, [0]

def save_then_hang(path, *args, **kw):
    save(path, *args, **kw)
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        Path(sys.argv[2]).write_text(path)
        time.sleep(600)

mx.save_safetensors = save_then_hang
train(TrainConfig(**json.loads(sys.argv[1])))
"""


# Each save writes the checkpoint's drafter and optimizer, then the drafter:
# the 4th write is the second checkpoint's, the 6th the second drafter's.
@pytest.mark.parametrize("hang_at", [4, 6])
def test_sigkill_leaves_a_complete_drafter_and_resume_cleans_up(tiny, tmp_path, hang_at):
    out, ready = tmp_path / "d", tmp_path / "ready"
    cfg = _cfg(tiny, out, steps=6, save_every=2)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAIN, json.dumps(asdict(cfg)), str(ready), str(hang_at)])
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None and time.time() < deadline, "the child run never got to its save"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Half-written: a partial directory, never the checkpoint or the drafter.
    assert ".partial-" in Path(ready.read_text()).parent.name
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == (2 if hang_at == 4 else 4)
    first = dict(tree_flatten(load_draft(out).parameters()))  # the drafter of step 2, complete
    assert [p.name for p in out.iterdir() if ".partial-" in p.name]

    train(_cfg(tiny, out, steps=6, save_every=2, resume=True))
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 6
    last = dict(tree_flatten(load_draft(out).parameters()))
    assert any(not mx.array_equal(first[k], last[k]).item() for k in first)


def test_sigkill_before_the_first_save_leaves_no_drafter(tiny, tmp_path):
    out, ready = tmp_path / "d", tmp_path / "ready"
    cfg = _cfg(tiny, out, steps=4, save_every=2)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAIN, json.dumps(asdict(cfg)), str(ready), "3"])
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None and time.time() < deadline, "the child run never got to its save"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    with pytest.raises(ValueError, match="has no config.json"):
        load_draft(out)
    train(_cfg(tiny, out, steps=4, save_every=2, resume=True))
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name]
    load_draft(out)


def test_resume_with_more_steps_extends_a_finished_run(tiny, tmp_path):
    train(_cfg(tiny, tmp_path / "d", steps=4, save_every=2))
    more = train(_cfg(tiny, tmp_path / "d", steps=7, save_every=2, resume=True))
    assert [h[0] for h in more["history"]] == list(range(1, 8))
    assert json.loads((tmp_path / "d" / "checkpoint" / "state.json").read_text())["step"] == 7


def test_output_is_a_zlab_drafter(tiny, tmp_path):
    train(_cfg(tiny, tmp_path / "d", steps=5, target_layer_ids=[0, 2, 4]))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2, 4]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6
    assert sorted(p.name for p in (tmp_path / "d").glob("*.safetensors")) == ["model.safetensors"]
    from dflash_mlx import load

    model, draft, tok = load(str(tiny / "target"), draft=str(tmp_path / "d"))
    from dflash_mlx.tiny import greedy_reference

    prompt = [3, 5, 7, 9]
    text_ids = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=20):
        text_ids += r.tokens
    assert text_ids == greedy_reference(model, prompt, 20)


def test_chat_conversations_need_a_template(tiny, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]}) + "\n"
    )
    assert read_prompts(data) == [{"messages": [{"role": "user", "content": "w1 w2"}]}]
    with pytest.raises(ValueError, match="no chat template"):
        train(_cfg(tiny, tmp_path / "d", data=str(data)))
    assert not (tmp_path / "d").exists()


# -- errors a user can cause -----------------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("\n\n", "holds no prompts"),
        ('{"prompt": "w1"}\n{"prompt": "w2",\n', "line 2 is not valid JSON"),
        ('{"prompt": "w1"}\n{"text": 3}\n', "line 2 has no prompt"),
    ],
)
def test_bad_data(tiny, tmp_path, content, message):
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_text(content)
    with pytest.raises(ValueError, match=message):
        train(_cfg(tiny, tmp_path / "d", data=str(data)))
    assert not (tmp_path / "d").exists()  # nothing left behind


def test_out_exists_without_resume(tiny, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("")
    with pytest.raises(ValueError, match="already exists; pass --resume"):
        train(_cfg(tiny, tmp_path / "d"))


def test_resume_with_other_shape(tiny, tmp_path):
    train(_cfg(tiny, tmp_path / "d", steps=2, min_block_size=3, val_fraction=0.1))
    with pytest.raises(ValueError, match="--block-size is 4 but"):
        train(_cfg(tiny, tmp_path / "d", block_size=4, resume=True))
    with pytest.raises(ValueError, match="--val-fraction is 0.3 but"):
        train(_cfg(tiny, tmp_path / "d", val_fraction=0.3, resume=True))
    with pytest.raises(ValueError, match="--min-block-size is 2 but"):
        train(_cfg(tiny, tmp_path / "d", min_block_size=2, resume=True))
    # not given: the run's own values are kept
    cfg = _cfg(tiny, tmp_path / "d", steps=3, resume=True)
    given = repr(cfg)
    more = train(cfg)
    assert repr(cfg) == given  # the run's values go to train_args.json, not into the caller's config
    args = json.loads((tmp_path / "d" / "train_args.json").read_text())
    assert (args["min_block_size"], args["val_fraction"]) == (3, 0.1)
    assert more["held_out_sequences"] == round(0.1 * (more["sequences"] + more["held_out_sequences"]))


def test_bad_flags(tiny, tmp_path):
    with pytest.raises(ValueError, match="--block-size must be at least 2"):
        train(_cfg(tiny, tmp_path / "d", block_size=1))
    with pytest.raises(ValueError, match="and at most 256, got 1000"):  # a drafter load() would refuse
        train(_cfg(tiny, tmp_path / "d", block_size=1000))
    assert not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match=r"--target-layer-ids \[9\] do not exist"):
        train(_cfg(tiny, tmp_path / "e", target_layer_ids=[9]))
    assert not (tmp_path / "e").exists()
    with pytest.raises(ValueError, match="no config.json"):
        train(_cfg(tiny, tmp_path / "f", model=str(tmp_path)))
    with pytest.raises(ValueError, match="--min-block-size must be between 2 and --block-size"):
        train(_cfg(tiny, tmp_path / "g", min_block_size=9))
    with pytest.raises(ValueError, match=r"--val-fraction must be in \[0, 0.5\)"):
        train(_cfg(tiny, tmp_path / "h", val_fraction=0.7))
    assert not (tmp_path / "g").exists() and not (tmp_path / "h").exists()


def test_command_prints_one_red_sentence(tiny, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli.app import app

    result = CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            str(tiny / "target"),
            "--data",
            str(tmp_path / "none.jsonl"),
            "--out",
            str(tmp_path / "d"),
        ],
    )
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and "does not exist" in result.stderr
    assert "Traceback" not in result.output


def test_command_trains_with_every_flag(tiny, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli.app import app

    out = tmp_path / "d"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            str(tiny / "target"),
            "--data",
            str(tiny / "data.jsonl"),
            "--out",
            str(out),
            "--block-size",
            "6",
            "--min-block-size",
            "3",
            "--draft-layers",
            "1",
            "--target-layer-ids",
            "1,3",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--blocks-per-seq",
            "4",
            "--lr",
            "1e-3",
            "--seq-len",
            "32",
            "--val-fraction",
            "0.1",
            "--gen-batch",
            "16",
            "--save-every",
            "3",
            "--seed",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "held out" in result.output and "drafter saved to" in result.output
    args = json.loads((out / "train_args.json").read_text())
    assert (args["min_block_size"], args["val_fraction"], args["gen_batch"], args["block_size"]) == (3, 0.1, 16, 6)
    assert load_draft(out).config.block_size == 6


# -- the built-in pair trained with this trainer ------------------------------------------


def test_builtin_pair_is_lossless():
    from dflash_mlx import builtin

    assert builtin.available(), "the built-in weights ship with the package"
    from dflash_mlx import load
    from dflash_mlx.tiny import greedy_reference

    model, draft, tok = load(str(builtin.TARGET), draft=str(builtin.DRAFT))
    assert draft.config.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    prompt = tok.encode('def read_config(path):\n    """Return the parsed JSON file at path."""\n')
    got = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=24):
        got += r.tokens
    assert got == greedy_reference(model, prompt, 24, set(tok.eos_token_ids))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Write the Python function `def add(a, b)`."}], add_generation_prompt=True
    )
    assert tok.decode(chat).endswith("<|im_start|>assistant\n")
