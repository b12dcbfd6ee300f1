"""dflash-mlx's HTTP API: OpenAI chat completions, completions and
responses, Anthropic messages, and Prometheus metrics, over the DFlash
decode loop, one request at a time.

    from dflash_mlx import load
    from dflash_mlx.server import ServerConfig, create_app, run
    model, draft, tokenizer = load("builtin")
    run(create_app(model, draft, tokenizer, ServerConfig(model_name="builtin")), port=8080)

Needs the `server` extra: pip install "dflash-mlx[server]".
"""

from .app import create_app, run, running_in_thread
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app", "run", "running_in_thread"]
