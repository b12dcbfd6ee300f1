"""The built-in pair: a small Qwen3 target trained on the Python standard
library and its DFlash drafter, runnable offline. Rebuilt by
scripts/build_builtin.py; BUILD.json records how."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
TARGET = ROOT / "target"
DRAFT = ROOT / "draft"
NAME = "dflash-mlx built-in stdlib-coder (7.3M-parameter Qwen3 target + 4-layer DFlash drafter, blocks 4-16)"


def available() -> bool:
    """Whether the weights are present (a source checkout without them says no)."""
    return (TARGET / "model.safetensors").is_file() and (DRAFT / "model.safetensors").is_file()
