"""Modules that moved: importing one by its old name gives the new module,
with one FutureWarning naming its new place."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "dflash_mlx.speculative": "dflash_mlx.generation",
    "dflash_mlx.cycle": "dflash_mlx.decode.cycle",
    "dflash_mlx.sampling": "dflash_mlx.decode.sampling",
    "dflash_mlx.traces": "dflash_mlx.decode.traces",
    "dflash_mlx.draft2": "dflash_mlx.draft.dflash2",
    "dflash_mlx.block_size": "dflash_mlx.auto.chooser",
    "dflash_mlx.block_memory": "dflash_mlx.auto.memory",
    "dflash_mlx.kv_cache": "dflash_mlx.kv.buffer",
    "dflash_mlx.kv_cache_quantized": "dflash_mlx.kv.quantized",
    "dflash_mlx.kv_cache_rotating": "dflash_mlx.kv.rotating",
    "dflash_mlx.prompt_cache": "dflash_mlx.cache.prompt",
    "dflash_mlx.prompt_cache_file": "dflash_mlx.cache.files",
    "dflash_mlx.targets.attention": "dflash_mlx.layers.attention",
    "dflash_mlx.targets.fused": "dflash_mlx.layers.fused",
    "dflash_mlx.targets.layers": "dflash_mlx.layers.blocks",
    "dflash_mlx.kernels.kernel": "dflash_mlx.kernels.attention",
    "dflash_mlx.kernels.block_products": "dflash_mlx.layers.linear",
    "dflash_mlx.weights_convert": "dflash_mlx.convert",
    "dflash_mlx.weights_convert.convert": "dflash_mlx.convert.weights",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there.", FutureWarning, stacklevel=3)
        module = importlib.import_module(MOVED[spec.name])
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
