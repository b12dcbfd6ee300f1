"""The package's shape as users and other backends meet it: what importing
it does, what a CPU run loads, and the old module paths."""

import json
import subprocess
import sys
import warnings

CPU_RUN = """
import json, sys
import dflash_mlx
before = sorted(k for k in sys.modules if k == "mlx.core" or k.startswith("dflash_mlx."))
from dflash_mlx import generate, load
from dflash_mlx.builtin import DRAFT, TARGET
model, draft, tokenizer = load(str(TARGET), draft=str(DRAFT))
generate(model, draft, tokenizer, "def f(x):", max_tokens=6, block_size=4)
print(json.dumps({"before": before, "after": sorted(k for k in sys.modules if k.startswith("dflash_mlx."))}))
"""


def test_importing_loads_nothing_and_a_cpu_run_loads_no_cuda_only_module():
    out = subprocess.run([sys.executable, "-c", CPU_RUN], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert "mlx.core" not in seen["before"]
    assert "dflash_mlx.generation" in seen["after"]
    assert not [m for m in seen["after"] if m.startswith("dflash_mlx.kernels.cuda")]


def test_an_old_module_path_is_the_new_module_with_one_warning():
    import importlib

    from dflash_mlx.auto import chooser

    sys.modules.pop("dflash_mlx.block_size", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("dflash_mlx.block_size")
        importlib.import_module("dflash_mlx.block_size")  # (a second import: no second warning)
    assert old is chooser and old.forget is chooser.forget
    moved = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(moved) == 1 and "dflash_mlx.auto.chooser" in str(moved[0].message)


def test_every_moved_name_resolves():
    import importlib

    from dflash_mlx.moved import MOVED

    for old, new in MOVED.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            assert importlib.import_module(old) is importlib.import_module(new), old


def test_no_library_function_takes_more_than_six_positional_parameters():
    """Settings travel as keywords or objects: a call reads what it sets."""
    import ast
    from pathlib import Path

    import dflash_mlx

    many = []
    for path in Path(dflash_mlx.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(positional) > 6:
                    many.append(f"{path.name}:{node.lineno} {node.name}")
    assert not many, many
