"""Prompt-cache files across ranks: under ``mlx.launch`` each rank writes and
reads its own share of the caches (rank r beside the file as
NAME.rank<r>.SUFFIX), and a prefix cached across ranks continues exactly as
one process continues its own file."""

from __future__ import annotations

import re
import subprocess

from test_distributed import DFLASH, launcher, write_pair


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_prefix_cached_across_ranks_continues_as_one_process(tmp_path):
    target, draft, _ = write_pair(tmp_path, "qwen3_moe", 4)
    pair = ["--model", str(target), "--draft-model", str(draft), "--dtype", "float32"]
    prefix, rest = ["--prompt", "w3 w17 w5 w9"], ["--prompt", " w2 w11", "-m", "12", "--block-size", "4"]
    alone, split = tmp_path / "alone.safetensors", tmp_path / "split.safetensors"
    made = run([DFLASH, "cache-prompt", *pair, *prefix, "--prompt-cache-file", str(alone)])
    assert made.returncode == 0, made.stderr
    ranks = [*launcher(2), DFLASH]
    made = run([*ranks, "cache-prompt", *pair, *prefix, "--prompt-cache-file", str(split), "--split", "pipeline"])
    assert made.returncode == 0 and "exited with code" not in made.stderr, made.stderr[-3000:]
    assert split.is_file() and (tmp_path / "split.rank1.safetensors").is_file()
    assert made.stdout.count("cached ") == 1  # rank 0 alone speaks
    want = run([DFLASH, "generate", *pair, *rest, "--prompt-cache-file", str(alone)])
    got = run([*ranks, "generate", *pair, *rest, "--prompt-cache-file", str(split), "--split", "pipeline"])
    assert want.returncode == 0 and got.returncode == 0 and "exited with code" not in got.stderr, got.stderr[-3000:]
    assert got.stdout == want.stdout and len(want.stdout.split()) == 12


def test_a_one_process_file_is_refused_across_ranks(tmp_path):
    target, draft, _ = write_pair(tmp_path, "qwen3_moe", 4)
    pair = ["--model", str(target), "--draft-model", str(draft), "--dtype", "float32"]
    alone = tmp_path / "alone.safetensors"
    made = run([DFLASH, "cache-prompt", *pair, "--prompt", "w3 w17", "--prompt-cache-file", str(alone)])
    assert made.returncode == 0, made.stderr
    done = run([*launcher(2), DFLASH, "generate", *pair, "--prompt", " w2", "--prompt-cache-file", str(alone)])
    assert re.search(r"rank [01] exited with code 1 ", done.stderr), done.stderr[-3000:]
    assert done.stderr.count("1 of the 2 ranks have no file of --prompt-cache-file") == 1  # every rank agrees
    assert "Traceback" not in done.stderr
