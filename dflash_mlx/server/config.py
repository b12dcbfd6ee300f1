"""The server's settings (ServerConfig: its flags' defaults for every
request, its limits, its caches) and the decode loop they set up
(``make_decoder``), which every rank of a split server makes alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dflash_mlx import make_prompt_cache
from dflash_mlx.arguments import check_lookup, check_tree_budget
from dflash_mlx.cache.store import PrefixStore
from dflash_mlx.generation import served_tree_budget
from dflash_mlx.targets import adapt

from .cache_pool import PromptCachePool
from .decoder import Decoder
from .metrics import Metrics


@dataclass
class ServerConfig:
    model_name: str = "default_model"
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    block_size: int | str | None = None
    lookup: bool | str = False  # prompt lookup (stream_generate's): False, True or "auto"
    tree_budget: int | str | None = None  # draft trees (stream_generate's): None, rows a cycle, or "auto"
    prefill_step_size: int = 2048
    api_key: Optional[str] = None
    chat_template_args: dict = field(default_factory=dict)
    prompt_cache_size: int = 10
    prompt_cache_bytes: Optional[int] = None
    # the prefix cache on disk (off without a directory): its bound, and the shortest prefix it keeps
    prefix_cache_dir: Optional[str] = None
    prefix_cache_gb: float = 20.0
    prefix_cache_min_tokens: int = 256
    # every prompt cache of the pool is made with these (make_prompt_cache's meanings)
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    max_kv_size: Optional[int] = None
    # limits on what one client can ask of the server
    max_body_bytes: int = 16 * 1024 * 1024
    max_queue: int = 64  # requests waiting for the worker; more get a 503
    prepare_timeout_s: float = 30.0  # reading a body, rendering and tokenizing its prompt
    # the Host names requests may give besides loopback and ``host`` ("*": any)
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    stored_responses: int = 256  # finished /v1/responses kept for previous_response_id
    # several requests waiting: "auto" batches them (mlx-lm's plain decoding) where that measures
    # faster than DFlash one at a time, "off" never, "always" whenever it can; at most max_batch at once
    batching: str = "auto"
    max_batch: int = 8

    def check_across_ranks(self) -> None:
        """Refuse what a target split across ranks cannot serve: each rank would
        decide batches, and the disk tier's writes, alone (docs/distributed.md)."""
        if self.batching == "always":
            raise ValueError(
                "--batching always cannot run across ranks (only DFlash's jobs reach every rank); "
                "use --batching auto or off under mlx.launch."
            )
        if self.prefix_cache_dir is not None:
            raise ValueError(
                "--prefix-cache-dir cannot be used across ranks (each rank would write and read it on its own); "
                "leave it out under mlx.launch."
            )


def context_length(model) -> Optional[int]:
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def make_decoder(model, draft, tokenizer, config: ServerConfig, metrics: Optional[Metrics] = None) -> Decoder:
    """The decode loop ``config`` sets up: its settings checked, over a pool
    of prompt caches made its way (and its prefix store on disk, if any).
    Every rank of a split server makes its own alike (server/ranks.py)."""
    check_lookup(config.lookup, draft is not None)
    check_tree_budget(config.tree_budget, draft is not None)

    target = adapt(model)  # one adapter for every cache the server makes

    def new_cache():
        return make_prompt_cache(
            target,
            draft,
            kv_bits=config.kv_bits,
            kv_group_size=config.kv_group_size,
            quantized_kv_start=config.quantized_kv_start,
            max_kv_size=config.max_kv_size,
        )

    # settings this pair cannot use: a ValueError now, not on every request
    tree_budget = served_tree_budget(target, new_cache(), config.tree_budget)
    store = None
    if config.prefix_cache_dir is not None:
        store = PrefixStore(
            config.prefix_cache_dir,
            int(config.prefix_cache_gb * 1e9),
            new_cache,
            min_tokens=config.prefix_cache_min_tokens,
        )
    pool = PromptCachePool(new_cache, config.prompt_cache_size, config.prompt_cache_bytes, store)
    bounded = config.max_kv_size is not None
    return Decoder(
        model,
        draft,
        tokenizer,
        pool,
        block_size=config.block_size,
        prefill_step_size=config.prefill_step_size,
        read_limit=context_length(model) if bounded else None,
        metrics=metrics,
        lookup=config.lookup,
        tree_budget=tree_budget,
    )
