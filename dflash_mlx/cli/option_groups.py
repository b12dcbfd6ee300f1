"""The flags several commands share, in groups: a dataclass a group, whose
fields are typer options, handed to a command as one object (``takes_groups``).
A flag for several commands goes into its group, and into the group's methods
where it reaches the library (``Sampling.generation``: stream_generate's)."""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from . import options
from .console import UserError, note
from .pair import load_pair, load_split
from .prompt_input import thinking_note, use_default_template


@dataclass(frozen=True)
class Flags:
    """A command's parameter that stands for a group's flags: those the
    command offers, in this order, and the defaults it gives them."""

    group: type
    names: tuple[str, ...]
    defaults: dict


def flags(group: type, *names: str, **defaults) -> Flags:
    """All of ``group``'s flags, or only ``names``; ``defaults`` override the group's."""
    return Flags(group, names or tuple(f.name for f in fields(group)), defaults)


def takes_groups(command):
    """``command`` as typer sees it: every parameter whose default is a
    ``Flags`` stands for that group's flags, which typer lists where it
    stands; the command is called with the group made from their values."""
    signature = inspect.signature(command, eval_str=True)
    groups = {p.name: p.default for p in signature.parameters.values() if isinstance(p.default, Flags)}
    params = []
    for p in signature.parameters.values():
        if p.name not in groups:
            params.append(p)
            continue
        spec = groups[p.name]
        hints = typing.get_type_hints(spec.group, include_extras=True)
        defaults = {f.name: inspect.Parameter.empty if f.default is MISSING else f.default for f in fields(spec.group)}
        defaults.update(spec.defaults)
        params += [inspect.Parameter(n, p.KEYWORD_ONLY, default=defaults[n], annotation=hints[n]) for n in spec.names]

    @functools.wraps(command)
    def run(**values):
        for name, spec in groups.items():
            values[name] = spec.group(**{**spec.defaults, **{n: values.pop(n) for n in spec.names}})
        return command(**values)

    run.__signature__ = signature.replace(parameters=params)
    return run


@dataclass(frozen=True)
class Pair:
    """--model, --draft-model, --dtype, --draft-bits: the pair a command runs."""

    model: options.Model = None
    draft_model: options.DraftModel = None
    dtype: options.Dtype = "auto"
    draft_bits: options.DraftBits = "auto"

    def bits(self) -> int | str | None:
        """--draft-bits as dflash_mlx.load takes it (None: as stored)."""
        from dflash_mlx.draft.precision import from_flag

        try:
            return from_flag(self.draft_bits)
        except ValueError as e:
            raise UserError(str(e)) from None

    def load(self, name: Optional[str] = None, **loading):
        """(target, drafter, tokenizer): ``name`` (the target as resolved
        already) or --model, and ``loading``, load_pair's other arguments."""
        return load_pair(name or self.model, self.draft_model, dtype=self.dtype, draft_bits=self.bits(), **loading)

    def load_split(self, group, split: str, **loading):
        """(target, drafter, tokenizer), the target split across ``group``'s
        ranks; ``loading``: load_split's other arguments."""
        return load_split(
            self.model, self.draft_model, group=group, split=split, dtype=self.dtype, draft_bits=self.bits(), **loading
        )


SAMPLER = ("temp", "top_p", "min_p", "top_k", "xtc_probability", "xtc_threshold", "min_tokens_to_keep")


@dataclass(frozen=True)
class Sampling:
    """--max-tokens, the sampler's flags (mlx-lm's), --seed and the block size."""

    max_tokens: options.MaxTokens = 256
    temp: options.Temp = 0.0
    top_p: options.TopP = 1.0
    min_p: options.MinP = 0.0
    top_k: options.TopK = 0
    xtc_probability: options.XtcProbability = 0.0
    xtc_threshold: options.XtcThreshold = 0.1
    min_tokens_to_keep: options.MinTokensToKeep = 1
    seed: options.Seed = None
    block_size: options.BlockSize = None
    num_draft_tokens: options.NumDraftTokens = None
    lookup: options.Lookup = "off"
    tree_budget: options.TreeBudget = None

    def sampler(self) -> dict:
        """mlx-lm's make_sampler arguments: the flags that pick each token."""
        return {name: getattr(self, name) for name in SAMPLER}

    def generation(self, block_size: int | str, prefill_step_size: int = 2048) -> dict:
        """stream_generate's keyword arguments but max_tokens, ``block_size`` checked already."""
        args = self.sampler()
        args["temperature"] = args.pop("temp")
        lookup = options.LOOKUP.get(self.lookup, self.lookup)
        return dict(
            args,
            seed=self.seed,
            block_size=block_size,
            prefill_step_size=prefill_step_size,
            lookup=lookup,
            tree_budget=options.tree_budget(self.tree_budget),
        )

    def check(self, prefill_step_size: int = 2048, drafter: bool = True) -> dict:
        """``generation``'s arguments, checked by the library's rules
        (dflash_mlx.arguments) before anything loads; the block size comes
        from --block-size or --num-draft-tokens ("auto" for neither).
        ``drafter``: whether a DFlash drafter will be loaded (not --draft-model none)."""
        from dflash_mlx.arguments import check_generation_args

        block_size = self.block_size
        if self.num_draft_tokens is not None:
            if block_size is not None:
                raise UserError("--num-draft-tokens N is --block-size N+1; pass one of them, not both.")
            if self.num_draft_tokens < 1:
                raise UserError(f"--num-draft-tokens must be a positive integer, got {self.num_draft_tokens}.")
            block_size = str(self.num_draft_tokens + 1)
        if self.lookup not in options.LOOKUP:
            raise UserError(f"--lookup must be on, off or auto, got {self.lookup!r}.")
        args = self.generation(block_size, prefill_step_size)
        if args["tree_budget"] is not None and not drafter:
            raise UserError(
                "--tree-budget drafts trees with a DFlash drafter; name one with --draft-model, or leave --tree-budget out."
            )
        rules = {k: v for k, v in args.items() if k not in ("lookup", "tree_budget")}
        try:
            checked = check_generation_args(max_tokens=self.max_tokens, **rules, trained_block_size=None, flags=True)
        except ValueError as e:
            raise UserError(str(e)) from None
        return dict(args, block_size=checked.block_size)


def check_drafter_block(block_size: int | str, draft) -> None:
    """A checked block size that the loaded drafter (None: lookup alone) was trained for too."""
    from dflash_mlx.arguments import check_block_size, flag_words

    if draft is None:
        return
    try:
        check_block_size(block_size, draft.config.block_size)
    except ValueError as e:
        raise UserError(flag_words(str(e), block_size)) from None


def check_trees(tree_budget: int | str | None, target, draft, cache=None) -> int | str | None:
    """The trees a decode will verify over ``cache`` (as the --kv-* flags made
    it; None: a plain one): ``tree_budget``, or None where auto turns to
    blocks (said in a note); a --tree-budget N the target cannot verify is refused."""
    from dflash_mlx import make_prompt_cache
    from dflash_mlx.generation import served_tree_budget

    try:
        served = served_tree_budget(target, cache or make_prompt_cache(target, draft), tree_budget)
    except ValueError as e:
        raise UserError(str(e)) from None
    if tree_budget == "auto" and served is None:
        note("--tree-budget auto verifies blocks: this target cannot verify draft trees over its KV caches")
    return served


@dataclass(frozen=True)
class Template:
    """The chat template's flags."""

    use_default_chat_template: options.UseDefaultChatTemplate = False
    ignore_chat_template: options.IgnoreChatTemplate = False
    enable_thinking: options.EnableThinking = False
    chat_template_config: options.ChatTemplateConfig = None
    extra_eos_token: options.ExtraEosToken = None

    def kwargs(self) -> dict:
        return options.template_args(self.chat_template_config)

    def prompt_settings(self, kwargs: dict) -> dict:
        """prompt_ids' (and ChatSession's) template arguments, ``kwargs`` the template's extra ones."""
        return dict(
            ignore_chat_template=self.ignore_chat_template, enable_thinking=self.enable_thinking, template_kwargs=kwargs
        )

    def prepare(self, tokenizer) -> None:
        """The tokenizer as the flags set it up (its EOS tokens, a default
        template), with a note where --enable-thinking changes nothing."""
        options.add_eos_tokens(tokenizer, self.extra_eos_token)
        use_default_template(tokenizer, self.use_default_chat_template)
        thinking_note(tokenizer, self.enable_thinking, self.ignore_chat_template)


@dataclass(frozen=True)
class Kv:
    """--kv-bits, --kv-group-size, --quantized-kv-start, --max-kv-size: the target's KV cache."""

    kv_bits: options.KvBits = None
    kv_group_size: options.KvGroupSize = 64
    quantized_kv_start: options.QuantizedKvStart = 5000
    max_kv_size: options.MaxKvSize = None

    @property
    def quantization(self) -> tuple:
        """(bits, group size, start): what a prompt-cache file was made with."""
        return self.kv_bits, self.kv_group_size, self.quantized_kv_start

    def check(self, cache_file: Optional[Path] = None) -> None:
        """The values, before anything loads (``cache_file``: a --prompt-cache-file given)."""
        from dflash_mlx.kv.quantized import BITS, GROUP_SIZES
        from dflash_mlx.kv.rotating import KEEP

        if self.kv_bits is not None and self.kv_bits not in BITS:
            raise UserError(f"--kv-bits must be one of {', '.join(map(str, BITS))}, got {self.kv_bits}.")
        if self.kv_group_size not in GROUP_SIZES:
            sizes = ", ".join(map(str, GROUP_SIZES))
            raise UserError(f"--kv-group-size must be one of {sizes}, got {self.kv_group_size}.")
        if self.quantized_kv_start < 0:
            raise UserError(f"--quantized-kv-start must be 0 or more, got {self.quantized_kv_start}.")
        if self.max_kv_size is not None and self.max_kv_size <= KEEP:
            raise UserError(
                f"--max-kv-size must be more than {KEEP} (the first {KEEP} tokens are always kept), "
                f"got {self.max_kv_size}."
            )
        if self.max_kv_size is not None and self.kv_bits is not None:
            raise UserError(
                "--max-kv-size and --kv-bits cannot be combined (mlx-lm cannot quantize its rotating cache "
                "either); drop one of them."
            )
        if self.max_kv_size is not None and cache_file is not None:
            raise UserError(options.NO_BOUNDED_FILE)

    def cache(self, target, draft, loaded=None):
        """The prompt cache to run with: ``loaded`` (one from a file, made
        with these settings) or a new one set as the flags say; None when
        there is nothing to set."""
        from dflash_mlx import make_prompt_cache
        from dflash_mlx.kv.quantized import check_settings
        from dflash_mlx.targets import adapt

        try:
            if loaded is not None:
                if self.max_kv_size is not None:
                    raise UserError(options.NO_BOUNDED_FILE)
                check_settings(adapt(target), *self.quantization)
                return loaded
            if self.kv_bits is None and self.max_kv_size is None:
                return None
            return make_prompt_cache(target, draft, **asdict(self))
        except ValueError as e:
            raise UserError(options.flag_names(str(e))) from None
