"""`dflash-mlx generate`: one prompt, text streamed to stdout, stats to stderr."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.text import Text

from . import options
from .cache_prompt import open_cache, read_cache_file
from .console import err, note, user_errors
from .pair import load_pair, room_for_reply
from .progress import PrefillProgress
from .prompt_input import prompt_ids, read_prompt, thinking_note, use_default_template
from .status import stats_line

EXAMPLES = """\
Examples:

$ dflash-mlx generate --prompt "def fibonacci(n):"

$ dflash-mlx generate --model Qwen/Qwen3-8B --prompt "Write a haiku about the sea"

$ dflash-mlx generate --model ./qwen3-8b --draft-model ./qwen3-8b-dflash --prompt "Explain RoPE" -m 512 --temp 0.7 --min-p 0.05 --seed 1

$ cat question.txt | dflash-mlx generate --model Qwen/Qwen3-8B --prompt - --prefill-response "Sure:"

$ dflash-mlx generate --model Qwen/Qwen3-8B --prompt-cache-file manual.safetensors --prompt "What does chapter 2 say?"

Without --model the built-in pair runs; without --draft-model the drafter comes from the known pairs (dflash-mlx models).
"""


def generate_command(
    *,
    model: options.Model = None,
    draft_model: options.DraftModel = None,
    dtype: options.Dtype = "auto",
    prompt: Annotated[
        Optional[str],
        typer.Option(
            "--prompt",
            "-p",
            help="The prompt; '-' reads it from stdin.",
            show_default=False,
            callback=options.utf8_text,
        ),
    ] = None,
    max_tokens: options.MaxTokens = 256,
    temp: options.Temp = 0.0,
    top_p: options.TopP = 1.0,
    min_p: options.MinP = 0.0,
    top_k: options.TopK = 0,
    xtc_probability: options.XtcProbability = 0.0,
    xtc_threshold: options.XtcThreshold = 0.1,
    min_tokens_to_keep: options.MinTokensToKeep = 1,
    seed: options.Seed = None,
    block_size: options.BlockSize = None,
    num_draft_tokens: options.NumDraftTokens = None,
    system_prompt: options.SystemPrompt = None,
    prefill_response: Annotated[
        Optional[str],
        typer.Option(
            "--prefill-response",
            help="Start the reply with this text (chat template); the model continues it.",
            show_default=False,
            callback=options.utf8_text,
        ),
    ] = None,
    use_default_chat_template: options.UseDefaultChatTemplate = False,
    ignore_chat_template: options.IgnoreChatTemplate = False,
    enable_thinking: options.EnableThinking = False,
    chat_template_config: options.ChatTemplateConfig = None,
    extra_eos_token: options.ExtraEosToken = None,
    adapter_path: options.AdapterPath = None,
    trust_remote_code: options.TrustRemoteCode = False,
    prompt_cache_file: options.PromptCacheFile = None,
    prefill_step_size: options.PrefillStepSize = 2048,
    kv_bits: options.KvBits = None,
    kv_group_size: options.KvGroupSize = 64,
    quantized_kv_start: options.QuantizedKvStart = 5000,
    max_kv_size: options.MaxKvSize = None,
    verbose: options.Verbose = False,
):
    """Generate a reply to one prompt with DFlash speculative decoding.

    The text streams to stdout as it is produced; a stats line (tokens, tok/s,
    the block used, acceptance length and rate, peak memory) follows on stderr.
    Leaving out --model uses the built-in pair.
    """
    with user_errors(verbose):
        text = read_prompt(prompt)
        if prompt_cache_file is not None:  # the file's prefix, then the prompt
            cached = read_cache_file(prompt_cache_file)
            text = cached["prompt"] + text
            system_prompt = system_prompt or cached["system_prompt"]
            chat_template_config = chat_template_config or json.dumps(cached["template_kwargs"])
        xtc = dict(xtc_probability=xtc_probability, xtc_threshold=xtc_threshold, min_tokens_to_keep=min_tokens_to_keep)
        flags = dict(min_p=min_p, num_draft_tokens=num_draft_tokens, prefill_step_size=prefill_step_size, **xtc)
        block_size = options.check_args(max_tokens, temp, top_p, top_k, block_size, seed, **flags)
        kwargs = options.template_args(chat_template_config)
        options.check_kv(kv_bits, kv_group_size, quantized_kv_start, max_kv_size, prompt_cache_file)
        from dflash_mlx import stream_generate

        target, draft, tokenizer = load_pair(
            model, draft_model, adapter_path=adapter_path, trust_remote_code=trust_remote_code, dtype=dtype
        )
        options.check_args(
            max_tokens,
            temp,
            top_p,
            top_k,
            block_size,
            seed,
            draft=draft,
            min_p=min_p,
            prefill_step_size=prefill_step_size,
            **xtc,
        )
        options.add_eos_tokens(tokenizer, extra_eos_token)
        use_default_template(tokenizer, use_default_chat_template)
        thinking_note(tokenizer, enable_thinking, ignore_chat_template)
        ids = prompt_ids(
            tokenizer,
            text,
            system_prompt=system_prompt,
            ignore_chat_template=ignore_chat_template,
            enable_thinking=enable_thinking,
            template_kwargs=kwargs,
            prefill_response=prefill_response,
        )
        kv = (kv_bits, kv_group_size, quantized_kv_start)
        cache = None if prompt_cache_file is None else open_cache(prompt_cache_file, target, draft, ids, kv)
        cache = options.kv_cache(target, draft, cache, *kv, max_kv_size=max_kv_size)
        if verbose:
            note(f"prompt: {len(ids)} tokens: {tokenizer.decode(ids)!r}")
        reply_tokens, limit = room_for_reply(target, len(ids), max_tokens, bounded=max_kv_size is not None)
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
                temperature=temp,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                **xtc,
                block_size=block_size,
                seed=seed,
                prompt_progress=progress,
                prefill_step_size=prefill_step_size,
                prompt_cache=cache,
            ):
                out.write(last.text)
                out.flush()
        except KeyboardInterrupt:
            out.write("\n")
            out.flush()
            progress.close()
            err.print(Text("interrupted", style="yellow"))
            if last is not None:
                note(stats_line(last, block_size))
            raise typer.Exit(130)
        finally:
            progress.close()
        out.write("\n")
        out.flush()
        if last is not None:
            err.print(Text(stats_line(last, block_size, limit), style="dim"), soft_wrap=True)
            if verbose:  # mlx-lm's closing lines, for scripts that parse them
                sys.stderr.write(
                    f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec\n"
                    f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec\n"
                    f"Peak memory: {last.peak_memory:.3f} GB\n"
                )
                sys.stderr.flush()
            if last.finish_reason == "length" and reply_tokens < max_tokens:
                note(f"stopped at {limit}: the reply cannot be longer than the context the target was trained for.")
