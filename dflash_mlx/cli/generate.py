"""`dflash-mlx generate`: one prompt, text streamed to stdout, stats to stderr."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import typer
from rich.text import Text

from . import options
from .cache_prompt import check_rank_files, open_cache, rank_file, read_cache_file
from .console import err, note, speak_on_first_rank_only, user_errors
from .option_groups import Kv, Pair, Sampling, Template, check_drafter_block, check_trees, flags, takes_groups
from .pair import room_for_reply
from .progress import PrefillProgress
from .prompt_input import prompt_ids, read_prompt
from .status import stats_line

EXAMPLES = """\
Examples:

$ dflash-mlx generate --prompt "def fibonacci(n):"

$ dflash-mlx generate --model Qwen/Qwen3-8B --prompt "Write a haiku about the sea"

$ dflash-mlx generate --model ./qwen3-8b --draft-model ./qwen3-8b-dflash --prompt "Explain RoPE" -m 512 --temp 0.7 --min-p 0.05 --seed 1

$ cat question.txt | dflash-mlx generate --model Qwen/Qwen3-8B --prompt - --prefill-response "Sure:"

$ dflash-mlx generate --model Qwen/Qwen3-8B --prompt-cache-file manual.safetensors --prompt "What does chapter 2 say?"

$ mlx.launch --hostfile hosts.json dflash-mlx generate --model ./kimi-k2.5-4bit --prompt "Hello"

Without --model the built-in pair runs; without --draft-model the drafter comes from the known pairs (dflash-mlx models).
Under mlx.launch the target is split across the ranks (docs/distributed.md) and only rank 0 prints.
"""


@takes_groups
def generate_command(
    *,
    pair: Pair = flags(Pair),
    prompt: options.Prompt = None,
    sampling: Sampling = flags(Sampling),
    system_prompt: options.SystemPrompt = None,
    prefill_response: options.PrefillResponse = None,
    template: Template = flags(Template),
    adapter_path: options.AdapterPath = None,
    trust_remote_code: options.TrustRemoteCode = False,
    prompt_cache_file: options.PromptCacheFile = None,
    prefill_step_size: options.PrefillStepSize = 2048,
    kv: Kv = flags(Kv),
    split: options.Split = "auto",
    verbose: options.Verbose = False,
):
    """Generate a reply to one prompt with DFlash speculative decoding.

    The text streams to stdout as it is produced; a stats line (tokens, tok/s,
    the block used, acceptance length and rate, peak memory) follows on stderr.
    Leaving out --model uses the built-in pair.
    """
    from dflash_mlx import distributed

    group = distributed.world()
    speak_on_first_rank_only(group)
    with user_errors(verbose):
        check_rank_files(prompt_cache_file, group)
        prompt_cache_file = rank_file(prompt_cache_file, group)
        text = read_prompt(prompt)
        if prompt_cache_file is not None:  # the file's prefix, then the prompt
            cached = read_cache_file(prompt_cache_file)
            text = cached["prompt"] + text
            system_prompt = system_prompt or cached["system_prompt"]
            if not template.chat_template_config:
                template = replace(template, chat_template_config=json.dumps(cached["template_kwargs"]))
        generation = sampling.check(prefill_step_size, drafter=pair.draft_model != "none")
        kwargs = template.kwargs()
        kv.check(prompt_cache_file)
        from dflash_mlx import stream_generate

        if group is None:
            target, draft, tokenizer = pair.load(adapter_path=adapter_path, trust_remote_code=trust_remote_code)
        else:
            target, draft, tokenizer = pair.load_split(
                group, split, adapter_path=adapter_path, trust_remote_code=trust_remote_code
            )
        block_size = generation["block_size"]
        check_drafter_block(block_size, draft)
        template.prepare(tokenizer)
        ids = prompt_ids(
            tokenizer,
            text,
            system_prompt=system_prompt,
            prefill_response=prefill_response,
            **template.prompt_settings(kwargs),
        )
        cache = None
        if prompt_cache_file is not None:
            cache = open_cache(prompt_cache_file, target, draft, ids, kv.quantization)
        cache = kv.cache(target, draft, cache)
        trees = check_trees(generation["tree_budget"], target, draft, cache)
        if verbose:
            note(f"prompt: {len(ids)} tokens: {tokenizer.decode(ids)!r}")
        bounded = kv.max_kv_size is not None
        reply_tokens, limit = room_for_reply(target, len(ids), sampling.max_tokens, bounded=bounded)
        progress = PrefillProgress()
        last = None
        out = sys.stdout
        try:
            for last in stream_generate(
                target,
                draft,
                tokenizer,
                ids,
                max_tokens=reply_tokens,
                prompt_progress=progress,
                prompt_cache=cache,
                **generation,
            ):
                out.write(last.text)
                out.flush()
        except KeyboardInterrupt:
            out.write("\n")
            out.flush()
            progress.close()
            err.print(Text("interrupted", style="yellow"))
            if last is not None:
                note(stats_line(last, block_size, tree_budget=trees))
            raise typer.Exit(130)
        finally:
            progress.close()
        out.write("\n")
        out.flush()
        if last is not None:
            line = stats_line(last, block_size, limit, tree_budget=trees)
            err.print(Text(line, style="dim"), soft_wrap=True)
            if verbose:  # mlx-lm's closing lines, for scripts that parse them
                sys.stderr.write(
                    f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec\n"
                    f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec\n"
                    f"Peak memory: {last.peak_memory:.3f} GB\n"
                )
                sys.stderr.flush()
            if last.finish_reason == "length" and reply_tokens < sampling.max_tokens:
                note(f"stopped at {limit}: the reply cannot be longer than the context the target was trained for.")
