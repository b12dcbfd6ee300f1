"""The repository's scripts and benchmarks, which are files, not packages, loaded as modules."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repo_module(relative: str, name: str | None = None, register: bool = False):
    """The file at ``relative`` (to the repository root) as a module named
    ``name`` (its stem by default); ``register``: also in sys.modules, for a
    module whose dataclasses look their module up."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
