"""DFlash across ranks of ``mx.distributed`` (started by ``mlx.launch``).

Every rank runs the same token loop, cycle and drafter; only the target is
split, by mlx-lm's own sharding, and its adapter hands every rank the same
logits and tapped hidden states (targets/base.py). So acceptance, rollback
and the prompt cache stay exact on every rank with nothing else aware of it.

Splits: ``"pipeline"`` (each rank runs its own layers: the family's
``pipeline()``, or where mlx-lm's family has none, mlx-lm's pipeline split
applied to its layers here), ``"tensor"`` (every layer split across the
ranks, the family's ``shard()``), ``"auto"``: mlx-lm's pipeline where the
family and its adapter have it, else tensor, else our pipeline.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as sharded_layers
from mlx.utils import tree_flatten

from .device import backend

SPLITS = ("auto", "pipeline", "tensor")

_SHARDED = (
    sharded_layers.AllToShardedLinear,
    sharded_layers.ShardedToAllLinear,
    sharded_layers.QuantizedAllToShardedLinear,
    sharded_layers.QuantizedShardedToAllLinear,
)


def world() -> mx.distributed.Group | None:
    """The group ``mlx.launch`` started this process in; None when alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def is_first_rank(group: mx.distributed.Group | None) -> bool:
    """Whether this process speaks for the group (prints, writes files)."""
    return group is None or group.rank() == 0


def share_from_first_rank(obj, group: mx.distributed.Group):
    """Rank 0's ``obj`` on every rank of ``group`` (the others pass None):
    what rank 0 alone learns (a request, a line typed) that every rank must
    act on alike. Every rank blocks here until rank 0 calls it."""
    from mlx_lm.generate import generation_stream

    first = group.rank() == 0
    data = pickle.dumps(obj) if first else b""
    # On the decode loop's stream: after the last generation's exchanges,
    # which share the connection, on every rank alike.
    with mx.stream(generation_stream):
        size = mx.distributed.all_sum(mx.array(len(data), mx.int64), group=group).item()
        payload = mx.array(memoryview(data), mx.uint8) if first else mx.zeros((size,), mx.uint8)
        received = mx.distributed.all_sum(payload, group=group)
        mx.eval(received)  # rank 0 too: every rank must take part in the exchange
    return obj if first else pickle.loads(bytes(memoryview(received)))


def sum_across_ranks(value: int, group: mx.distributed.Group) -> int:
    """The sum of every rank's ``value`` (a count of ranks that found
    something wrong, say), on every rank of ``group``."""
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):  # (after any cycle's exchanges, as share_from_first_rank)
        return int(mx.distributed.all_sum(mx.array(value, mx.int32), group=group).item())


def pipeline_place(inner: nn.Module) -> tuple[int, int]:
    """(rank, size) of mlx-lm's pipeline split of ``inner`` (1 stage: (0, 1))."""
    return int(getattr(inner, "pipeline_rank", 0)), int(getattr(inner, "pipeline_size", 1))


def tensor_group(model: nn.Module) -> mx.distributed.Group | None:
    """The group that mlx-lm's ``shard()`` split ``model``'s layers over, else None."""
    for _, module in model.named_modules():
        group = getattr(module, "group", None) if isinstance(module, _SHARDED) else None
        group = group or getattr(module, "sharding_group", None)
        if group is not None and group.size() > 1:
            return group
    return None


def can_pipeline(model: nn.Module) -> bool:
    """Whether mlx-lm's family of ``model`` has its own ``pipeline()``."""
    return hasattr(getattr(model, "language_model", model), "model") and hasattr(
        getattr(model, "language_model", model).model, "pipeline"
    )


def sends_between_ranks() -> bool:
    """Whether this backend runs mx.distributed's send and recv, which a
    pipelined split passes its hidden state with (MLX's CUDA backend has none)."""
    return backend() != "cuda"


def choose_split(model: nn.Module, split: str, pipelines: bool) -> str:
    """The split to use for ``model`` (loaded lazily, unsplit); ``pipelines``:
    whether its family's adapter runs a slice of the layers."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}.")
    has_pipeline, has_tensor = pipelines, hasattr(model, "shard")
    if has_pipeline and not sends_between_ranks():
        if split == "pipeline":
            how = "use split='tensor' (--split tensor)" if has_tensor else "run it on one machine"
            raise ValueError(f"MLX's CUDA backend cannot send between ranks, which a pipelined split needs; {how}.")
        has_pipeline = False
    if split == "auto":
        split = "pipeline" if has_pipeline and (can_pipeline(model) or not has_tensor) else "tensor"
    if split == "pipeline" and not has_pipeline:
        how = "use split='tensor' (--split tensor)" if has_tensor else "run it on one machine"
        raise ValueError(f"this target's family cannot be pipelined across ranks yet; {how}.")
    if split == "tensor" and not has_tensor:
        how = "use split='pipeline' (--split pipeline)" if has_pipeline else "run it on one machine"
        raise ValueError(f"mlx-lm cannot split this target's family across ranks by tensor; {how}.")
    return split


def sharded_target(path: Path, group: mx.distributed.Group, split: str, pipelines: bool, trust_remote_code: bool):
    """(model, tokenizer) of the target at ``path``, split over ``group`` by
    mlx-lm's ``sharded_load``; ``pipelines``: as in ``choose_split``."""
    from mlx_lm.utils import load_model, sharded_load

    lazy, _ = load_model(path, lazy=True, strict=False, trust_remote_code=trust_remote_code)
    indexed = (path / "model.safetensors.index.json").is_file()
    if split in ("auto", "pipeline") and can_pipeline(lazy) and not indexed:
        if split == "pipeline":
            raise ValueError(
                f"{path} has no model.safetensors.index.json, which a pipelined load reads; "
                "save it with mlx_lm.convert or use split='tensor'."
            )
        pipelines = False
    split = choose_split(lazy, split, pipelines)
    groups = {"pipeline_group": group} if split == "pipeline" else {"tensor_group": group}
    try:
        if split == "pipeline" and not can_pipeline(lazy):
            return stage_load(path, group, trust_remote_code)
        return sharded_load(str(path), **groups, trust_remote_code=trust_remote_code)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(
            f"mlx-lm cannot split the target {path} over {group.size()} ranks ({type(e).__name__}: {e}); "
            "check that every rank has the same complete model directory."
        ) from e


def even_stages(count: int, ranks: int) -> list[int]:
    """Layers per rank of mlx-lm's ``pipeline()`` by default (rank 0 the
    last ones; the low ranks one more where they do not divide evenly)."""
    base, extra = divmod(count, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def stage_sizes(inner: nn.Module, ranks: int) -> list[int]:
    """Layers per rank (rank 0 the last ones), as mlx-lm's ``pipeline()``
    splits them, except that the layers reusing an earlier layer's keys and
    values (Gemma 4's ``previous_kvs``) stay on that layer's stage, rank 0's."""
    count = len(inner.layers)
    sizes = even_stages(count, ranks)
    reused = [source for i, source in enumerate(getattr(inner, "previous_kvs", [])) if source != i]
    first = min(reused, default=count)
    if count - sizes[0] > first:  # rank 0 starts at the first reused layer; the rest split the layers before it
        sizes = [count - first] + even_stages(first, ranks - 1)
    if min(sizes) < 1:
        why = " (layers reusing another's keys and values stay with it)" if reused else ""
        raise ValueError(
            f"this target's {count} layers cannot be split over {ranks} ranks{why}; "
            f"run it on at most {min(count, first + 1)} ranks."
        )
    return sizes


def split_stages(model: nn.Module, group: mx.distributed.Group) -> None:
    """Keep only this rank's stage of ``model``'s layers (``stage_sizes``),
    as mlx-lm's ``pipeline()`` does; ``model`` unevaluated, so the other
    stages' weights are never read or made."""
    from mlx_lm.models.pipeline import PipelineMixin

    inner = getattr(model, "language_model", model).model
    PipelineMixin.pipeline(inner, group, stage_sizes(inner, group.size()))


def stage_load(path: Path, group: mx.distributed.Group, trust_remote_code: bool):
    """(model, tokenizer) of the target at ``path`` with only this rank's
    stage of the layers read: mlx-lm's pipeline split of a family whose
    mlx-lm model has no ``pipeline()`` (the model is loaded lazily, so the
    other stages' weights are never read)."""
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(path, lazy=True, strict=False, trust_remote_code=trust_remote_code)
    split_stages(model, group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id", None))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank loaded
    return model, tokenizer


def _versions() -> dict:
    import mlx_lm

    from . import __name__ as package

    try:
        from importlib.metadata import version

        ours = version("mlx-dflash")
    except Exception:
        ours = package
    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "dflash_mlx": ours}


def _sample(array: mx.array, rows: int = 16) -> bytes:
    """The bytes of a few evenly spaced rows of ``array`` (all of a small one)."""
    if array.ndim > 1 and array.shape[0] > rows:
        step = array.shape[0] // rows
        array = array[::step][:rows]
    return memoryview(mx.contiguous(array.view(mx.uint8) if array.dtype != mx.bool_ else array)).tobytes()


def fingerprint(target, draft) -> dict[str, str]:
    """What every rank must share, each part hashed: versions, the target's
    config and split, the weights every rank keeps whole (outside the layers)
    and the drafter's."""
    text = getattr(target.model, "language_model", target.model)
    split = {
        "pipeline": target.pipeline_size,
        "tensor": 1 if target.tensor_group is None else target.tensor_group.size(),
        "layers": target.num_layers,
    }
    config = getattr(text, "args", None)
    config = vars(config) if config is not None and hasattr(config, "__dict__") else {}
    parts = {
        "versions": json.dumps(_versions(), sort_keys=True),
        "split": json.dumps(split, sort_keys=True),
        "target config": json.dumps(config, sort_keys=True, default=str),
    }
    whole = [(k, v) for k, v in tree_flatten(text.parameters()) if ".layers." not in f".{k}"]
    drafter = tree_flatten(draft.parameters()) if draft is not None else []
    for name, params in (("target weights", whole), ("drafter weights", drafter)):
        h = hashlib.sha256()
        for key, value in sorted(params, key=lambda kv: kv[0]):
            h.update(f"{key}{value.shape}{value.dtype}".encode())
            h.update(_sample(value))
        parts[name] = h.hexdigest()
    return {name: hashlib.sha256(value.encode()).hexdigest() for name, value in parts.items()}


def check_ranks_agree(group: mx.distributed.Group, target, draft) -> None:
    """Refuse, on every rank alike, a group whose ranks loaded different
    things: each rank's fingerprint goes to every other."""
    parts = fingerprint(target, draft)
    words = [int(digest[i : i + 8], 16) for digest in parts.values() for i in range(0, 64, 8)]
    mine = mx.array(words, dtype=mx.uint32)
    every = mx.distributed.all_gather(mine[None], group=group, stream=mx.cpu)
    every = every.reshape(group.size(), len(parts), 8)
    differ = mx.any(every != every[:1], axis=(0, 2)).tolist()
    names = [name for name, d in zip(parts, differ) if d]
    if names:
        raise ValueError(
            f"the {group.size()} ranks loaded different {', '.join(names)}; give every rank the same "
            "model and drafter directories and the same versions of mlx, mlx-lm and dflash-mlx."
        )


def agreed_chooser(chooser, group: mx.distributed.Group):
    """``chooser`` (auto/chooser.py's, this process's) with every choice
    rank 0's, so every rank runs the same block; ``block_size="auto"``
    across ranks needs it."""
    from .auto.chooser import BlockChooser

    class AgreedChooser(BlockChooser):
        def __init__(self):
            self.__dict__ = chooser.__dict__  # one state with the process's chooser

        def choose(self, would_build=None) -> int:
            mine = super().choose(would_build)
            from mlx_lm.generate import generation_stream

            # after the queued cycle's exchanges on every rank alike, which share the connection
            with mx.stream(generation_stream):
                picked = mx.distributed.all_sum(mx.array(mine if group.rank() == 0 else 0, mx.int32), group=group)
            return int(picked.item())

    return AgreedChooser()


class AgreedStop:
    """Ctrl-C on some ranks of ``group``, or a generation closed there, stops
    every rank after the same cycle. Inside the token loop (``run``) it only
    ``request``s the stop; each cycle launched carries ``flag()``, the ranks'
    sum of their requests, and every rank ends the loop at the first cycle it
    reads with the flag set. Every rank then has run the same exchanges."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.requested = False
        self.interrupt: KeyboardInterrupt | None = None  # raised once the loop has stopped

    def request(self, interrupt: KeyboardInterrupt | None = None) -> None:
        self.requested = True
        self.interrupt = self.interrupt or interrupt

    def flag(self) -> mx.array:
        """Queue, on the current stream, the exchange of every rank's request
        as it stands now (nonzero: some rank asked to stop)."""
        flag = mx.distributed.all_sum(mx.array(int(self.requested), mx.int32), group=self.group)
        mx.async_eval(flag)
        return flag

    def _defer(self):
        """Make Ctrl-C's handler request the stop instead of raising; return
        the handler it replaced (None: left alone, off the main thread or
        where Python's handler is not set)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        old = signal.getsignal(signal.SIGINT)
        if not callable(old):
            return None

        def handler(signum, frame):
            try:
                old(signum, frame)
            except KeyboardInterrupt as e:
                self.request(e)

        signal.signal(signal.SIGINT, handler)
        return old

    def run(self, steps: Iterator) -> Iterator:
        """``steps`` (the token loop, whose cycles carry ``flag()``) until a
        stop is requested: by Ctrl-C while it runs, by closing this generator
        or throwing KeyboardInterrupt into it. Then the loop runs on unseen
        to the flagged cycle, and a caught KeyboardInterrupt is raised."""
        # A KeyboardInterrupt raised mid-cycle would leave this rank's
        # exchanges unlike the others', so only the consumer sees the old handler.
        old = self._defer()
        try:
            for step in steps:
                if self.requested:
                    continue
                try:
                    if old is not None:
                        signal.signal(signal.SIGINT, old)
                    yield step
                except GeneratorExit:
                    self.request()
                except KeyboardInterrupt as e:
                    self.request(e)
                finally:
                    old = self._defer()
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        if self.interrupt is not None:
            raise self.interrupt
