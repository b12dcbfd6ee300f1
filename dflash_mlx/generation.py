"""The text-level DFlash API: ``stream_generate`` and ``generate``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .arguments import check_generation_args, check_lookup, check_tree_budget
from .auto import memory as block_memory
from .auto.chooser import auto_range, tree_range
from .cache.prompt import PromptCache, make_prompt_cache
from .decode.loop import LookupSetting, decode
from .decode.sampling import SamplingParams
from .distributed import agreed_chooser
from .draft.dflash import DFlashDraft
from .draft.lookup import lookup_drafter
from .draft.tree import TreeParams
from .prompts import encode
from .targets import adapt

MAX_TOP_LOGPROBS = 20


@dataclass
class GenerationResponse:
    """One step of ``stream_generate``: the first token, then one cycle.
    ``tokens`` includes an EOS whose text is not in ``text``; ``block_size``
    1 is a plain target step; ``acceptance_length`` counts the bonus token."""

    text: str
    tokens: list[int]
    accepted: int | None
    block_size: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    acceptance_length: float
    acceptance_rate: float
    peak_memory: float
    finish_reason: str | None = None
    cycles: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    block_sizes: dict[int, int] = field(default_factory=dict)
    # With ``logprobs`` asked for, aligned with ``tokens``: the target's
    # log-softmax at each token, and (logprobs > 0) the top (token, log-prob) pairs.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt lookup: whether this cycle's drafts were looked up; so far, the
    # cycles whose drafts were and the tokens they committed.
    lookup_hit: bool = False
    lookup_hits: int = 0
    lookup_tokens: int = 0
    # Target rows verified by drafting cycles so far (a tree's nodes, or the blocks).
    rows_verified: int = 0
    # With block_size "auto": what it is doing and why, e.g. "plain: blocks cost more than they commit".
    auto_reason: str | None = None

    @property
    def plain_cycles(self) -> int:
        return self.block_sizes.get(1, 0)


def _token_ids(prompt) -> list[int]:
    bad = ValueError("the prompt must be a string or a 1-D sequence of integer token ids (or a batch of one).")
    if isinstance(prompt, mx.array):
        if not mx.issubdtype(prompt.dtype, mx.integer):
            raise bad
        array = np.array(prompt)
    elif isinstance(prompt, np.ndarray):
        if prompt.dtype.kind not in "iu":
            raise bad
        array = prompt
    else:
        items = list(prompt)
        if len(items) == 1 and isinstance(items[0], (list, tuple)):  # a batch of one
            items = list(items[0])
        kinds = set(map(type, items))  # (a long prompt's ids checked by type, not one by one)
        if any(issubclass(k, (bool, np.bool_)) or not issubclass(k, (int, np.integer)) for k in kinds):
            raise bad
        array = np.array(items, dtype=np.int64)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise bad
    return array.tolist()


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int] | mx.array, vocab_size: int) -> list[int]:
    """Token ids from a str or from integer ids, 1-D or a batch of one."""
    if isinstance(prompt, str):
        ids = encode(tokenizer, prompt)
    else:
        ids = _token_ids(prompt)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token of text.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"the prompt holds token ids outside the target's vocabulary [0, {vocab_size}).")
    return ids


def _lookup_setting(lookup, draft) -> LookupSetting | None:
    if check_lookup(lookup, draft is not None) is False:
        return None
    return LookupSetting(auto=lookup == "auto")


def served_tree_budget(model, prompt_cache: PromptCache, tree_budget):
    """``tree_budget`` if the target can verify draft trees over the prompt
    cache's caches; else None for "auto" (blocks instead), a ValueError for a
    number of rows."""
    if tree_budget is None:
        return None
    target = adapt(model)
    if target.takes_trees(prompt_cache.target):
        return tree_budget
    if tree_budget == "auto":
        return None
    raise ValueError(
        f"this {target.family} target cannot verify draft trees over its KV caches (quantized or bounded KV "
        'caches, a tensor split, or a family without trees); pass tree_budget "auto" (--tree-budget auto), '
        "or leave it out."
    )


def _tree(target, prompt_cache: PromptCache, tree_budget, block_size, trained: int) -> TreeParams | None:
    """The trees a decode verifies (None: blocks), drafted from ``block_size``'s
    blocks (else the trained block's)."""
    tree = TreeParams(block_size if isinstance(block_size, int) else trained) if tree_budget is not None else None
    if tree is None or served_tree_budget(target, prompt_cache, tree_budget) is None:
        return None
    target.prepare_trees()
    return tree


def stream_generate(
    model,
    draft: DFlashDraft | None,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    min_tokens_to_keep: int = 1,
    block_size: int | None = None,
    seed: int | None = None,
    prompt_cache: PromptCache | None = None,
    prefill_step_size: int = 2048,
    prompt_progress: Callable[[int, int], None] | None = None,
    logprobs: int | None = None,
    lookup: bool | str = False,
    tree_budget: int | str | None = None,
) -> Iterator[GenerationResponse]:
    """Yield a GenerationResponse for the first token and one per cycle;
    the output is exactly the target's own. Arguments are checked before this
    returns.

    prompt: a str (no chat template applied) or token ids.
    block_size: tokens per verify, at most the trained block; None or "auto"
    chooses it before every cycle. seed: fixes a sampled run's text.
    xtc_probability, xtc_threshold, min_tokens_to_keep: mlx-lm's make_sampler
    settings; XTC's coin at each position is fixed by the seed too.
    prompt_cache: only the part of the prompt not cached is prefilled; a newer
    call on the same cache takes it over from a generator still alive.
    prompt_progress(done, total): called after each prefill chunk.
    logprobs: None (off), 0 (each token's log-prob under the target's raw
    distribution) or k in 1..20 (also the top k at each position).
    lookup: draft by prompt lookup too (docs/lookup.md): False, True, or
    "auto" (per reply, only while looked-up drafts beat the drafter's). With
    ``draft`` None the drafts are looked up only (lookup_drafter(model)).
    tree_budget: verify draft trees (docs/trees.md): None (blocks), the rows
    each drafting cycle verifies (1-64, the root included), or "auto" (chosen
    before every cycle); ``block_size`` is then the drafter's block.
    """
    lookup_setting = _lookup_setting(lookup, draft)
    tree_budget = check_tree_budget(tree_budget, draft is not None)
    # a prompt cache's adapter serves its model's later calls (traces_for remakes its layers on new weights)
    target = prompt_cache.adapter if getattr(prompt_cache, "model", None) is model else adapt(model)
    if draft is None:
        draft = lookup_drafter(model)
    draft.bind(target)
    args = check_generation_args(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        xtc_probability=xtc_probability,
        xtc_threshold=xtc_threshold,
        min_tokens_to_keep=min_tokens_to_keep,
        block_size=block_size,
        seed=seed,
        prefill_step_size=prefill_step_size,
        trained_block_size=draft.config.block_size,
    )
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS
    ):
        raise ValueError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}]; got {logprobs!r}.")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = encode_prompt(tokenizer, prompt, target.vocab_size)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(target, draft)
    prompt_cache.check_pair(target, draft)
    hi = draft.config.block_size
    tree = _tree(target, prompt_cache, tree_budget, args.block_size, hi)
    auto = args.block_size == "auto" if tree is None else tree_budget == "auto"
    if tree is not None:
        hi = tree.block_size  # the deepest node is a block deep
        block = block_memory.chooser(target, draft, *tree_range(tree.block_size), trees=True) if auto else tree_budget
    else:
        block = block_memory.chooser(target, draft, *auto_range(target, draft)) if auto else args.block_size
    if auto and getattr(target, "group", None) is not None:  # every rank runs rank 0's choice
        block = agreed_chooser(block, target.group)
    steps = decode(
        target,
        draft,
        prompt_cache,
        ids,
        max_tokens=args.max_tokens,
        sampling=SamplingParams(
            args.temperature,
            args.top_p,
            args.top_k,
            args.min_p,
            xtc_probability=args.xtc_probability,
            xtc_threshold=args.xtc_threshold,
            min_tokens_to_keep=args.min_tokens_to_keep,
            # mlx-lm's: XTC never removes a newline or an EOS token
            xtc_special_tokens=tuple(sorted({*tokenizer.encode("\n"), *tokenizer.eos_token_ids})),
        ),
        seed=args.seed,
        block=block,
        eos=set(tokenizer.eos_token_ids),
        prefill_step_size=args.prefill_step_size,
        progress=prompt_progress,
        logprobs=logprobs,
        lookup=lookup_setting,
        tree=tree,
    )
    if auto:
        steps = block_memory.remembered(steps, block)
    return _responses(target, tokenizer, steps, len(ids), hi, block if auto else None)


def _responses(target, tokenizer, steps, prompt_tokens: int, hi: int, chooser=None) -> Iterator[GenerationResponse]:
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(tokenizer.eos_token_ids)
    by_position = [0] * (hi - 1)
    sizes: dict[int, int] = {}
    n = drafting = committed_drafting = accepted_total = proposed = hits = hit_tokens = rows = 0
    with wired_limit(target.model, [generation_stream]):
        tic = time.perf_counter()
        prompt_tps = gen_tic = None
        for step in steps:
            if prompt_tps is None:
                gen_tic = time.perf_counter()
                prompt_tps = prompt_tokens / max(gen_tic - tic, 1e-9)
            else:
                sizes[step.block_size] = sizes.get(step.block_size, 0) + 1
                if step.block_size > 1:
                    drafting += 1
                    committed_drafting += len(step.tokens)
                    accepted_total += step.accepted
                    proposed += step.rows - 1
                    rows += step.rows
                    for i in range(step.accepted):
                        by_position[i] += 1
                    if step.lookup_hit:
                        hits += 1
                        hit_tokens += len(step.tokens)
            n += len(step.tokens)
            for t in step.tokens:
                if t not in eos:
                    detok.add_token(t)
            if step.finish is not None:
                detok.finalize()
            elapsed = time.perf_counter() - gen_tic
            yield GenerationResponse(
                text=detok.last_segment,
                tokens=step.tokens,
                accepted=step.accepted,
                block_size=step.block_size,
                prompt_tokens=prompt_tokens,
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
                acceptance_length=committed_drafting / drafting if drafting else 0.0,
                acceptance_rate=accepted_total / proposed if proposed else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=step.finish,
                cycles=sum(sizes.values()),
                accepted_by_position=list(by_position),
                block_sizes=dict(sizes),
                logprobs=step.logprobs,
                top_logprobs=step.top_logprobs,
                lookup_hit=step.lookup_hit,
                lookup_hits=hits,
                lookup_tokens=hit_tokens,
                rows_verified=rows,
                auto_reason=None if chooser is None else chooser.reason,
            )


def generate(model, draft: DFlashDraft | None, tokenizer, prompt, *, verbose: bool = False, **kwargs) -> str:
    """Like ``stream_generate`` (same arguments) but returns the whole text."""
    text, last = [], None
    for last in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(
            f"\n{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, "
            f"acceptance length {last.acceptance_length:.2f}, "
            f"acceptance rate {last.acceptance_rate:.1%}, peak memory {last.peak_memory:.2f} GB"
            + (f", lookup hits {last.lookup_hits} ({last.lookup_tokens} tokens)" if last.lookup_hits else "")
        )
    return "".join(text)
