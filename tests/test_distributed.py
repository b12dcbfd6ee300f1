"""DFlash across ranks: ``mlx.launch --backend ring`` runs 2 or 3 MLX
processes over loopback on this CPU, the target split by mlx-lm (tensor
parallel for qwen3, a pipeline for qwen3_moe); every rank's tokens must equal
one process's, which equal mlx-lm's greedy decoding.

Run as a script, this file is one rank: it loads the pair split over the
group and writes the tokens it generated to ``<out>/rank<r>.json``."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

PROMPT = [3, 17, 5, 9, 20, 11, 4]
MAX_TOKENS = 14
BLOCKS = [2, 5]
SEED = 7
TEMP = 0.8
VOCAB = 24
TARGET_SEED = 21
# One shared direction in the embeddings: greedy replies that vary, and
# for qwen3 cycles whose random drafter is right part of the time.
LEAN = {
    "qwen3": 0.36,
    "qwen3_moe": 0.6,
    "deepseek_v3": 0.5,
    "gemma3_text": 0.5,
    "gemma4_text": 0.5,
    "gemma4": 0.5,
    "gpt_oss": 0.5,
    "minimax_m2": 0.5,
    "glm4_moe": 0.5,
    "qwen3_5": 0.5,
    "qwen3_next": 0.5,
}
# Qwen3-Next's own interval (an attention layer in four): 2 ranks of a 4-layer
# target give rank 1 delta-net layers alone, a stage with no attention mask.
EXTRA = {"qwen3_next": {"full_attention_interval": 4}}


def tokens(model, draft, tokenizer, **settings) -> list[int]:
    from dflash_mlx import stream_generate

    responses = stream_generate(model, draft, tokenizer, PROMPT, max_tokens=MAX_TOKENS, **settings)
    return [t for r in responses for t in r.tokens]


def runs(model, draft, tokenizer, hybrid: bool = False) -> dict:
    """Greedy tokens at each block size, a seeded sampled run, and two turns
    through one prompt cache; ``hybrid``: also greedy draft trees, and a
    third turn editing the prompt early, whose delta-net states no write
    kept: every stage re-reads them from a checkpoint."""
    from dflash_mlx import make_prompt_cache, stream_generate

    out = {str(b): tokens(model, draft, tokenizer, block_size=b) for b in BLOCKS}
    out["auto"] = tokens(model, draft, tokenizer)  # every rank runs rank 0's choices
    out["sampled"] = tokens(model, draft, tokenizer, block_size=4, temperature=TEMP, seed=SEED)
    cache, prompt, turns = make_prompt_cache(model, draft), PROMPT, []
    for _ in range(2):
        responses = stream_generate(model, draft, tokenizer, prompt, max_tokens=6, block_size=3, prompt_cache=cache)
        turns.append([t for r in responses for t in r.tokens])
        prompt = prompt + turns[-1] + [5, 9]
    out["turns"] = turns
    if hybrid:
        out["trees"] = tokens(model, draft, tokenizer, tree_budget=6)
        edited = PROMPT[:3] + [8] + PROMPT[4:]
        responses = stream_generate(model, draft, tokenizer, edited, max_tokens=6, block_size=3, prompt_cache=cache)
        out["edited"] = [[t for r in responses for t in r.tokens], cache.consistent()]
    return out


def rank_main(target: str, draft: str, split: str, out: str, hybrid: bool = False) -> None:
    from dflash_mlx.loading import load

    group = mx.distributed.init()
    try:
        model, drafter, tokenizer = load(target, draft, group=group, split=split, dtype="float32")
        result = {**runs(model, drafter, tokenizer, hybrid), "here": list(drafter.target.here)}
    except ValueError as e:
        result = {"error": str(e)}
    (Path(out) / f"rank{group.rank()}.json").write_text(json.dumps(result))


def files_main(target: str, draft: str, split: str, out: str) -> None:
    """Per-rank prompt-cache files: each rank saves its own caches after a
    turn and reads them back for the next; another rank's file is refused."""
    from dflash_mlx import make_prompt_cache, stream_generate
    from dflash_mlx.cache.files import load_prompt_cache, save_prompt_cache
    from dflash_mlx.loading import load

    group = mx.distributed.init()
    rank = group.rank()
    model, drafter, tokenizer = load(target, draft, group=group, split=split, dtype="float32")

    def turn(cache, prompt: list[int]) -> list[int]:
        responses = stream_generate(model, drafter, tokenizer, prompt, max_tokens=6, block_size=3, prompt_cache=cache)
        return [t for r in responses for t in r.tokens]

    cache = make_prompt_cache(model, drafter)
    first = turn(cache, PROMPT)
    save_prompt_cache(Path(out) / f"cache-rank{rank}.safetensors", cache)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))  # every rank's file is written
    loaded, _ = load_prompt_cache(Path(out) / f"cache-rank{rank}.safetensors", model, drafter)
    second = turn(loaded, PROMPT + first + [5, 9])
    try:
        load_prompt_cache(Path(out) / f"cache-rank{(rank + 1) % group.size()}.safetensors", model, drafter)
        other = ""
    except ValueError as e:
        other = str(e)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"turns": [first, second], "other": other}))


def chooser_main(out: str) -> None:
    """Each rank times cycles differently; the agreed chooser's choices must
    still be one sequence, rank 0's own chooser's."""
    from dflash_mlx.auto.chooser import BlockChooser
    from dflash_mlx.distributed import agreed_chooser

    group = mx.distributed.init()
    agreed, alone = agreed_chooser(BlockChooser(2, 8), group), BlockChooser(2, 8)
    picks, own = [], []
    for cycle in range(60):
        for chooser, sequence in ((agreed, picks), (alone, own)):
            b = chooser.choose()
            sequence.append(b)
            slow = 1 + (b if group.rank() == 0 else 9 - b)  # each rank finds other sizes fast
            chooser.record(b, min(b - 1, cycle % 4), slow / 1000)
    (Path(out) / f"rank{group.rank()}.json").write_text(json.dumps({"agreed": picks, "own": own}))


REPLY = 40  # long enough that an interrupt after a few tokens lands mid-reply


def interrupts_main(target: str, draft: str, split: str, out: str) -> None:
    """Rank 1 alone stops a reply, in each way a script can: Ctrl-C in its
    loop over the replies, a ``break``, Ctrl-C while the token loop runs a
    cycle, Ctrl-C during the prefill. After each, every rank generates the
    same prompt again through the same cache."""
    import signal

    from dflash_mlx import make_prompt_cache, stream_generate
    from dflash_mlx.auto.chooser import BlockChooser
    from dflash_mlx.decode.loop import decode
    from dflash_mlx.decode.sampling import SamplingParams
    from dflash_mlx.loading import load
    from dflash_mlx.targets import adapt

    group = mx.distributed.init()
    stops = group.rank() == 1
    model, drafter, tokenizer = load(target, draft, group=group, split=split, dtype="float32")

    def press() -> None:
        signal.raise_signal(signal.SIGINT)  # as Ctrl-C: Python's handler raises KeyboardInterrupt

    class PressingChooser(BlockChooser):
        """Blocks of 3; Ctrl-C on the stopping rank at the third choice, inside the loop."""

        choices = 0

        def choose(self, would_build=None) -> int:
            self.choices += 1
            if stops and self.choices == 3:
                press()
            return 3

    def replies(how: str, cache):
        if how == "in a cycle":
            return decode(
                adapt(model),
                drafter,
                cache,
                PROMPT,
                max_tokens=REPLY,
                sampling=SamplingParams(),
                seed=0,
                block=PressingChooser(2, 3),
                eos=set(),
            )
        progress = (lambda done, total: press() if stops and done == 2 else None) if how == "in the prefill" else None
        return stream_generate(
            model,
            drafter,
            tokenizer,
            PROMPT,
            max_tokens=REPLY,
            block_size=3,
            prompt_cache=cache,
            prefill_step_size=2,
            prompt_progress=progress,
        )

    results = {}
    for how in ("in its loop", "by break", "in a cycle", "in the prefill"):
        cache, seen, interrupted = make_prompt_cache(model, drafter), [], False
        try:
            for response in replies(how, cache):
                seen += response.tokens
                if stops and len(seen) >= 4 and how == "in its loop":
                    press()
                if stops and len(seen) >= 4 and how == "by break":
                    break
        except KeyboardInterrupt:
            interrupted = True
        kept, consistent = list(cache.tokens), cache.consistent()
        again = [
            t
            for r in stream_generate(
                model, drafter, tokenizer, PROMPT, max_tokens=REPLY, block_size=3, prompt_cache=cache
            )
            for t in r.tokens
        ]
        results[how] = {
            "seen": seen,
            "interrupted": interrupted,
            "kept": kept,
            "consistent": consistent,
            "again": again,
        }
    (Path(out) / f"rank{group.rank()}.json").write_text(json.dumps(results))


def share_main(out: str) -> None:
    """Rank 0's objects, in order, on every rank: None too (serve's stop)."""
    from dflash_mlx.distributed import share_from_first_rank

    group = mx.distributed.init()
    sent = [{"prompt": PROMPT, "stops": ["w5"], "tools": None}, None, "\u00e9" * 5000, list(range(300))]
    got = [share_from_first_rank(obj if group.rank() == 0 else None, group) for obj in sent]
    (Path(out) / f"rank{group.rank()}.json").write_text(json.dumps({"sent": sent, "got": got}))


if __name__ == "__main__":
    modes = {
        "runs": rank_main,
        "hybrid": lambda *args: rank_main(*args, hybrid=True),
        "files": files_main,
        "chooser": chooser_main,
        "interrupts": interrupts_main,
        "share": share_main,
    }
    modes[sys.argv[1]](*sys.argv[2:])
    sys.exit(0)


from family_models import family_config, make_family_target  # noqa: E402
from tiny import (  # noqa: E402
    draft_config,
    greedy_reference,
    lean_towards_one_token,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
    write_target,
    write_zlab_draft,
)

LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
pytestmark = pytest.mark.skipif(not Path(LAUNCH).is_file(), reason="mlx.launch (MLX's launcher) is not installed")


def write_pair(
    root: Path, family: str, layers: int, draft_seed: int = 22, lean: bool = True
) -> tuple[Path, Path, object]:
    """A tiny target of ``family`` (its weights indexed, as a pipelined load
    reads them; ``lean``: towards one token, so drafts are accepted) and a
    drafter tapping two of its layers; returns the directories and the target."""
    if family == "qwen3":
        cfg = target_config("qwen3", vocab=VOCAB, layers=layers, hidden=64)
        model = make_target(cfg, seed=TARGET_SEED)
    else:
        cfg = family_config(family, vocab=VOCAB, layers=layers, hidden=64, **EXTRA.get(family, {}))
        model = make_family_target(cfg, seed=TARGET_SEED)
    if lean:
        lean_towards_one_token(getattr(model, "language_model", model), LEAN[family])
    target = write_target(root / f"{family}-target", cfg, model, make_tokenizer(VOCAB))
    names = mx.load(str(target / "model.safetensors"))
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model.safetensors" for k in names}})
    )
    text = {**cfg["text_config"], "vocab_size": VOCAB} if "text_config" in cfg else cfg
    dcfg = draft_config(text, layers=2, block_size=6, taps=[1, layers - 2])
    draft = write_zlab_draft(root / f"{family}-draft-{draft_seed}", dcfg, random_draft_weights(dcfg, draft_seed))
    return target, draft, model


def launcher(ranks: int) -> list[str]:
    """mlx.launch over loopback, its ports free now: the default ports would
    join another run's ranks started at the same time."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            start = probe.getsockname()[1]
        if start + ranks < 65536 and all(_free(start + k) for k in range(ranks)):
            return [LAUNCH, "--backend", "ring", "-n", str(ranks), "--starting-port", str(start)]


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch(ranks: int, target: Path, drafts: list[Path], split: str, out: Path, mode: str = "runs") -> list[dict]:
    """Each rank's results; ``drafts``: one drafter for all ranks, or one a rank."""
    out.mkdir()
    script = Path(__file__).resolve()
    if len(drafts) == 1:
        command = [sys.executable, str(script), mode, str(target), str(drafts[0]), split, str(out)]
    else:  # a wrapper picks each rank's drafter by its rank
        chooser = out / "rank.sh"
        cases = " ".join(f'{r}) d="{d}";;' for r, d in enumerate(drafts))
        chooser.write_text(
            f'case "$MLX_RANK" in {cases} esac\nexec "{sys.executable}" "{script}" {mode} "{target}" "$d" {split} "{out}"\n'
        )
        command = ["bash", str(chooser)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([*launcher(ranks), *command], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def one_process(target: Path, draft: Path, hybrid: bool = False) -> dict:
    from dflash_mlx.loading import load

    model, drafter, tokenizer = load(target, draft, dtype="float32")
    return runs(model, drafter, tokenizer, hybrid)


HYBRIDS = ("qwen3_5", "qwen3_next")


@pytest.mark.parametrize(
    "family, layers, split, ranks",
    [
        ("qwen3", 4, "tensor", 2),
        ("qwen3_moe", 4, "pipeline", 2),
        ("qwen3_moe", 4, "pipeline", 3),
        ("qwen3", 4, "pipeline", 2),  # mlx-lm's qwen3 has no pipeline(): benchmarks/cycle.py's split
        ("deepseek_v3", 4, "tensor", 2),
        ("deepseek_v3", 4, "pipeline", 2),  # its own MLA layer forwards, over each rank's slice
        # Families whose mlx-lm model has no pipeline(): mlx-lm's split applied here.
        ("gemma3_text", 6, "pipeline", 2),
        ("gemma4_text", 6, "pipeline", 2),  # rank 0 keeps the layers reusing keys/values with their sources
        ("gemma4_text", 6, "pipeline", 3),
        ("gemma4", 6, "pipeline", 2),  # the published checkpoints' multimodal wrapper
        ("gpt_oss", 4, "pipeline", 2),
        ("gpt_oss", 4, "tensor", 2),
        ("minimax_m2", 4, "pipeline", 3),
        ("minimax_m2", 4, "tensor", 2),
        ("glm4_moe", 4, "pipeline", 2),
        # Hybrids: delta-net and attention layers, over each rank's slice with its own caches.
        ("qwen3_5", 4, "pipeline", 2),
        ("qwen3_5", 6, "pipeline", 3),
        ("qwen3_next", 4, "pipeline", 2),
    ],
)
def test_ranks_equal_one_process(tmp_path, family, layers, split, ranks):
    target, draft, model = write_pair(tmp_path, family, layers)
    hybrid = family in HYBRIDS
    alone = one_process(target, draft, hybrid)
    expected = greedy_reference(model, PROMPT, MAX_TOKENS)
    for b in [*BLOCKS, "auto"] + (["trees"] if hybrid else []):
        assert alone[str(b)] == expected, b
    assert alone["sampled"] != expected  # a sampled reply, not the greedy one again
    if hybrid:
        edited = PROMPT[:3] + [8] + PROMPT[4:]
        assert alone["edited"] == [greedy_reference(model, edited, 6), True]
    results = launch(ranks, target, [draft], split, tmp_path / "out", mode="hybrid" if hybrid else "runs")
    for rank, result in enumerate(results):
        assert "error" not in result, result
        assert result.pop("here") == (list(range(layers)) if split == "tensor" else stages(family, layers, ranks)[rank])
        assert result == alone, f"rank {rank} differs from one process"


def stages(family: str, layers: int, ranks: int) -> list[list[int]]:
    """Each rank's layers under a pipeline: mlx-lm's even split, rank 0 the
    last ones, except that rank 0 starts no later than the first layer whose
    keys/values another reuses (Gemma 4's fixture: layers 4, 5 reuse 3, 2)."""
    if family.startswith("gemma4"):
        sizes = {2: [4, 2], 3: [4, 1, 1]}[ranks]
    else:
        sizes = {(4, 2): [2, 2], (4, 3): [2, 1, 1], (6, 2): [3, 3], (6, 3): [2, 2, 2]}[layers, ranks]
    ends = [layers - sum(sizes[:r]) for r in range(ranks)]
    return [list(range(end - size, end)) for end, size in zip(ends, sizes)]


def test_auto_split_pipelines_a_family_that_has_it(tmp_path):
    target, draft, _ = write_pair(tmp_path, "qwen3_moe", 4)
    alone = one_process(target, draft)
    for rank, result in enumerate(launch(2, target, [draft], "auto", tmp_path / "out")):
        assert result.pop("here") == stages("qwen3_moe", 4, 2)[rank]
        assert result == alone


def test_generate_command_prints_once(tmp_path):
    target, draft, _ = write_pair(tmp_path, "qwen3_moe", 4)
    args = ["--model", str(target), "--draft-model", str(draft), "--prompt", "w3 w17 w5", "-m", "10"]
    args += ["--dtype", "float32", "--block-size", "6"]
    command = shutil.which("dflash-mlx") or str(Path(sys.executable).parent / "dflash-mlx")
    alone = subprocess.run([command, "generate", *args], capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    split = subprocess.run(
        [*launcher(2), command, "generate", *args, "--split", "pipeline"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert split.returncode == 0, split.stderr
    assert split.stdout == alone.stdout and len(alone.stdout.split()) == 10
    assert split.stderr.count("generated 10 tokens") == 1


def test_ranks_with_different_drafters_are_refused(tmp_path):
    target, draft, _ = write_pair(tmp_path, "qwen3", 4)
    _, other, _ = write_pair(tmp_path, "qwen3", 4, draft_seed=2)
    for result in launch(2, target, [draft, other], "tensor", tmp_path / "out"):
        assert "drafter weights" in result.get("error", ""), result
        assert "same model and drafter" in result["error"]


def ranks_run(mode: str, out: Path) -> list[dict]:
    """This file run as ``mode`` (no pair) on 2 ranks; each rank's results."""
    out.mkdir()
    script = Path(__file__).resolve()
    env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
    command = [*launcher(2), sys.executable, str(script), mode, str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_auto_chooses_one_block_on_every_rank(tmp_path):
    first, second = ranks_run("chooser", tmp_path / "out")
    assert first["own"] != second["own"]  # alone, the ranks' timings would part them
    assert first["agreed"] == second["agreed"] == first["own"]


def test_auto_split_prefers_mlx_lm_pipeline_then_tensor():
    from dflash_mlx.distributed import choose_split
    from dflash_mlx.targets import ADAPTERS

    def model(family):
        return make_family_target(family_config(family, vocab=VOCAB, layers=2))

    assert choose_split(model("qwen3_moe"), "auto", True) == "pipeline"  # mlx-lm's own pipeline()
    assert choose_split(model("gpt_oss"), "auto", True) == "tensor"  # its shard() over our stage split
    assert choose_split(model("gemma3_text"), "auto", True) == "pipeline"  # no shard(): our stage split
    for family in HYBRIDS:  # mlx-lm's pipeline(), over the hybrid adapters' stages
        assert choose_split(model(family), "auto", ADAPTERS[family].pipelines()) == "pipeline", family
    with pytest.raises(ValueError, match="use split='pipeline'"):
        choose_split(model("gemma3_text"), "tensor", True)


def test_on_cuda_no_split_sends_between_ranks(monkeypatch):
    """MLX's CUDA backend has no send or recv: ``auto`` takes the tensor split
    there, and a pipelined one is refused in one sentence naming the way out."""
    from dflash_mlx import distributed

    monkeypatch.setattr(distributed, "backend", lambda: "cuda")

    def model(family):
        return make_family_target(family_config(family, vocab=VOCAB, layers=2))

    assert distributed.choose_split(model("qwen3_moe"), "auto", True) == "tensor"
    with pytest.raises(ValueError, match="cannot send between ranks.*use split='tensor'"):
        distributed.choose_split(model("qwen3_moe"), "pipeline", True)
    with pytest.raises(ValueError, match="run it on one machine"):
        distributed.choose_split(model("gemma3_text"), "auto", True)


def test_hybrid_stages_each_hold_a_delta_net_layer():
    """A stage without a delta-net layer could not tell when the others
    re-read theirs: refused, on every rank alike, from the config alone."""
    from dflash_mlx.targets.hybrid import check_stages

    args = make_family_target(family_config("qwen3_5", vocab=VOCAB, layers=4)).language_model.args
    check_stages(args, 2)  # layers 0-1 and 2-3: a delta-net layer and an attention layer each
    with pytest.raises(ValueError, match=r"4 layers cannot be pipelined over 3 ranks .* run it on 2 ranks or with"):
        check_stages(args, 3)  # layer 1 alone: attention
    args.full_attention_interval = 4  # layers 0-2 delta-net, 3 attention
    check_stages(args, 3)  # a stage of delta-net layers alone runs
    with pytest.raises(ValueError, match="run it on 3 ranks"):
        check_stages(args, 4)  # layer 3 alone


def test_stages_keep_reused_keys_with_their_source():
    from dflash_mlx.distributed import stage_sizes

    inner = make_family_target(family_config("gemma4_text", vocab=VOCAB, layers=6)).model
    assert [stage_sizes(inner, n) for n in (2, 3)] == [[4, 2], [4, 1, 1]]
    with pytest.raises(ValueError, match="run it on at most 3 ranks"):
        stage_sizes(inner, 4)
    plain = make_family_target(family_config("gpt_oss", vocab=VOCAB, layers=4)).model
    assert stage_sizes(plain, 3) == [2, 1, 1]  # mlx-lm's own split
    with pytest.raises(ValueError, match="4 layers cannot be split over 5 ranks; run it on at most 4 ranks"):
        stage_sizes(plain, 5)


def test_prompt_cache_files_per_rank(tmp_path):
    """Each rank's file holds its own stage's caches: read back on that rank
    it continues the conversation as one process does; another rank, or one
    process, refuses it in one sentence."""
    from dflash_mlx.cache.files import load_prompt_cache
    from dflash_mlx.loading import load

    target, draft, _ = write_pair(tmp_path, "gemma4_text", 6)
    alone = one_process(target, draft)
    results = launch(2, target, [draft], "pipeline", tmp_path / "out", mode="files")
    for result in results:
        assert result["turns"] == alone["turns"]
        assert "made for another model pair" in result["other"], result["other"]
    model, drafter, _ = load(target, draft, dtype="float32")
    with pytest.raises(ValueError, match="made for another model pair"):
        load_prompt_cache(tmp_path / "out" / "cache-rank0.safetensors", model, drafter)


def test_interrupt_on_rank_zero_ends_every_rank(tmp_path):
    """Ctrl-C on rank 0 of `generate`: every rank stops after the same cycle,
    rank 0 says so with its statistics and exits 130, nothing hangs."""
    import signal

    target, draft, _ = write_pair(tmp_path, "qwen3_moe", 4)
    command = shutil.which("dflash-mlx") or str(Path(sys.executable).parent / "dflash-mlx")
    args = f'--model "{target}" --draft-model "{draft}" --prompt "w3 w17 w5" -m 100000 --dtype float32 --split pipeline'
    wrapper = tmp_path / "rank.sh"
    wrapper.write_text(f'echo $$ > "{tmp_path}/pid$MLX_RANK"\nexec "{command}" generate {args}\n')
    out, errors = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")
    run = subprocess.Popen([*launcher(2), "bash", str(wrapper)], stdout=out, stderr=errors)
    try:
        deadline = time.monotonic() + 120
        while (tmp_path / "stdout").stat().st_size < 40:  # rank 0 is decoding
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        os.kill(int((tmp_path / "pid0").read_text()), signal.SIGINT)
        run.wait(timeout=60)  # (mlx.launch itself exits 0 whatever its ranks did)
    finally:
        if run.poll() is None:
            run.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert stderr.count("interrupted") == 1 and "generated" in stderr
    assert "rank 0 exited with code 130" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("family, split", [("qwen3_moe", "pipeline"), ("qwen3", "tensor")])
def test_interrupt_on_one_rank_stops_every_rank_after_one_cycle(tmp_path, family, split):
    """Rank 1 alone interrupts a reply or leaves it: every rank stops after
    the same cycle, holds the same tokens (the target's, including the last
    cycle's, which no rank yields) with its prompt cache exact, and the next
    generation through that cache pairs its exchanges and equals one process's."""
    from dflash_mlx import stream_generate
    from dflash_mlx.loading import load

    target, draft, model = write_pair(tmp_path, family, 4)
    alone, drafter, tokenizer = load(target, draft, dtype="float32")
    full = [
        t for r in stream_generate(alone, drafter, tokenizer, PROMPT, max_tokens=REPLY, block_size=3) for t in r.tokens
    ]
    assert full == greedy_reference(model, PROMPT, REPLY)
    first, second = launch(2, target, [draft], split, tmp_path / "out", mode="interrupts")
    for how, zero in first.items():
        one = second[how]
        assert zero["interrupted"] is False and one["interrupted"] is (how != "by break"), how
        assert zero["kept"] == one["kept"], f"{how}: the ranks hold different tokens"
        reply = zero["kept"][len(PROMPT) :]
        assert zero["kept"] == PROMPT + full[: len(reply)], how
        assert len(zero["seen"]) <= len(reply) < REPLY - 1, f"{how}: rank 0 went on past the agreed cycle"
        # the stop comes within two cycles of blocks of 3: the one in flight, then the flagged one
        assert len(reply) <= len(one["seen"]) + 2 * 3, f"{how}: the stop came late"
        assert zero["seen"] == full[: len(zero["seen"])] and one["seen"] == full[: len(one["seen"])], how
        for rank in (zero, one):
            assert rank["consistent"], how
            assert rank["again"] == full, how


def test_share_from_first_rank(tmp_path):
    for r, result in enumerate(ranks_run("share", tmp_path / "out")):
        assert result["got"] == result["sent"], r


# -- dflash-mlx serve across ranks ----------------------------------------------------------
DFLASH = shutil.which("dflash-mlx") or str(Path(sys.executable).parent / "dflash-mlx")
SERVE_BLOCK = 4


class Served:
    """`dflash-mlx serve` under mlx.launch on a free port: each rank's pid,
    the launcher's output in files; ``stop`` is Ctrl-C on every rank."""

    def __init__(self, tmp_path: Path, ranks: int, *args: str):

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tmp_path
        wrapper = tmp_path / "rank.sh"
        quoted = " ".join(f'"{a}"' for a in args)
        wrapper.write_text(f'echo $$ > "{tmp_path}/pid$MLX_RANK"\nexec "{DFLASH}" serve {quoted} --port {self.port}\n')
        self.out, self.err = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")
        self.ranks = ranks
        self.launch = subprocess.Popen([*launcher(ranks), "bash", str(wrapper)], stdout=self.out, stderr=self.err)
        deadline = time.monotonic() + 120
        while not self._up():
            assert self.launch.poll() is None and time.monotonic() < deadline, self.stderr()[-3000:]
            time.sleep(0.2)

    def _up(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stderr(self) -> str:
        return (self.dir / "stderr").read_text()

    def complete(self, prompt: list[int], max_tokens: int) -> str:
        import httpx

        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    def stop(self) -> int:
        """Ctrl-C as a terminal sends it, to every rank; mlx.launch's exit status."""
        import signal

        for r in range(self.ranks):
            os.kill(int((self.dir / f"pid{r}").read_text()), signal.SIGINT)
        try:
            return self.launch.wait(timeout=60)
        finally:
            self.close()

    def close(self) -> None:
        if self.launch.poll() is None:
            self.launch.kill()
            self.launch.wait()
        self.out.close()
        self.err.close()


def one_process_text(target: Path, draft: Path, prompts: list[tuple[list[int], int]]) -> list[str]:
    """One process's greedy text for each (prompt, max_tokens), each from scratch."""
    from dflash_mlx import generate
    from dflash_mlx.loading import load

    model, drafter, tokenizer = load(target, draft, dtype="float32")
    return [generate(model, drafter, tokenizer, p, max_tokens=m, block_size=SERVE_BLOCK) for p, m in prompts]


def serve_args(target: Path, draft: Path, split: str) -> list[str]:
    return ["--model", str(target), "--draft-model", str(draft), "--dtype", "float32", "--split", split] + [
        "--block-size",
        str(SERVE_BLOCK),
        "--log-level",
        "warning",
    ]


def assert_clean_exit(served: Served, status: int) -> None:
    stderr = served.stderr()
    assert status == 0, stderr[-3000:]
    assert "exited with code" not in stderr and "was killed" not in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.count("serving ") == 1, stderr[-3000:]  # rank 0 alone speaks


@pytest.mark.parametrize("family, split", [("qwen3", "tensor"), ("qwen3_moe", "pipeline")])
def test_serve_across_ranks_equals_one_process(tmp_path, family, split):
    """Rank 0 serves, rank 1 follows: a reply, then one continuing its
    conversation through the kept prompt cache, each one process's greedy
    text; Ctrl-C ends every rank cleanly."""
    import httpx

    target, draft, _ = write_pair(tmp_path, family, 4)
    served = Served(tmp_path, 2, *serve_args(target, draft, split))
    try:
        first = served.complete(PROMPT, MAX_TOKENS)
        follow_up = PROMPT + [int(w[1:]) for w in first.split()] + [5, 9]
        second = served.complete(follow_up, MAX_TOKENS)
        health = httpx.get(f"{served.url}/health").json()
        metrics = httpx.get(f"{served.url}/metrics").text
    finally:
        status = served.stop()
    assert [first, second] == one_process_text(target, draft, [(PROMPT, MAX_TOKENS), (follow_up, MAX_TOKENS)])
    assert len(first.split()) == MAX_TOKENS
    assert health["ranks"] == 2 and health["served"] == 2
    assert "dflash_prompt_cache_hits_total 1" in metrics  # the second continued the first's cache
    assert_clean_exit(served, status)


def test_serve_across_ranks_after_a_client_leaves_mid_stream(tmp_path):
    """A streaming client leaves after a few tokens: every rank stops after
    the same cycle and keeps the same tokens, so the next request, through
    that cache, is still one process's reply."""
    import httpx

    target, draft, _ = write_pair(tmp_path, "qwen3", 4)
    served = Served(tmp_path, 2, *serve_args(target, draft, "tensor"))
    long = 3000
    try:
        body = {"prompt": PROMPT, "max_tokens": long, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as reply:
            chunks = 0
            for line in reply.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break  # the client goes away
        again = served.complete(PROMPT, MAX_TOKENS)
        metrics = httpx.get(f"{served.url}/metrics").text
    finally:
        status = served.stop()
    assert [again] == one_process_text(target, draft, [(PROMPT, MAX_TOKENS)])
    generated = re.search(r"^dflash_generated_tokens_total (\d+)", metrics, re.M)
    assert generated and int(generated.group(1)) < long, metrics  # the first reply stopped early
    assert "dflash_prompt_cache_hits_total 1" in metrics  # the next one continued the left reply's cache
    assert_clean_exit(served, status)


@pytest.mark.parametrize(
    "flags, sentence",
    [
        (["--batching", "always"], "--batching always cannot run across ranks"),
        (["--prefix-cache-dir", "cache"], "--prefix-cache-dir cannot be used across ranks"),
    ],
)
def test_serve_across_ranks_refuses(tmp_path, flags, sentence):
    args = ["--model", "builtin", *flags, "--port", "1"]
    done = subprocess.run(
        [*launcher(2), DFLASH, "serve", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    # whichever rank refuses first ends the launch; the other may be stopped before it refuses
    assert re.search(r"rank [01] exited with code 1 ", done.stderr), done.stderr  # (mlx.launch exits 0)
    assert done.stderr.count(sentence) == 1, done.stderr
    assert "Traceback" not in done.stderr


def chat_turns(command: list[str], lines: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """``dflash-mlx chat`` fed ``lines`` then /quit (mlx.launch never closes a
    rank's stdin, so the session must be left by a command)."""
    done = subprocess.run(
        command,
        input="".join(f"{line}\n" for line in [*lines, "/quit"]),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exited with code" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("family, split", [("qwen3_moe", "pipeline"), ("qwen3", "tensor")])
def test_chat_across_ranks_equals_one_process(tmp_path, family, split):
    """Rank 0 reads the turns and every rank runs them: the conversation
    /save writes (its messages and token ids) is one process's, and the
    session is shown once."""
    target, draft, _ = write_pair(tmp_path, family, 4)
    args = ["chat", "--model", str(target), "--draft-model", str(draft), "--dtype", "float32"]
    args += ["--block-size", "6", "-m", "10"]
    saved = {}
    for name, command in (("alone", [DFLASH, *args]), ("split", [*launcher(2), DFLASH, *args, "--split", split])):
        path = tmp_path / f"{name}.json"
        done = chat_turns(command, ["w3 w17 w5", "w9 w2", f"/save {path}"])
        assert done.stdout.count("dflash-mlx chat ·") == 1  # rank 0 alone speaks
        saved[name] = json.loads(path.read_text())
    assert saved["split"]["messages"] == saved["alone"]["messages"]
    assert saved["split"]["tokens"] == saved["alone"]["tokens"] and len(saved["alone"]["messages"]) == 4


def test_chat_across_ranks_refuses_one_machine_options(tmp_path):
    command = [*launcher(2), DFLASH, "chat", "--model", "builtin", "--prefix-cache-dir", str(tmp_path / "p")]
    done = subprocess.run(command, input="/quit\n", capture_output=True, text=True, timeout=120)
    # whichever rank refuses first ends the launch; the other may be stopped before it refuses
    assert re.search(r"rank [01] exited with code 1 ", done.stderr), done.stderr
    assert done.stderr.count("--prefix-cache-dir cannot be used across ranks yet") == 1
    assert "Traceback" not in done.stderr


def test_chat_across_ranks_keeps_rank_zeros_turn_after_ctrl_c(tmp_path):
    """Ctrl-C on rank 0 stops a reply on every rank after the same cycle;
    rank 0 has shown fewer tokens than that cycle holds, and every rank goes
    on from what it showed, so the next reply is still one process's."""
    import signal

    from dflash_mlx import generate
    from dflash_mlx.loading import load

    # (not leaning towards one token: a reply then shows any difference in what the ranks hold)
    target, draft, _ = write_pair(tmp_path, "qwen3", 4, lean=False)
    args = ["--model", str(target), "--draft-model", str(draft), "--dtype", "float32", "--block-size", "4"]
    wrapper = tmp_path / "rank.sh"
    quoted = " ".join(f'"{a}"' for a in [*args, "-m", "100000", "--split", "tensor"])
    wrapper.write_text(f'echo $$ > "{tmp_path}/pid$MLX_RANK"\nexec "{DFLASH}" chat {quoted}\n')
    out = tmp_path / "stdout"
    with out.open("w") as sink, (tmp_path / "stderr").open("w") as errors:
        run = subprocess.Popen(
            [*launcher(2), "bash", str(wrapper)], stdin=subprocess.PIPE, stdout=sink, stderr=errors, text=True
        )

        def send(line: str) -> None:
            run.stdin.write(line + "\n")
            run.stdin.flush()

        def until(text: str, count: int = 1) -> None:
            deadline = time.monotonic() + 120
            while out.read_text().count(text) < count:
                assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
                time.sleep(0.1)

        try:
            until("dflash-mlx chat ·")
            for turn, (line, saved) in enumerate((("w3 w17 w5", "a.json"), ("w9 w2", "b.json")), 1):
                send(line)
                time.sleep(3)  # well into a reply that would run to the context's end
                os.kill(int((tmp_path / "pid0").read_text()), signal.SIGINT)
                until("reply stopped", turn)
                send(f"/save {tmp_path / saved}")
                until("saved ", turn)
            send("/quit")
            assert run.wait(timeout=60) == 0
        finally:
            if run.poll() is None:
                run.kill()
    assert "exited with code" not in (tmp_path / "stderr").read_text()
    first, second = (json.loads((tmp_path / name).read_text())["tokens"] for name in ("a.json", "b.json"))
    model, drafter, tokenizer = load(target, draft, dtype="float32")
    prompt = first + tokenizer.encode("w9 w2", add_special_tokens=False)
    reply = second[len(prompt) :]
    assert second[: len(first)] == first and 0 < len(reply) < 50000
    want = generate(model, drafter, tokenizer, prompt, max_tokens=len(reply), block_size=4)
    assert tokenizer.decode(reply) == want
