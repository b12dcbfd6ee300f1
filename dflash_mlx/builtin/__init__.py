"""The built-in pair: a small Qwen3 target trained from scratch on the Python
standard library, with its byte-level BPE tokenizer (ChatML template, <|mask|>),
and its DFlash drafter trained with ``dflash-mlx train``. It runs offline, so
``generate``/``chat``/``bench`` have something real to use without --model.

Rebuilt by scripts/build_builtin.py; BUILD.json records how it was made.

    from dflash_mlx import load
    from dflash_mlx.builtin import TARGET, DRAFT
    model, draft, tokenizer = load(str(TARGET), draft=str(DRAFT))
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
TARGET = ROOT / "target"
DRAFT = ROOT / "draft"
NAME = "dflash-mlx built-in stdlib-coder (7.3M-parameter Qwen3 target + 4-layer DFlash drafter, blocks 4-16)"


def available() -> bool:
    """Whether the weights are present (a source checkout without them says no)."""
    return (TARGET / "model.safetensors").is_file() and (DRAFT / "model.safetensors").is_file()
