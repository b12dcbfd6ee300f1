"""benchmarks/verify_rounding.py: the probe that compares a verify's pieces
with mlx-lm's one-row steps finds nothing on the CPU, where both are the same
arithmetic, finds a difference planted in the verify alone where it is, and
on a stand-in GPU names the kernel that rounds otherwise by switching each off.
Its ``--prefill`` mode does the same for our prefill's last id, read alone,
and a plain step."""

from __future__ import annotations

import contextlib
import json
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from repo_files import repo_module
from tiny import greedy_reference, make_target, target_config

from dflash_mlx.kernels import dispatch, ops_attention
from dflash_mlx.kernels import exact_products as ep

PROMPT = [(7 * i) % 61 + 1 for i in range(40)]
ROWS, COMMITTED = 6, 2


def load_probe():
    return repo_module("benchmarks/verify_rounding.py", register=True)  # (its dataclasses look their module up)


vr = load_probe()


@pytest.fixture(scope="module")
def model():
    return make_target(target_config("qwen3", vocab=64, layers=3), seed=5)


@contextlib.contextmanager
def nudged_o_proj(target, layer: int = 1):
    """Layer ``layer``'s o_proj weight moved a little, for the verify only."""
    o_proj = target.inner.layers[layer].self_attn.o_proj
    weight = o_proj.weight
    o_proj.weight = weight + 1e-3 * mx.random.normal(weight.shape, key=mx.random.key(3)).astype(weight.dtype)
    try:
        yield
    finally:
        o_proj.weight = weight


def test_every_piece_of_the_verify_equals_the_one_row_steps_on_the_cpu(model):
    report = vr.probe(model, PROMPT, committed=COMMITTED, rows=ROWS)
    runs = {r.name: r for r in report["runs"]}
    # the fused layers are switched to mlx-lm's own, and then everything of ours
    assert list(runs) == [
        "verify",
        "each from mlx-lm's input",
        "verify again, vs verify",
        "own history",
        "compiled",
        "mlx-lm's layers",
        "all of ours off",
    ]
    verify = runs["verify"]
    # every piece of every layer was seen, and the replay reproduced each layer's output
    assert set(verify.diffs) == {(i, p) for i in range(3) for p in vr.LAYER_PIECES} | {
        ("model", p) for p in vr.MODEL_PIECES
    }
    assert verify.replay == "3/3"
    assert all(d.rows == 0 and d.worst == 0 for d in report["history"].values())
    for run in runs.values():
        assert run.first is None, (run.name, run.first)
        assert run.argmax_equal == ROWS
        assert all(d.rows == 0 for d in run.diffs.values())
    assert runs["compiled"].diffs.keys() >= {(2, "out"), (2, "k rope"), (2, "v"), ("model", "logits")}
    # the verified tokens are mlx-lm's own greedy ones after the committed
    assert report["tokens"] == greedy_reference(model, PROMPT, COMMITTED + ROWS)[COMMITTED:]


def test_a_difference_planted_in_the_verify_is_found_where_it_is(model):
    report = vr.probe(model, PROMPT, committed=COMMITTED, rows=ROWS, variants=False, plant=nudged_o_proj)
    runs = {r.name: r for r in report["runs"]}
    verify = runs["verify"]
    assert verify.first == (1, "o_proj")
    keys = list(verify.diffs)
    before = keys[: keys.index((1, "o_proj"))]
    assert before and all(verify.diffs[k].rows == 0 for k in before)
    assert verify.diffs[(1, "o_proj")].rows == ROWS and verify.diffs[(1, "o_proj")].worst > 0
    assert verify.diffs[(1, "out")].rows == ROWS and verify.diffs[("model", "logits")].rows == ROWS
    assert verify.replay == "3/3"  # the replay saw the planted weight too
    # given mlx-lm's inputs, only the planted product (and the residual it feeds) parts
    alone = runs["each from mlx-lm's input"]
    assert {k for k, d in alone.diffs.items() if d.rows} == {(1, "o_proj"), (1, "h+attn")}
    assert len(alone.diffs) == len(verify.diffs)
    # the prefill and the committed block are not the verify: untouched
    assert all(d.rows == 0 for d in report["history"].values())
    assert runs["own history"].first == (1, "o_proj")
    assert runs["compiled"].first == (1, "out")  # what a compiled verify shows of it
    assert runs["verify again, vs verify"].first is None  # the planted change is deterministic


def test_the_command_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rounding.json"
    argv = ["verify_rounding.py", "--shape", "small", "--prompt-tokens", "24", "--committed", "1", "--rows", "4"]
    monkeypatch.setattr(sys, "argv", argv + ["--no-variants", "--json", str(out)])
    vr.main()
    text = capsys.readouterr().out
    assert "verify over mlx-lm's cache" in text and "from mlx-lm's inputs" in text
    assert "first difference: none (the replay reproduced 8/8 layers' outputs)" in text
    # two tables (the verify, each piece alone) of 8 layers, every cell 0
    table = [line.split() for line in text.splitlines() if line.split()[:1] in ([str(i)] for i in range(8))]
    assert len(table) == 16 and all(cells[1:] == ["0"] * len(vr.LAYER_PIECES) for cells in table)
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == [
        "verify",
        "each from mlx-lm's input",
        "verify again, vs verify",
        "own history",
        "compiled",
    ]
    assert all(r["first_difference"] is None for r in report["runs"])
    assert report["runs"][0]["pieces"]["7/down"] == {"rows": 0, "max_abs": 0.0}


class LoneRowNudge(nn.Module):
    """``inner``, its output moved a little for a one-row input alone: a piece
    of a prefill's last id (and a plain step) that rounds otherwise, its chunks not."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x):
        y = self.inner(x)
        return y * (1 + 2**-6) if x.size // x.shape[-1] == 1 else y


@contextlib.contextmanager
def nudged_lone_row_o_proj(target, layer: int = 1):
    attn = target.inner.layers[layer].self_attn
    own = attn.o_proj
    attn.o_proj = LoneRowNudge(own)
    try:
        yield
    finally:
        attn.o_proj = own


def test_every_piece_of_our_prefill_and_plain_step_equals_mlx_lm_on_the_cpu(model):
    report = vr.probe_prefill(model, PROMPT, committed=COMMITTED, step=16, chunks=True)
    runs = {r.name: r for r in report["runs"]}
    assert list(runs) == [
        vr.LAST_ID,
        vr.ISOLATED,
        "last id again, vs last id",
        vr.EXACT_READ,
        "own chunks, last id",
        vr.CHUNKS,
        vr.PLAIN,
        vr.PLAIN_ISOLATED,
        "plain step, device length",
        "plain step, compiled",
        "last id, mlx-lm's layers",
        "last id, all of ours off",
    ]
    every = {(i, p) for i in range(3) for p in vr.LAYER_PIECES}
    assert set(runs[vr.LAST_ID].diffs) == every | {("model", p) for p in vr.MODEL_PIECES}
    # a chunk's logits are its last row's on our side: not compared
    assert set(runs[vr.CHUNKS].diffs) == every | {("model", "final norm")}
    assert runs[vr.CHUNKS].rows == len(PROMPT) - 1 and runs[vr.CHUNKS].argmax_equal is None
    assert runs[vr.LAST_ID].rows == runs[vr.PLAIN].rows == 1
    for run in runs.values():
        assert run.first is None, (run.name, run.first)
        assert all(d.rows == 0 for d in run.diffs.values())
    assert all(d.rows == 0 for d in report["history"].values())
    assert runs[vr.LAST_ID].replay == runs[vr.PLAIN].replay == runs[vr.CHUNKS].replay == "3/3"
    # mlx-lm's one-row calls read without a mask; so do ours at a length a plain step's
    masks = report["masks"]
    assert {m["mlx-lm"] for m in masks.values()} == {"none"}
    assert masks[vr.EXACT_READ]["ours"] == masks[vr.PLAIN]["ours"] == "none"
    assert report["last"] == len(PROMPT) - 1 and report["step_at"] == len(PROMPT) + COMMITTED
    assert report["token"] == greedy_reference(model, PROMPT, COMMITTED + 1)[COMMITTED]


def test_a_difference_planted_in_the_prefills_lone_row_is_found_where_it_is(model):
    report = vr.probe_prefill(
        model, PROMPT, committed=COMMITTED, step=16, chunks=True, variants=False, plant=nudged_lone_row_o_proj
    )
    runs = {r.name: r for r in report["runs"]}
    last = runs[vr.LAST_ID]
    assert last.first == (1, "o_proj")
    keys = list(last.diffs)
    before = keys[: keys.index((1, "o_proj"))]
    assert before and all(last.diffs[k].rows == 0 for k in before)
    assert last.diffs[(1, "o_proj")].rows == 1 and last.diffs[(1, "o_proj")].worst > 0
    assert last.diffs[(2, "out")].rows == 1 and last.diffs[("model", "logits")].rows == 1
    assert last.replay == "3/3"  # the replay saw the planted module too
    # given mlx-lm's inputs, only the planted product (and the residual it feeds) parts
    assert {k for k, d in runs[vr.ISOLATED].diffs.items() if d.rows} == {(1, "o_proj"), (1, "h+attn")}
    for name in (vr.EXACT_READ, "own chunks, last id", vr.PLAIN, "plain step, device length"):
        assert runs[name].first == (1, "o_proj"), name
    assert runs["plain step, compiled"].first == (1, "out")  # what a compiled step shows of it
    assert runs["last id again, vs last id"].first is None  # the planted change is deterministic
    # the chunks' rows are not one row: untouched, and so is the cache they wrote
    assert runs[vr.CHUNKS].first is None
    assert all(d.rows == 0 for d in report["history"].values())


def test_a_lone_row_parting_behind_a_mask_is_told_from_one_read_as_a_plain_step(model, monkeypatch):
    """A stand-in for a GPU whose MLX attention rounds a row otherwise behind
    an array mask than without one (CUDA's is then not one fused kernel): the
    mode names layer 0's attention wherever our last id's mask is an array,
    and the same row read as a plain step (no mask) agrees."""
    from dflash_mlx.layers import attention

    plain = attention.scaled_dot_product_attention

    def behind_a_mask(q, k, v, *, mask=None, **kw):
        out = plain(q, k, v, mask=mask, **kw)
        return out * (1 + 2**-6) if isinstance(mask, mx.array) and q.shape[2] == 1 else out

    monkeypatch.setattr(attention, "scaled_dot_product_attention", behind_a_mask)
    report = vr.probe_prefill(model, PROMPT, committed=COMMITTED, step=16, variants=False)
    runs = {r.name: r for r in report["runs"]}
    masked = report["masks"][vr.LAST_ID]["ours"].startswith("array")
    assert runs[vr.LAST_ID].first == ((0, "attention") if masked else None)
    assert runs["own chunks, last id"].first == runs[vr.LAST_ID].first
    alone = {k for k, d in runs[vr.ISOLATED].diffs.items() if d.rows}
    assert alone == ({(i, "attention") for i in range(3)} if masked else set())
    assert runs[vr.EXACT_READ].first is None and runs[vr.PLAIN].first is None


def test_the_prefill_command_prints_its_tables_and_writes_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "prefill.json"
    argv = ["verify_rounding.py", "--shape", "small", "--prompt-tokens", "24", "--committed", "1", "--prefill"]
    monkeypatch.setattr(sys, "argv", argv + ["--prefill-step", "8", "--no-variants", "--json", str(out)])
    vr.main()
    text = capsys.readouterr().out
    assert "the prompt's last id (position 23) read alone" in text and "a plain step" in text
    assert "first difference: none (the replay reproduced 8/8 layers' outputs)" in text
    # four tables (the last id, its pieces alone, the plain step, its pieces alone) of 8 layers, every cell 0
    table = [line.split() for line in text.splitlines() if line.split()[:1] in ([str(i)] for i in range(8))]
    assert len(table) == 32 and all(cells[1:] == ["0"] * len(vr.LAYER_PIECES) for cells in table)
    report = json.loads(out.read_text())
    assert report["mode"] == "prefill" and report["masks"][vr.PLAIN]["mlx-lm"] == "none"
    assert [r["name"] for r in report["runs"]][:2] == [vr.LAST_ID, vr.ISOLATED]
    assert all(r["first_difference"] is None for r in report["runs"])
    assert report["runs"][0]["pieces"]["7/down"] == {"rows": 0, "max_abs": 0.0}


def test_bad_prefill_sizes_end_in_one_sentence(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["verify_rounding.py", "--prefill", "--prompt-tokens", "1"])
    with pytest.raises(SystemExit) as e:
        vr.main()
    assert (
        str(e.value)
        == "verify_rounding.py: pass --prompt-tokens of at least 2 and --committed of 0 or more with --prefill."
    )


def test_bad_sizes_end_in_one_sentence(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["verify_rounding.py", "--rows", "1"])
    with pytest.raises(SystemExit) as e:
        vr.main()
    assert str(e.value) == (
        "verify_rounding.py: pass --prompt-tokens of at least 1, --committed of 0 or more and --rows of at least 2."
    )


class NudgedAttention:
    """A stand-in GPU's attention kernel within its check's tolerance but not
    bit for bit MLX's: what a verify's attention may be on a GPU."""

    def __call__(self, q, k, v, tree=None, **kw):
        return ops_attention(q, k, v, **kw) * (1 + 2**-12)


class ExactProduct:
    """A stand-in GPU's exact product: each row as MLX's one-row product."""

    def __call__(self, x, weight, bias, *, form=0):
        *lead, k = x.shape
        return ep.one_row_products(x.reshape(-1, k), weight, bias).reshape(*lead, -1)


@pytest.fixture
def pretend_gpu(monkeypatch):
    """The attention kernel and the exact products as on a GPU backend named 'fake'."""
    dispatch.reset()
    ep.reset()
    monkeypatch.setattr(dispatch, "backend", lambda: "fake")
    monkeypatch.setitem(dispatch.BUILDERS, "fake", lambda where: NudgedAttention())
    monkeypatch.setattr(dispatch, "KERNEL_WINS", ((64, 0),))
    monkeypatch.setattr(ep, "backend", lambda: "fake")
    monkeypatch.setitem(ep.BUILDERS, "fake", lambda where: ExactProduct())
    yield
    dispatch.reset()
    ep.reset()


def test_switching_each_kernel_off_in_turn_names_the_one_that_rounds_otherwise(pretend_gpu):
    model = make_target(target_config("qwen3", vocab=64, layers=2, hidden=256), seed=8)  # head dim 64: a kernel's
    report = vr.probe(model, PROMPT, committed=COMMITTED, rows=ROWS)
    assert report["served"]["q/k/v"] == "fused exact" and report["served"]["attention"] == "kernel"
    runs = {r.name: r for r in report["runs"]}
    assert list(runs) == [
        "verify",
        "each from mlx-lm's input",
        "verify again, vs verify",
        "own history",
        "compiled",
        "mlx-lm's layers",
        "attention kernel off",
        "exact products off",
        "all of ours off",
    ]
    # the products before it are exact; the attention is the first piece to part
    assert runs["verify"].first == (0, "attention") and runs["verify"].replay == "2/2"
    # (the attention kernel was put back after its own run)
    assert runs["exact products off"].first == (0, "attention")
    assert runs["compiled"].first == (0, "out")
    # given mlx-lm's inputs, each layer's attention parts, and nothing else
    alone = runs["each from mlx-lm's input"]
    assert {k for k, d in alone.diffs.items() if d.rows} == {(0, "attention"), (1, "attention")}
    for name in ("attention kernel off", "mlx-lm's layers", "all of ours off"):
        assert runs[name].first is None, name
    # our committed block went through the kernel too: layer 1's keys of it differ
    history = report["history"]
    assert history[(0, "k")].rows == 0 and history[(1, "k")].rows == COMMITTED
    assert runs["own history"].first == (0, "attention")
