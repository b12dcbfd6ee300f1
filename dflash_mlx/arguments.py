"""Generation arguments, checked once for the Python API and the CLI: each
rule raises ValueError naming the fix (the CLI's flags with ``flags=True``)."""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationArgs:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    block_size: int | str
    seed: int
    prefill_step_size: int
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    min_tokens_to_keep: int = 1


FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "block_size": "--block-size",
    "seed": "--seed",
    "prefill_step_size": "--prefill-step-size",
    "xtc_probability": "--xtc-probability",
    "xtc_threshold": "--xtc-threshold",
    "min_tokens_to_keep": "--min-tokens-to-keep",
}


def integer(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int from any integer type or integral float, never a bool."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, (numbers.Integral, float))
        or (isinstance(value, float) and not value.is_integer())
    ):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    value = int(value)
    if minimum is not None and value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}.")
    return value


def real(name: str, value) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def check_sampling(temperature, top_p, top_k, min_p=0.0) -> tuple[float, float, int, float]:
    temperature, top_p, min_p = real("temperature", temperature), real("top_p", top_p), real("min_p", min_p)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p}.")
    try:
        top_k = integer("top_k", top_k, 0)
    except ValueError:
        raise ValueError(f"top_k must be a non-negative integer (0 disables it), got {top_k!r}.") from None
    return temperature, top_p, top_k, min_p


def check_xtc(xtc_probability, xtc_threshold, min_tokens_to_keep=1) -> tuple[float, float, int]:
    """XTC's probability in [0, 1] and threshold in [0, 0.5] (mlx-lm's
    ranges), and min-p's min_tokens_to_keep >= 1."""
    xtc_probability, xtc_threshold = real("xtc_probability", xtc_probability), real("xtc_threshold", xtc_threshold)
    if not 0 <= xtc_probability <= 1:
        raise ValueError(f"xtc_probability must be in [0, 1] (0 disables XTC), got {xtc_probability}.")
    if not 0 <= xtc_threshold <= 0.5:
        raise ValueError(f"xtc_threshold must be in [0, 0.5], got {xtc_threshold}.")
    return xtc_probability, xtc_threshold, integer("min_tokens_to_keep", min_tokens_to_keep, 1)


def check_block_size(block_size, trained: int | None) -> int | str:
    """ "auto" for None or "auto", else an int in [2, trained]."""
    if block_size is None or (isinstance(block_size, str) and block_size.strip().lower() == "auto"):
        return "auto"
    try:
        bs = integer("block_size", int(block_size) if isinstance(block_size, str) else block_size)
    except ValueError:
        bs = None
    if bs is None or bs < 2:
        raise ValueError(
            f"block_size must be an integer >= 2 (one committed token plus drafts) or 'auto', got {block_size!r}."
        )
    if trained is not None and bs > trained:
        raise ValueError(
            f"block_size {bs} is larger than the block the drafter was trained for ({trained}), "
            f"whose drafts past it are noise; use at most {trained}, or 'auto'."
        )
    return bs


def check_seed(seed) -> int:
    """Any integer, folded into [0, 2**64); None draws one at random."""
    if seed is None:
        return random.SystemRandom().getrandbits(64)
    return integer("seed", seed) % (1 << 64)


def check_lookup(lookup, has_drafter: bool) -> bool | str:
    """``lookup`` (False, True or "auto"), checked: without a drafter it must be on."""
    if lookup not in (False, True, "auto") or isinstance(lookup, int) and not isinstance(lookup, bool):
        raise ValueError(f'lookup must be False, True or "auto"; got {lookup!r}.')
    if not has_drafter and lookup is False:
        raise ValueError(
            "no drafter was given; pass a DFlash drafter, or draft by prompt lookup (lookup=True, --lookup on)."
        )
    return lookup


# The most rows a draft tree verifies: its ancestors fit two 32-bit words a row.
MAX_TREE_BUDGET = 64


def check_tree_budget(tree_budget, has_drafter: bool) -> int | str | None:
    """``tree_budget`` (None, an int of rows in 1..64, or "auto"), checked: a tree needs a drafter."""
    if tree_budget is None:
        return None
    if tree_budget != "auto" and (
        isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or not 1 <= tree_budget <= MAX_TREE_BUDGET
    ):
        raise ValueError(
            f'tree_budget must be None, an integer in [1, {MAX_TREE_BUDGET}] or "auto"; got {tree_budget!r}.'
        )
    if not has_drafter:
        raise ValueError("draft trees need a DFlash drafter; pass one, or drop tree_budget (--tree-budget).")
    return tree_budget


def check_generation_args(
    *,
    max_tokens=256,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    block_size=None,
    seed=None,
    prefill_step_size=2048,
    xtc_probability=0.0,
    xtc_threshold=0.1,
    min_tokens_to_keep=1,
    trained_block_size: int | None,
    flags: bool = False,
) -> GenerationArgs:
    try:
        temperature, top_p, top_k, min_p = check_sampling(temperature, top_p, top_k, min_p)
        xtc_probability, xtc_threshold, min_tokens_to_keep = check_xtc(
            xtc_probability, xtc_threshold, min_tokens_to_keep
        )
        return GenerationArgs(
            max_tokens=integer("max_tokens", max_tokens, 1),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            block_size=check_block_size(block_size, trained_block_size),
            seed=check_seed(seed),
            prefill_step_size=integer("prefill_step_size", prefill_step_size, 1),
            xtc_probability=xtc_probability,
            xtc_threshold=xtc_threshold,
            min_tokens_to_keep=min_tokens_to_keep,
        )
    except ValueError as e:
        if not flags:
            raise
        raise ValueError(flag_words(str(e), block_size)) from None


def flag_words(message: str, block_size=None) -> str:
    """A rule's sentence in the CLI's words: top_p must ... -> --top-p must ..."""
    for name, flag in FLAGS.items():
        message = message.replace(f"{name} must", f"{flag} must").replace(
            f"{name} {block_size}", f"{flag} {block_size}"
        )
    return message
