"""`dflash-mlx serve`: the OpenAI- and Anthropic-compatible HTTP server."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import options
from .console import UserError, note, speak_on_first_rank_only, user_errors
from .option_groups import Kv, Pair, Sampling, Template, check_drafter_block, flags, takes_groups
from .pair import model_or_builtin

EXAMPLES = """\
Examples:

$ dflash-mlx serve

$ dflash-mlx serve --model Qwen/Qwen3-8B --port 8080 --temp 0.6 --top-p 0.95

$ dflash-mlx serve --model ./qwen3-8b --draft-model ./qwen3-8b-dflash --host 0.0.0.0 --api-key secret

$ dflash-mlx serve --model Qwen/Qwen3-8B --kv-bits 8 --quantized-kv-start 0

$ mlx.launch --hostfile hosts.json dflash-mlx serve --model ./kimi-k2.5-4bit --split auto

Then point any OpenAI or Anthropic client at http://127.0.0.1:8080/v1 (see docs/server.md).
Under mlx.launch the target is split across the ranks and rank 0 listens (docs/distributed.md).
"""

# The server's sampling flags: no XTC or --num-draft-tokens here.
SAMPLING_FLAGS = ("max_tokens", "temp", "top_p", "top_k", "min_p", "seed", "block_size", "lookup", "tree_budget")
# What the server's flags set for every request (ServerConfig's fields).
SERVED = ("temperature", "top_p", "top_k", "min_p", "seed", "block_size", "lookup", "tree_budget")

PrefixCacheDir = Annotated[
    Optional[Path],
    typer.Option(
        "--prefix-cache-dir",
        help="Keep prompt caches on disk in this directory too, across requests and restarts "
        "(e.g. ~/.cache/dflash-mlx/prefix-cache); off without it.",
        show_default=False,
    ),
]
PrefixCacheGB = Annotated[
    float,
    typer.Option(
        "--prefix-cache-gb", help="Most the --prefix-cache-dir directory holds, in GB (least recently used out)."
    ),
]


def check_prefix_cache(directory: Optional[Path], gb: float) -> None:
    if directory is not None and not gb > 0:
        raise UserError(f"--prefix-cache-gb must be more than 0, got {gb:g}.")


# uvicorn's log levels (it takes them in any case)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def check_listen(host: str, port: int) -> None:
    """That ``host``:``port`` can be bound now, as uvicorn binds it, so that a
    port in use or an address not on this machine is one sentence, not
    uvicorn's log and exit status 3."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror:
            raise UserError(
                f"--host {host} is not an address or a name this machine resolves; pass one such as 127.0.0.1."
            ) from None
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(
                    f"port {port} on {host} is in use; choose another --port, or stop what listens there."
                ) from None
            raise UserError(
                f"cannot listen on {host}:{port} ({e.strerror}); choose another --host or --port."
            ) from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: Optional[str], flag: str = "--prompt-cache-bytes") -> Optional[int]:
    """'8GB', '512MB', '1e9'-free plain byte counts: bytes, or None."""
    if text is None:
        return None
    m = _SIZE.match(text)
    if not m:
        raise UserError(f"{flag} must be a size such as 4GB or 512MB, got {text!r}.")
    scale = 1024 ** "bkmgt".index((m.group(2) or "b").lower())
    return int(float(m.group(1)) * scale)


@takes_groups
def serve_command(
    *,
    pair: Pair = flags(Pair),
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on; 0.0.0.0 opens the server to the network.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8080,
    sampling: Sampling = flags(Sampling, *SAMPLING_FLAGS, max_tokens=512),
    api_key: Annotated[
        Optional[str],
        typer.Option(
            "--api-key", help="Require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY').", show_default=False
        ),
    ] = None,
    prompt_cache_size: Annotated[
        int,
        typer.Option("--prompt-cache-size", help="Most prompt caches kept for reuse across requests; 0 keeps none."),
    ] = 10,
    prompt_cache_bytes: Annotated[
        Optional[str],
        typer.Option(
            "--prompt-cache-bytes", help="Most memory the kept prompt caches may hold, e.g. 8GB.", show_default=False
        ),
    ] = None,
    prefix_cache_dir: PrefixCacheDir = None,
    prefix_cache_gb: PrefixCacheGB = 20.0,
    template: Template = flags(Template, "chat_template_config", "use_default_chat_template"),
    model_name: Annotated[
        Optional[str],
        typer.Option(
            "--model-name",
            help="The model id clients send and /v1/models lists; defaults to --model, or 'builtin'.",
            show_default=False,
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option("--log-level", help="uvicorn's log level: critical, error, warning, info, debug.")
    ] = "info",
    prefill_step_size: options.PrefillStepSize = 2048,
    kv: Kv = flags(Kv),
    batching: Annotated[
        str,
        typer.Option(
            "--batching",
            help="Several requests waiting: batch them through mlx-lm's plain decoding where that measured faster "
            "than DFlash one at a time (auto), never (off), or always.",
        ),
    ] = "auto",
    max_batch: Annotated[int, typer.Option("--max-batch", help="Most requests one batch decodes at once.")] = 8,
    max_body_bytes: Annotated[
        str, typer.Option("--max-body-bytes", help="Largest request body accepted, e.g. 16MB; a larger one gets a 413.")
    ] = "16MiB",
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue", help="Most requests waiting for the decode worker; more get a 503 with Retry-After."
        ),
    ] = 64,
    allowed_host: Annotated[
        Optional[list[str]],
        typer.Option(
            "--allowed-host",
            help="A Host name requests may give besides the bound address and loopback (repeatable; '*' allows any).",
            show_default=False,
        ),
    ] = None,
    split: options.Split = "auto",
    verbose: options.Verbose = False,
):
    """Serve the pair over HTTP: OpenAI chat completions and completions, Anthropic messages.

    Requests are taken in arrival order, one at a time through DFlash or, with
    several waiting, batched where that measured faster; prompt caches are reused
    across requests that share a prefix, every one made with the --kv-* and
    --max-kv-size settings. Binds to 127.0.0.1 unless --host says otherwise.
    """
    from dflash_mlx import distributed

    group = distributed.world()
    speak_on_first_rank_only(group)
    with user_errors(verbose):
        generation = sampling.check(prefill_step_size, drafter=pair.draft_model != "none")
        if not 0 < port < 65536:
            raise UserError(f"--port must be between 1 and 65535, got {port}.")
        if prompt_cache_size < 0:
            raise UserError(f"--prompt-cache-size must be 0 or more, got {prompt_cache_size}.")
        if max_queue < 1:
            raise UserError(f"--max-queue must be 1 or more, got {max_queue}.")
        if batching not in ("auto", "off", "always"):
            raise UserError(f"--batching must be auto, off or always, got {batching!r}.")
        if max_batch < 1:
            raise UserError(f"--max-batch must be 1 or more, got {max_batch}.")
        if log_level.lower() not in LOG_LEVELS:
            raise UserError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}.")
        if api_key is not None and not api_key.strip():
            raise UserError("--api-key is empty; pass the key clients must send, or leave --api-key out.")
        body_limit = parse_size(max_body_bytes, "--max-body-bytes")
        if body_limit < 1024:
            raise UserError(f"--max-body-bytes must be at least 1KB, got {max_body_bytes!r}.")
        kv.check()
        check_prefix_cache(prefix_cache_dir, prefix_cache_gb)
        try:
            from dflash_mlx.server import ServerConfig, create_app, run
            from dflash_mlx.server.ranks import Follower
        except ImportError as e:
            raise UserError(
                f"the server needs its extra ({e.name} is missing): pip install 'dflash-mlx[server]'."
            ) from None
        served = {name: generation[name] for name in SERVED}
        config = ServerConfig(
            model_name=model_name or pair.model or "builtin",
            max_tokens=sampling.max_tokens,
            **served,
            prefill_step_size=prefill_step_size,
            api_key=api_key,
            chat_template_args=template.kwargs(),
            prompt_cache_size=prompt_cache_size,
            prompt_cache_bytes=parse_size(prompt_cache_bytes),
            prefix_cache_dir=None if prefix_cache_dir is None else str(prefix_cache_dir),
            prefix_cache_gb=prefix_cache_gb,
            **asdict(kv),
            max_body_bytes=body_limit,
            max_queue=max_queue,
            host=host,
            allowed_hosts=tuple(allowed_host or ()),
            batching=batching,
            max_batch=max_batch,
        )
        if group is None:
            target, draft, tokenizer = pair.load(model_or_builtin(pair.model, pair.draft_model))
        else:
            config.check_across_ranks()
            target, draft, tokenizer = pair.load_split(group, split)
        check_drafter_block(generation["block_size"], draft)
        template.prepare(tokenizer)
        first = distributed.is_first_rank(group)
        try:  # rank 0 serves HTTP, every other rank follows it
            app = create_app(target, draft, tokenizer, config, group) if first else None
            follower = None if first else Follower(target, draft, tokenizer, config, group)
        except ValueError as e:  # KV settings this target cannot use (make_prompt_cache's sentence)
            raise UserError(options.flag_names(str(e))) from None
        if follower is not None:
            # Ctrl-C reaches every rank that mlx.launch started from a terminal: rank 0 alone
            # ends the serving, and its stop ends this loop once the job every rank runs is done
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            follower.run()
        else:
            check_listen(host, port)
            note(f"serving {config.model_name} on http://{host}:{port}/v1 (OpenAI) and /v1/messages (Anthropic)")
            run(app, host=host, port=port, log_level=log_level)
    # The server has shut down (worker joined, sockets closed). Decoding ran in
    # a worker thread, and MLX's per-thread streams can abort the interpreter's
    # teardown ("terminate called without an active exception"), so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
