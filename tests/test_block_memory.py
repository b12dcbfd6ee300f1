"""block_memory.py: what `auto` learned in one process, the next one starts from."""

import json
import random

import mlx.core as mx
from tiny import draft_config, make_draft, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import stream_generate
from dflash_mlx.auto import memory as block_memory
from dflash_mlx.auto.chooser import BlockChooser, forget
from dflash_mlx.targets import adapt

# a chooser that knows nothing: hi, lo, the middle, plain
PROBES = [b for b in (16, 4, 8, 1) for _ in range(BlockChooser.PROBE_RUN)]


def new_process(draft):
    """What a fresh process has of ``draft``'s chooser: nothing in memory."""
    forget(draft)
    return draft


def memory_files():
    return sorted((block_memory.home() / "auto").glob("*.json"))


def blocks(responses) -> list[int]:
    return [r.block_size for r in responses[1:]]


def probed(responses) -> bool:
    """Whether the reply's first cycles are a knowing-nothing chooser's probes."""
    first = blocks(responses)[: len(PROBES)]
    assert len(first) >= 4
    return first == PROBES[: len(first)]


def test_a_new_process_starts_from_what_the_last_one_learned(agreeing_pair):
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    first = list(stream_generate(model, new_process(draft), tok, [1, 2, 3], max_tokens=120, block_size="auto"))
    assert probed(first)
    [path] = memory_files()
    saved = json.loads(path.read_text())
    assert saved["range"] == [4, 16] and saved["drafted"] == len(first) - 1 - blocks(first).count(1)

    second = list(stream_generate(model, new_process(draft), tok, [1, 2, 3], max_tokens=120, block_size="auto"))
    # the same text (the block never changes it), with no second round of probes
    assert [t for r in second for t in r.tokens] == [t for r in first for t in r.tokens]
    assert not probed(second)
    assert memory_files() == [path]


def test_memory_off_learns_afresh_and_writes_nothing(agreeing_pair, monkeypatch):
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    list(stream_generate(model, new_process(draft), tok, [1, 2, 3], max_tokens=120, block_size="auto"))
    assert len(memory_files()) == 1
    monkeypatch.setenv("DFLASH_MLX_AUTO_MEMORY", "0")
    for f in memory_files():
        f.unlink()
    again = list(stream_generate(model, new_process(draft), tok, [1, 2, 3], max_tokens=120, block_size="auto"))
    assert probed(again)
    assert memory_files() == []


def test_a_fixed_block_neither_reads_nor_writes_memory(agreeing_pair):
    model, draft = agreeing_pair
    list(stream_generate(model, new_process(draft), make_tokenizer(24), [1, 2], max_tokens=40, block_size=8))
    assert memory_files() == []


def learned_plain_wins() -> BlockChooser:
    """A chooser that saw drafts rarely accepted and blocks cost ten plain steps (a CPU)."""
    chooser, rng = BlockChooser(4, 16), random.Random(0)
    for _ in range(200):
        b = chooser.choose()
        accepted = 0
        while accepted < b - 1 and rng.random() < 0.3:
            accepted += 1
        chooser.record(b, accepted, 0.001 if b == 1 else 0.008 + 0.0005 * b)
    assert chooser.choose() == 1
    return chooser


def test_restored_plain_steps_win_from_the_first_cycle():
    state = json.loads(json.dumps(learned_plain_wins().state()))  # as the file holds it
    restored = BlockChooser(4, 16)
    assert restored.restore(state, block_memory.PRIOR_CYCLES)
    assert restored.cycles == 0 and restored.choose() == 1
    assert restored.reached == state["reached"] and restored.hit == state["hit"]
    # long memories weigh at most PRIOR_CYCLES cycles, and keep their ratios
    long = {**state, "reached": [r * 100 for r in state["reached"]], "hit": [h * 100 for h in state["hit"]]}
    restored = BlockChooser(4, 16)
    assert restored.restore(long, block_memory.PRIOR_CYCLES)
    assert restored.reached[1] == block_memory.PRIOR_CYCLES
    assert restored.hit[2] / restored.reached[2] == state["hit"][2] / state["reached"][2]
    assert BlockChooser(4, 16).choose() == 16  # one that knows nothing probes the longest block first


def test_new_times_outvote_remembered_ones():
    restored = BlockChooser(4, 16)
    restored.restore(learned_plain_wins().state(), block_memory.PRIOR_CYCLES)
    for b in (16, 4, 8, 12, 1):  # this machine turns out to be a GPU: every block costs what a plain step does
        # (a run: its first cycle, a change of size, and the size's first
        # cycles in this process, warming up, are not timed)
        for _ in range(1 + BlockChooser.WARM_CYCLES + 2):
            restored.record(b, 0, 0.001)
    assert restored._median_times()[16] == 0.001
    assert restored._best()[0] != 1


def test_a_remembered_time_not_measured_again_is_forgotten_after_a_few_processes():
    """A time taken while the machine was busy can make a size look too dear
    to explore; were it written back unmeasured by every process, that size
    would never run again. Its age grows each process it is not measured,
    and past MEMORY_AGE it is left out, so the next process probes it."""
    state = learned_plain_wins().state()
    assert set(state["ages"].values()) == {0}  # all measured by the process that wrote them
    state["seconds"]["16"] = 10.0  # a size measured once at a bad moment: never explored again
    for process in range(1, BlockChooser.MEMORY_AGE + 2):
        chooser = BlockChooser(4, 16)
        assert chooser.restore(json.loads(json.dumps(state)), block_memory.PRIOR_CYCLES)
        assert chooser.choose() == 1  # plain steps: nothing probed, nothing explored at 16
        for _ in range(1 + BlockChooser.WARM_CYCLES + 1):  # (a change of size, then warming up: untimed)
            chooser.record(1, 0, 0.001)
        state = chooser.state()
        assert state["ages"]["1"] == 0  # measured again: young
        if process <= BlockChooser.MEMORY_AGE:
            assert state["ages"]["16"] == process and state["seconds"]["16"] == 10.0
    assert "16" not in state["seconds"] and "16" not in state["ages"]
    fresh = BlockChooser(4, 16)
    assert fresh.restore(state, block_memory.PRIOR_CYCLES)
    assert fresh.choose() == 16  # probed again: its time is measured anew


def test_a_state_that_does_not_fit_changes_nothing():
    state = learned_plain_wins().state()
    for broken in (
        {**state, "range": [4, 8]},
        {**state, "reached": state["reached"][:3]},
        {**state, "seconds": {"7": 0.01}},
        {**state, "seconds": {"16": -1}},
        {**state, "hit": [r + 1 for r in state["reached"]]},
        {"range": [4, 16]},
        {**state, "reached": "x"},
        {**state, "ages": {"16": -1}},
        {**state, "ages": {"16": "old"}},
    ):
        chooser = BlockChooser(4, 16)
        assert not chooser.restore(broken, block_memory.PRIOR_CYCLES)
        assert chooser.times == {} and chooser.reached == [0] * 16 and chooser.choose() == 16


def test_a_damaged_file_is_ignored_then_written_afresh(agreeing_pair):
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    list(stream_generate(model, new_process(draft), tok, [5, 6], max_tokens=120, block_size="auto"))
    [path] = memory_files()
    for damage in ("{not json", json.dumps({"version": 999}), json.dumps([1, 2]), ""):
        path.write_text(damage)
        responses = list(stream_generate(model, new_process(draft), tok, [5, 6], max_tokens=120, block_size="auto"))
        assert probed(responses)  # started knowing nothing
        assert json.loads(path.read_text())["version"] == block_memory.VERSION
    assert not list(path.parent.glob("*.tmp"))  # nothing half-written left behind


def test_an_unwritable_home_is_no_error(agreeing_pair, monkeypatch, tmp_path):
    model, draft = agreeing_pair
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DFLASH_MLX_HOME", str(blocker))  # a file where the folder should be
    responses = list(
        stream_generate(model, new_process(draft), make_tokenizer(24), [1, 2], max_tokens=40, block_size="auto")
    )
    assert sum(len(r.tokens) for r in responses) == 40


def test_keys_tell_pairs_ranges_and_weights_apart(agreeing_pair):
    model, draft = agreeing_pair
    target = adapt(model)
    key = block_memory.fingerprint(target, draft, 4, 16)
    assert key == block_memory.fingerprint(target, draft, 4, 16)
    assert key != block_memory.fingerprint(target, draft, 2, 5)
    assert key != block_memory.fingerprint(target, draft, 4, 16, trees=True)  # rows, not blocks
    dcfg = draft_config(target_config("qwen3", vocab=24, layers=5), layers=2, block_size=16, taps=[0, 3])
    other = make_draft(dcfg, random_draft_weights(dcfg, seed=23))  # same shapes, other weights
    assert key != block_memory.fingerprint(target, other, 4, 16)
    mx.eval(other.parameters())
