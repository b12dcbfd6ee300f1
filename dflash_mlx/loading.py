"""Loading targets and drafters from local directories or Hub repos, and the
registry of known target -> drafter pairs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import compute_dtype, distributed
from .draft import formats, precision
from .draft.dflash import DFlashDraft, DraftConfig, check_config
from .draft.dflash2 import check_draft_weights, draft_model, parse_draft_config, quantize_like
from .targets import adapt

# Targets, their mlx-lm model_type, and the drafter found for them by default.
_TARGETS: dict[str, tuple[str, str]] = {
    "Qwen/Qwen3-4B": ("qwen3", "z-lab/Qwen3-4B-DFlash-b16"),
    "Qwen/Qwen3-8B": ("qwen3", "z-lab/Qwen3-8B-DFlash-b16"),
    "meta-llama/Llama-3.1-8B-Instruct": ("llama", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": ("qwen3_moe", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    "Qwen/Qwen3-Coder-Next": ("qwen3_next", "z-lab/Qwen3-Coder-Next-DFlash"),
    "Qwen/Qwen3.5-4B": ("qwen3_5", "z-lab/Qwen3.5-4B-DFlash"),
    "Qwen/Qwen3.5-9B": ("qwen3_5", "z-lab/Qwen3.5-9B-DFlash"),
    "Qwen/Qwen3.5-27B": ("qwen3_5", "z-lab/Qwen3.5-27B-DFlash"),
    "Qwen/Qwen3.5-35B-A3B": ("qwen3_5_moe", "z-lab/Qwen3.5-35B-A3B-DFlash"),
    "Qwen/Qwen3.6-27B": ("qwen3_5", "z-lab/Qwen3.6-27B-DFlash"),
    "Qwen/Qwen3.6-35B-A3B": ("qwen3_5_moe", "z-lab/Qwen3.6-35B-A3B-DFlash"),
    "Qwen/Qwen3.8-27B": ("qwen3_5", "z-lab/Qwen3.8-27B-DFlash2"),
    "meta-models/Muse-Glimmer-30B": ("muse_glimmer", "z-lab/Muse-Glimmer-30B-DFlash2"),
    "google/gemma-4-31B-it": ("gemma4", "z-lab/gemma-4-31B-it-DFlash"),
    "openai/gpt-oss-20b": ("gpt_oss", "z-lab/gpt-oss-20b-DFlash"),
    "openai/gpt-oss-120b": ("gpt_oss", "z-lab/gpt-oss-120b-DFlash"),
    "Qwen/Qwen3.5-122B-A10B": ("qwen3_5_moe", "z-lab/Qwen3.5-122B-A10B-DFlash"),
    "google/gemma-4-26B-A4B-it": ("gemma4", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    "MiniMaxAI/MiniMax-M2.5": ("minimax", "z-lab/MiniMax-M2.5-DFlash"),
    "MiniMaxAI/MiniMax-M2.7": ("minimax", "z-lab/MiniMax-M2.7-DFlash"),
    "moonshotai/Kimi-K2.5": ("kimi_k25", "z-lab/Kimi-K2.5-DFlash"),
    "moonshotai/Kimi-K2.6": ("kimi_k25", "z-lab/Kimi-K2.6-DFlash"),
    "zai-org/GLM-5.1": ("glm_moe_dsa", "z-lab/GLM-5.1-DFlash"),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", "RedHatAI/Qwen3-30B-A3B-speculator.dflash"),
}
# Further drafters published for a known target, in other formats; named with --draft-model.
_OTHER_DRAFTERS: dict[str, tuple[str, ...]] = {
    "google/gemma-4-31B-it": (
        "RedHatAI/gemma-4-31B-it-speculator.dflash",
        "RedHatAI/gemma-4-31B-it-speculator.dflash2",
    ),
    "Qwen/Qwen3-8B": ("RedHatAI/Qwen3-8B-speculator.dflash",),
    "meta-models/Muse-Glimmer-30B": ("meta-models/Muse-Glimmer-30B-assistant",),
}
_BASE_PAIRS: dict[str, str] = {target: drafter for target, (_, drafter) in _TARGETS.items()}

# Quantized conversions share their drafter: it reads the target's hidden states.
_MLX_COMMUNITY: dict[str, tuple[str, ...]] = {
    "Qwen/Qwen3.8-27B": ("Qwen3.8-27B-4bit", "Qwen3.8-27B-8bit"),
    "meta-models/Muse-Glimmer-30B": ("Muse-Glimmer-30B-4bit",),
    "Qwen/Qwen3-4B": ("Qwen3-4B-4bit", "Qwen3-4B-6bit", "Qwen3-4B-8bit", "Qwen3-4B-bf16"),
    "Qwen/Qwen3-8B": ("Qwen3-8B-4bit", "Qwen3-8B-6bit", "Qwen3-8B-8bit", "Qwen3-8B-bf16"),
    "meta-llama/Llama-3.1-8B-Instruct": (
        "Meta-Llama-3.1-8B-Instruct-4bit",
        "Meta-Llama-3.1-8B-Instruct-8bit",
        "Meta-Llama-3.1-8B-Instruct-bf16",
    ),
}

KNOWN_PAIRS: dict[str, str] = dict(_BASE_PAIRS)
FAMILIES: dict[str, str] = {target: family for target, (family, _) in _TARGETS.items()}
for _target, _names in _MLX_COMMUNITY.items():
    for _name in _names:
        KNOWN_PAIRS[f"mlx-community/{_name}"] = _BASE_PAIRS[_target]
        FAMILIES[f"mlx-community/{_name}"] = FAMILIES[_target]

# Suffixes conversions add to a target's name.
_VARIANT_SUFFIX = re.compile(
    r"(-(mlx|\d+(\.\d+)?-?bits?|bf16|fp16|fp32|fp8|float16|bfloat16|int4|int8|mxfp4|mxfp8|nvfp4|dwq|awq|gptq|q\d(_k)?(_[ms])?))+$"
)


def known_pairs() -> list[tuple[str, str]]:
    """Every (target, drafter) pair the registry knows: each target's default
    drafter first, then the others published for it."""
    pairs = list(KNOWN_PAIRS.items())
    return pairs + [(t, d) for t, others in _OTHER_DRAFTERS.items() for d in others]


def drafter_format(drafter: str) -> str:
    """The format (formats.FORMATS) of a drafter in the registry, by its
    publisher's naming: RedHatAI's ``*.dflash`` / ``*.dflash2`` are
    speculators', ``*-assistant`` transformers-native, the rest Z Lab's."""
    name = drafter.rstrip("/").split("/")[-1]
    if name.endswith(".dflash2"):
        return formats.SPECULATORS2
    if name.endswith(".dflash"):
        return formats.SPECULATORS
    if name.endswith("-assistant"):
        return formats.ASSISTANT
    return formats.ZLAB2 if "DFlash2" in name else formats.ZLAB


def why_not_runs(target: str) -> str | None:
    """None when a known target runs today; else why not, in one sentence."""
    family = FAMILIES[target]
    if family_runs(family):
        return None
    return f"its family ({family}) has no target adapter yet."


def _base_name(name: str) -> str:
    """'mlx-community/Meta-Llama-3.1-8B-Instruct-4bit' -> 'llama-3.1-8b-instruct'."""
    name = name.rstrip("/").split("/")[-1].lower()
    name = _VARIANT_SUFFIX.sub("", name)
    return name.removeprefix("meta-")


def _repo_id_of(path: Path) -> str | None:
    """The repo id of a directory inside a huggingface_hub cache
    (.../models--org--name/snapshots/<revision>), else None."""
    for part in path.resolve().parts[::-1]:
        if part.startswith("models--"):
            return part[len("models--") :].replace("--", "/")
    return None


def find_drafter(target: str | Path) -> str | None:
    """The drafter repo id for a target repo id, a conversion of one, or a
    local directory named after one; None if the registry has none."""
    from . import builtin

    if str(target) == "builtin" or Path(target).expanduser().resolve() == builtin.TARGET:
        return str(builtin.DRAFT)
    target = str(target)
    if target in KNOWN_PAIRS:
        return KNOWN_PAIRS[target]
    names = [target]
    path = Path(target).expanduser()
    if path.is_dir():
        names = [n for n in (_repo_id_of(path), path.resolve().name) if n]
    for name in names:
        if name in KNOWN_PAIRS:
            return KNOWN_PAIRS[name]
        base = _base_name(name)
        for known, drafter in _BASE_PAIRS.items():
            if _base_name(known) == base:
                return drafter
    return None


def hub_cache() -> str | None:
    """The Hub cache directory, read at call time (huggingface_hub reads its
    environment once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def is_cached(repo_id: str) -> bool:
    """Whether ``repo_id`` is cached with its config.json and all its weights."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache())
    except Exception:  # an invalid repo id is simply not cached
        return False
    if not isinstance(found, str):
        return False
    try:
        safetensors_files(Path(found).parent)
    except ValueError:
        return False
    return True


def resolve(path_or_repo: str | Path, allow_patterns: list[str] | None = None, *, tqdm_class=None) -> Path:
    """A local directory as is; otherwise a Hub repo id fetched through
    huggingface_hub's cache (only the cache with HF_HUB_OFFLINE set)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path_or_repo} is a file; pass the model's directory or a Hub repo id.")
    if looks_local(path_or_repo):
        raise ValueError(f"{path_or_repo} does not exist; check the path (a Hub repo id looks like org/name).")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = str(path_or_repo)
    offline = hub_offline()
    try:
        return Path(
            snapshot_download(
                repo,
                allow_patterns=allow_patterns,
                cache_dir=hub_cache(),
                local_files_only=offline,
                tqdm_class=tqdm_class,
            )
        )
    except HFValidationError as e:
        raise ValueError(f"{repo} is not a local directory nor a valid Hub repo id (org/name); check the path.") from e
    except GatedRepoError as e:
        raise ValueError(
            f"{repo} is a gated Hub repo; accept its terms on huggingface.co and log in with `hf auth login`."
        ) from e
    except RepositoryNotFoundError as e:
        raise ValueError(
            f"{repo} is neither a local directory nor a Hub repo you can access; check the path or "
            "repo id (or log in with `hf auth login` for a private repo)."
        ) from e
    except RevisionNotFoundError as e:
        raise ValueError(f"{repo} has no such revision on the Hub; check the repo id.") from e
    except LocalEntryNotFoundError as e:
        if offline:
            raise ValueError(
                f"{repo} is not a local directory and is not in the Hugging Face cache, and "
                "HF_HUB_OFFLINE is set; download it once while online or unset HF_HUB_OFFLINE."
            ) from e
        raise ValueError(
            f"cannot download {repo}: the Hub is unreachable and it is not in the local cache; "
            "check your connection or pass a local directory."
        ) from e
    except OSError as e:
        raise ValueError(
            f"cannot download {repo} ({type(e).__name__}: {e}); check your connection and disk space."
        ) from e


def looks_local(name: str | Path) -> bool:
    """Whether a model argument names a local path rather than a Hub repo id."""
    name = str(name)
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def is_drafter_config(cfg: dict) -> bool:
    """Whether a config.json is a DFlash drafter's, in any format (draft/formats.py)."""
    return formats.drafter_format(cfg) is not None


def revision_of(path: Path) -> str | None:
    """The commit of a huggingface_hub cache snapshot directory, else None."""
    parts = path.resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots" and _repo_id_of(path):
        return parts[-1]
    return None


INDEX_FILE = "model.safetensors.index.json"


def _check_inside(path: Path, file: Path, what: str) -> None:
    """Refuse a weight file that resolves (symlinks followed) outside the
    checkpoint ``path``. A Hub cache snapshot's files are links into the
    repo's blobs/, so for a snapshot that repo directory is the bound."""
    root = path.resolve()
    if revision_of(path):
        root = root.parents[1]
    if not file.resolve().is_relative_to(root):
        raise ValueError(
            f"{what} resolves to {file.resolve()}, outside the checkpoint {path}; a checkpoint may only name "
            "files inside its own directory, so re-download it from a source you trust."
        )


def safetensors_files(path: Path) -> list[Path]:
    """The weight files its index names, else every *.safetensors file; each
    must lie inside ``path``."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all(isinstance(n, str) and n for n in names):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index; re-download the checkpoint.") from e
        for n in names:
            if Path(n).is_absolute() or ".." in Path(n).parts:
                raise ValueError(
                    f"{INDEX_FILE} names the weight file {n!r}, outside the checkpoint {path}; a checkpoint may "
                    "only name files inside its own directory, so re-download it from a source you trust."
                )
            _check_inside(path, path / n, f"the weight file {n!r} named in {INDEX_FILE}")
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(
                f"{path} lacks the shard(s) {', '.join(missing)} named in {INDEX_FILE}; re-download the checkpoint."
            )
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        _check_inside(path, f, f"the weight file {f.name}")
    if not files:
        repo = _repo_id_of(path)
        if repo:
            raise ValueError(
                f"the cached copy of {repo} has no weights yet; download it again while online (HF_HUB_OFFLINE unset)."
            )
        raise ValueError(f"no .safetensors files in {path}; is this a model directory?")
    return files


def read_weights(path: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in safetensors_files(path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}); re-download it.") from e
    return weights


def read_config(path: Path, role: str = "drafter") -> dict:
    """The config.json of a drafter or target directory, as a dict."""
    cfg_file = path / "config.json"
    fix = "re-download or re-convert it" if role == "drafter" else "re-download the target"
    if not cfg_file.is_file():
        what = "a DFlash drafter directory or repo" if role == "drafter" else "the target model's directory or repo id"
        raise ValueError(f"the {role} {path} has no config.json; pass {what}.")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"the {role}'s {cfg_file} is not valid JSON ({e}); {fix}.") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"the {role}'s {cfg_file} must hold a JSON object; {fix}.")
    return cfg


DRAFT_FILES = ["*.json", "*.safetensors", "*.md"]


def read_draft(path: Path) -> tuple[dict, DraftConfig, dict[str, mx.array]]:
    """(config.json as stored, its DraftConfig, the weights under module
    names) of a drafter directory in any published format."""
    raw = read_config(path)
    cfg = parse_draft_config(formats.zlab_config(raw))
    check_config(cfg)
    weights = check_draft_weights(formats.zlab_weights(raw, read_weights(path)), cfg, raw.get("quantization"))
    return raw, cfg, weights


def load_draft(path_or_repo: str | Path, *, tqdm_class=None) -> DFlashDraft:
    """A DFlash (v1 or 2) drafter in any published format (draft/formats.py),
    optionally quantized, from a directory or Hub repo."""
    path = resolve(path_or_repo, allow_patterns=DRAFT_FILES, tqdm_class=tqdm_class)
    raw, cfg, weights = read_draft(path)
    quantization = raw.get("quantization")
    model = draft_model(cfg)
    if quantization:
        quantize_like(model, weights, quantization)
    model.load_weights(list(weights.items()))
    evaluate_held(model)
    model.eval()
    return model


def evaluate_held(*modules: nn.Module) -> None:
    """Evaluate every array ``modules`` hold, parameters or not (a RoPE's
    frequency table): an array made by an op belongs to the stream of the
    thread that made it, and a server decodes on a thread of its own."""
    mx.eval([a for m in modules for _, a in tree_flatten(m) if isinstance(a, mx.array)])


def family_runs(model_type: str | None) -> bool:
    """Whether a target adapter serves ``model_type`` (or mlx-lm's remapping of it)."""
    from mlx_lm.utils import MODEL_REMAPPING

    from .targets import ADAPTERS

    return model_type in ADAPTERS or MODEL_REMAPPING.get(model_type) in ADAPTERS


def unsupported_family(model_type: str | None) -> str:
    from .targets import ADAPTERS

    return f"target model type {model_type!r} is not supported yet; supported families: {', '.join(sorted(ADAPTERS))}."


def check_target(path_or_repo: str | Path, *, tqdm_class=None, flags: bool = False) -> None:
    """Refuse, from its config.json alone, a target that cannot run: an
    unserved family, a directory that is not a model, or a drafter."""
    name = str(path_or_repo)
    if name in FAMILIES and not family_runs(FAMILIES[name]):
        raise ValueError(unsupported_family(FAMILIES[name]))
    path = resolve(path_or_repo, allow_patterns=["config.json"], tqdm_class=tqdm_class)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        if Path(name).expanduser().is_dir():
            raise ValueError(
                f"{name} is not a model directory (it has no config.json); pass the directory "
                "holding the target's config.json and weights, or a Hub repo id."
            )
        return  # load_target says what the repo lacks
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return  # mlx-lm explains a broken target better
    if not isinstance(cfg, dict):
        return
    if is_drafter_config(cfg):
        where = "--draft-model, and its target as --model" if flags else "draft=, and its target first"
        raise ValueError(f"{name} is a DFlash drafter, not a target model; pass it as {where}.")
    model_type = cfg.get("model_type")
    if not family_runs(model_type):
        raise ValueError(unsupported_family(model_type))


def check_adapter_path(adapter_path: str | Path) -> None:
    path = Path(adapter_path).expanduser()
    if not (path / "adapter_config.json").is_file():
        what = "does not exist" if not path.exists() else "has no adapter_config.json"
        raise ValueError(
            f"the adapter path {adapter_path} {what}; pass the directory mlx_lm.lora wrote "
            "(adapter_config.json and adapters.safetensors)."
        )


def load_target(
    path_or_repo: str | Path,
    *,
    lazy: bool = False,
    tqdm_class=None,
    adapter_path: str | Path | None = None,
    trust_remote_code: bool = False,
):
    """(model, tokenizer) of a target, by mlx-lm, from a directory or Hub repo;
    ``adapter_path``: LoRA adapters (mlx_lm.lora's) applied to it."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    if adapter_path is not None:
        check_adapter_path(adapter_path)
    path = resolve(path_or_repo, allow_patterns=DEFAULT_ALLOW_PATTERNS, tqdm_class=tqdm_class)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; pass the target model's directory or Hub repo id.")
    try:
        return mlx_lm_load(
            str(path),
            lazy=lazy,
            adapter_path=None if adapter_path is None else str(adapter_path),
            tokenizer_config={"trust_remote_code": True} if trust_remote_code else None,
            trust_remote_code=trust_remote_code,
        )
    except Exception as e:
        what = f"the target {path_or_repo}" + ("" if adapter_path is None else f" with the adapters in {adapter_path}")
        raise ValueError(
            f"mlx-lm cannot load {what} ({type(e).__name__}: {e}); check that it is a complete model directory."
        ) from e


def load(
    path_or_repo: str | Path,
    draft: str | Path | None = None,
    *,
    lazy: bool = False,
    tqdm_class=None,
    adapter_path: str | Path | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    flags: bool = False,
    group=None,
    split: str = "auto",
    draft_bits: int | str | None = "auto",
):
    """Load a target with mlx-lm and its DFlash drafter (by default the one
    the registry knows; ``"builtin"`` names the packaged pair).

    Returns (model, draft, tokenizer), the drafter bound to the model.
    ``dtype``: what the pair computes in (see compute_dtype.py); ``flags``:
    errors name the command line's flags instead of the Python arguments.
    ``group``: an ``mx.distributed`` group of more than one rank splits the
    target over its ranks by mlx-lm's sharding, ``split`` saying how
    (distributed.py); every rank must call this alike. ``draft_bits``: the
    drafter's linear layers quantized to 4 or 8 bits, None as stored, or
    ``"auto"``: beside a quantized target, quantized where this machine
    measured it faster (draft/precision.py; not when split over ranks)."""
    precision.check(draft_bits, flags)
    if str(path_or_repo) == "builtin":
        from . import builtin

        path_or_repo = builtin.TARGET
    if adapter_path is not None:
        check_adapter_path(adapter_path)
    compute_dtype.check(dtype, flags)
    # Check the target's config and the drafter before paying for the target's
    # weights; a Hub target only once a drafter is known (no wasted download).
    local = Path(str(path_or_repo)).expanduser().exists() or looks_local(path_or_repo)
    if local:
        check_target(path_or_repo, tqdm_class=tqdm_class, flags=flags)
    if draft is None:
        draft = find_drafter(path_or_repo)
        if draft is None:
            how = (
                "pass its drafter with --draft-model (`dflash-mlx models` lists the known pairs)"
                if flags
                else "pass draft=<drafter directory or Hub repo id> (known_pairs() lists the known pairs)"
            )
            raise ValueError(f"no known DFlash drafter for {path_or_repo}; {how}.")
    if not local:
        check_target(path_or_repo, tqdm_class=tqdm_class, flags=flags)
    drafter = load_draft(draft, tqdm_class=tqdm_class)
    precision.refuse_conflict(drafter, draft_bits, flags)
    sharded = group is not None and group.size() > 1
    if sharded:
        model, tokenizer = load_sharded_target(path_or_repo, group, split, adapter_path, trust_remote_code)
    else:
        model, tokenizer = load_target(
            path_or_repo,
            lazy=lazy,
            tqdm_class=tqdm_class,
            adapter_path=adapter_path,
            trust_remote_code=trust_remote_code,
        )
    # Cast before the adapter fuses projections and checks kernels for the dtype.
    compute_dtype.apply(model, drafter, dtype, evaluate=not lazy)
    target = adapt(model)
    if sharded:
        distributed.check_ranks_agree(group, target, drafter)
    drafter.bind(target)
    # Every rank must draft alike: a split target keeps what the ranks loaded.
    precision.apply(drafter, model, None if sharded and draft_bits == "auto" else draft_bits)
    if not lazy:
        evaluate_held(model, drafter)
    return model, drafter, tokenizer


def load_sharded_target(path_or_repo, group, split: str, adapter_path=None, trust_remote_code: bool = False):
    """(model, tokenizer) of a target split over ``group``'s ranks by mlx-lm
    (distributed.py); only the ranks' own layers are read under a pipeline."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    from .targets import ADAPTERS

    if split not in distributed.SPLITS:
        raise ValueError(f"split must be one of {', '.join(distributed.SPLITS)}, not {split!r}.")
    if adapter_path is not None:
        raise ValueError(
            "LoRA adapters cannot be applied to a target split across ranks yet; fuse them first (mlx_lm.fuse)."
        )
    path = resolve(path_or_repo, allow_patterns=DEFAULT_ALLOW_PATTERNS)
    model_type = read_config(path, "target").get("model_type")
    from mlx_lm.utils import MODEL_REMAPPING

    adapter = ADAPTERS.get(model_type) or ADAPTERS.get(MODEL_REMAPPING.get(model_type))
    if adapter is None:
        raise ValueError(unsupported_family(model_type))
    return distributed.sharded_target(path, group, split, adapter.pipelines(), trust_remote_code)
