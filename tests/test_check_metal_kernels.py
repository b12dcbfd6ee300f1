"""scripts/check_metal_kernels.py: every Metal variant decoding can launch,
rebuilt as MLX builds it and compiled by clang++ against scripts/metal_stub.h;
and three planted errors (an undeclared name, a threadgroup pointer where a
device one is expected, a builtin given the wrong number of arguments) that
it must catch."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from repo_files import repo_module

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_metal_kernels.py"


def load_script():
    return repo_module("scripts/check_metal_kernels.py")


script = load_script()
CLANG = script.find_clang()
needs_clang = pytest.mark.skipif(
    CLANG is None, reason="no clang++ on PATH (apt-get install -y clang): the Metal sources cannot be compiled here"
)


def test_variants_are_named_and_wrapped_as_mlx_does():
    recorder = script.Recorder()
    script.record_all(recorder, dtypes=[mx.bfloat16, mx.float32], head_dims=[64])
    names = list(recorder.variants)
    for family in (
        "dflash_block_attn_partial_tiles",
        "dflash_block_attn_partial",
        "dflash_block_attn_merge",
        "dflash_norm_rope_v",
        "dflash_block_attn_partial_tiles_tree",
        "dflash_block_attn_partial_tree",
    ):
        assert any(v.kernel.startswith(family) for v in recorder.variants.values()), family
    # every warps count the SIMT pass picks at head dim 64 (16 at most) and the tiles' 1, 2, 4
    for nw in range(1, 17):
        assert f"custom_kernel_dflash_block_attn_partial__float_64_{nw}_1_0_4_" in "".join(names), nw
    for nw in (1, 2, 4):
        assert any(
            n.startswith(f"custom_kernel_dflash_block_attn_partial_tiles__bfloat16_t_64_{nw}_1_0_32_2_") for n in names
        ), nw
    # a model's window, and the merge's partials and sinks in constant memory (under 8 elements) or device
    assert any("_64_4_1_128_32_2_" in n for n in names)
    merges = [n for n in names if "merge" in n]
    assert any(n.endswith("_64_1_float_floatc_floatc_floatc_bfloat16_t") for n in merges)
    assert any(n.endswith("_64_1_float_float_float_float_bfloat16_t") for n in merges)
    src = recorder.variants[
        "custom_kernel_dflash_block_attn_merge__bfloat16_t_64_1_float_floatc_floatc_floatc_bfloat16_t"
    ].source
    assert "template <typename T, int D, bool HAS_SINKS>\n[[kernel]] void custom_kernel_dflash_block_attn_merge_" in src
    assert "  const device float* o_part [[buffer(0)]],\n  const constant float* m_part [[buffer(1)]],\n" in src
    assert "  const constant int* m_part_shape [[buffer(2)]],\n" in src
    assert "  uint3 threadgroups_per_grid [[threadgroups_per_grid]]) {\n" in src
    assert src.rstrip().endswith("<bfloat16_t, 64, 1>;")


def test_launch_limits():
    variant = script.Variant("k", "")
    variant.launches = {
        ((128, 1, 1), (128, 1, 1)),
        ((2048, 1, 1), (2048, 1, 1)),
        ((96, 1, 1), (48, 1, 1)),
        ((100, 1, 1), (64, 1, 1)),
    }
    problems = "\n".join(script.launch_problems(variant))
    assert "2048 threads > 1024" in problems and "48 threads, not whole simdgroups" in problems
    assert "grid (100, 1, 1) is not whole threadgroups (64, 1, 1)" in problems
    assert "(128, 1, 1)" not in problems


@needs_clang
def test_the_script_compiles_the_variants_it_is_asked_for_within_limits():
    """The merge kernels' variants, end to end through the script; CI runs it over
    every variant (.ci/run), once for each Metal language standard."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--only", "merge"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert "Metal variants compiled" in last and "all within limits" in last, last
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True)
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert len(names) > 1000 and all(name.startswith("custom_kernel_") for name in names)  # (listed, not compiled)
    assert int(last.split()[0]) == sum("merge" in name for name in names) > 0


def check_subset(only, most=3, **kw):
    """Record one dtype and head dim over a few row counts and compile the
    first ``most`` variants whose names hold ``only`` (seconds, not the whole set)."""
    recorder = script.Recorder()
    script.record_all(recorder, **{"dtypes": [mx.bfloat16], "head_dims": [64], "rows": [16], **kw})
    picked = sorted(n for n in recorder.variants if only in n)[:most]
    recorder.variants = {n: recorder.variants[n] for n in picked}
    assert recorder.variants
    compiler = script.Compiler(CLANG)
    lines = []
    try:
        failed = script.check_all(recorder, compiler, report=lines.append)
    finally:
        compiler.close()
    return failed, "\n".join(lines), len(recorder.variants)


@needs_clang
def test_a_wrong_name_fails(monkeypatch):
    from dflash_mlx.kernels import norm_rope

    monkeypatch.setattr(norm_rope, "BODY", norm_rope.BODY.replace("ss = simd_sum(ss);", "ss = simd_sum(sss);"))
    failed, log, n = check_subset("norm_rope")
    assert len(failed) == n and "use of undeclared identifier 'sss'" in log, log


@needs_clang
def test_a_wrong_address_space_fails(monkeypatch):
    from dflash_mlx.kernels import attention_tiles

    # stage8 copies device memory into threadgroup memory: hand it the threadgroup tile as its source
    body = attention_tiles.BODY.replace("valid ? kg + j * ROWS_PER_PASS * D : kfirst, valid", "kd, valid")
    assert body != attention_tiles.BODY
    monkeypatch.setattr(attention_tiles, "BODY", body)
    failed, log, n = check_subset("partial_tiles")
    assert len(failed) == n and "no matching function for call to 'stage8'" in log, log
    # (clang's words: a device pointer parameter, a threadgroup (address space 3) argument)
    assert "'device __fp16 const *' of 2nd parameter does not match" in log, log
    assert "'__attribute__((address_space(3))) __fp16 *' of argument" in log, log


@needs_clang
def test_a_wrong_builtin_arity_fails(monkeypatch):
    from dflash_mlx.kernels import attention_tiles

    header = attention_tiles.HEADER["metal"].replace("simd_shuffle_xor(v, ushort(8))", "simd_shuffle_xor(v)")
    assert header != attention_tiles.HEADER["metal"]
    monkeypatch.setitem(attention_tiles.HEADER, "metal", header)
    failed, log, n = check_subset("partial_tiles")
    assert len(failed) == n and "no matching function for call to 'simd_shuffle_xor'" in log, log
    assert "requires 2 arguments, but 1 was provided" in log, log


@needs_clang
def test_the_merge_reads_partials_in_constant_memory(monkeypatch):
    """The merge once read its partials through `const device float*`, which fails where MLX
    passes them in constant memory (fewer than 8 elements: one chunk of 1-7 rows)."""
    from dflash_mlx.kernels import attention_source

    failed, log, n = check_subset("floatc_floatc_floatc", rows=[1, 5])
    assert not failed, log
    monkeypatch.setitem(attention_source.PARTS_PTR, "metal", "const DEV float*")
    failed, log, n = check_subset("floatc_floatc_floatc", rows=[1, 5])
    assert len(failed) == n, failed
    assert "cannot initialize a variable of type 'DEV float const *'" in log, log


@needs_clang
def test_threadgroup_memory_over_32_kib_fails(monkeypatch):
    from dflash_mlx.kernels import attention_tiles

    # 128 keys a staged tile at head dim 64: 2 x 2 x 128 x 72 x 2 bytes = 72 KiB
    monkeypatch.setitem(attention_tiles.TILE_KEYS["metal"], 64, 128)
    failed, log, n = check_subset("partial_tiles")
    assert len(failed) == n and "threadgroup memory over 32768 bytes" in log, log
    assert "metal_stub_threadgroup_memory<73728>" in log, log


def test_every_quantized_product_variant_is_recorded():
    """Each dtype, quantization (affine 4/8 bits in groups of 32/64/128, mxfp4), step
    (Metal's qmv_fast and qmv orders) and row tile of the quantized verify product,
    through its module's record_variants hook."""
    from dflash_mlx.kernels import quantized

    recorder = script.Recorder()
    script.record_all(recorder, dtypes=[mx.bfloat16], head_dims=[64], rows=[16])
    names = [n for n in recorder.variants if "dflash_quantized_product" in n]
    # (eight row tiles: each tile's most outputs a simdgroup and each fewer an N may need; words a lane a step)
    assert len(names) == len(list(quantized.all_variants())) * 8 * 2
    prefix = f"custom_kernel_dflash_quantized_product_v{quantized.VERSION}__"
    assert prefix + "bfloat16_t_uint8_t_4_32_1_2_0_32_2_4_16_bfloat16_t_uint32_t_uint8_t_bfloat16_t_bfloat16_t" in names
    assert prefix + "float16_t_float16_t_8_128_0_1_0_4_8_4_4_float16_t_uint32_t_float16_t_float16_t_float16_t" in names
    # no input in the constant address space: the body indexes every one as device memory
    assert not any(n.endswith("c") or "c_" in n.split("__")[1] for n in names)


@needs_clang
def test_the_quantized_products_weights_in_registers_are_thread_memory(monkeypatch):
    """The per-lane arithmetic reads the weights from thread registers: handing it
    the device weights instead is caught, as Apple's compiler would."""
    from dflash_mlx.kernels import quantized_source

    failed, log, n = check_subset("quantized_product", most=2)
    assert not failed, log
    body = quantized_source.BODY.replace("(acc[m][r], xv, wq[r])", "(acc[m][r], xv, w)")
    assert body != quantized_source.BODY
    monkeypatch.setattr(quantized_source, "BODY", body)
    failed, log, n = check_subset("quantized_product", most=2)
    assert len(failed) == n and "no matching function for call to 'qv_add'" in log, log


def test_every_kernel_module_listed_records_its_variants():
    """A kernel joins the check by its module's name in KERNEL_MODULES (its record_variants hook)."""
    assert "dflash_mlx.kernels.gated_delta" in script.KERNEL_MODULES
    for module in script.KERNEL_MODULES:
        recorder = script.Recorder()
        script.record_modules(recorder, "metal", modules=[module])
        assert recorder.variants, module


@needs_clang
def test_the_exact_products_variants_compile_and_a_wrong_arity_fails(monkeypatch):
    """The exact verify product's variants of each Metal one-row order (SN 32
    with BN 1 and 8, whose parts meet in threadgroup memory, and SN 4) compile;
    a shuffle given one argument too few fails every one of them."""
    from dflash_mlx.kernels import exact_products, exact_products_source

    assert "dflash_mlx.kernels.exact_products" in script.KERNEL_MODULES

    def compile_orders():
        recorder = script.Recorder()
        script.record_modules(recorder, "metal", modules=["dflash_mlx.kernels.exact_products"])
        prefix = f"custom_kernel_dflash_exact_product_v{exact_products_source.VERSION}__bfloat16_t_"
        # each order's 32-row launch (BN 8's x rows cut to 4, so that a chunk of x fits)
        picked = []
        for lanes, split in ((32, 1), (32, 8), (4, 1)):
            at = exact_products.launch_for("metal", exact_products.Order(lanes, 4, split, True), 32)
            picked.append(f"{prefix}{lanes}_4_{split}_1_0_{at.rows}_{at.outputs}_{at.groups}_0_")
        recorder.variants = {n: v for n, v in recorder.variants.items() if any(n.startswith(p) for p in picked)}
        assert len(recorder.variants) == 3, sorted(recorder.variants)
        compiler = script.Compiler(CLANG)
        lines = []
        try:
            failed = script.check_all(recorder, compiler, report=lines.append)
        finally:
            compiler.close()
        return failed, "\n".join(lines), len(recorder.variants)

    failed, log, n = compile_orders()
    assert not failed, log
    header = exact_products_source.HEADER["metal"].replace("simd_shuffle_down(v, ushort(o))", "simd_shuffle_down(v)")
    assert header != exact_products_source.HEADER["metal"]
    monkeypatch.setitem(exact_products.HEADER, "metal", header)
    failed, log, n = compile_orders()
    assert len(failed) == n and "simd_shuffle_down" in log, log


def test_every_tree_variant_is_recorded():
    """A draft tree's passes: every warps count either pass picks for 1-64
    nodes at one query head or eight, no window or a model's, the ancestors
    and depths in constant memory (trees of 1 or 2 nodes, MLX's rule) or
    device; causal only."""
    import re

    recorder = script.Recorder()
    script.record_all(recorder, dtypes=[mx.bfloat16, mx.float32], head_dims=[64])
    tiles = [n for n in recorder.variants if "_partial_tiles_tree__" in n]
    simt = [n for n in recorder.variants if "_partial_tree__" in n]
    for nw in (1, 2, 4):
        for window in (0, 128):
            assert any(f"_tiles_tree__bfloat16_t_64_{nw}_1_{window}_32_2_" in n for n in tiles), (nw, window)
    for nw in range(1, 17):
        assert any(f"_partial_tree__float_64_{nw}_1_0_4_" in n for n in simt), nw
    # (T, D, NW, CAUSAL, ...): every tree launch is causal
    assert all(re.search(r"__(?:bfloat16_t|float)_64_\d+_1_", n) for n in tiles + simt)
    # ancestors (bool) and depths (int32) after params
    assert any(n.endswith("_floatc_boolc_int32_tc_float_float_float") for n in tiles)
    assert any(n.endswith("_floatc_bool_int32_t_float_float_float") for n in tiles)
    src = recorder.variants[next(n for n in tiles if n.endswith("_boolc_int32_tc_float_float_float"))].source
    assert "  const constant bool* ancestors [[buffer(" in src and "const constant int64_t* ancestors_strides" in src


@needs_clang
def test_the_tree_variants_compile_and_a_wrong_name_in_the_tree_rows_fails(monkeypatch):
    from dflash_mlx.kernels import attention_source

    for only in ("partial_tiles_tree", "partial_tree__float"):
        failed, log, n = check_subset(only, most=2, dtypes=[mx.bfloat16, mx.float32])
        assert not failed, log
    rows = attention_source.TREE_ROWS.replace("word_[w] = warp_or(", "word_[w] = warp_or_(")
    assert rows != attention_source.TREE_ROWS
    monkeypatch.setattr(attention_source, "TREE_ROWS", rows)
    failed, log, n = check_subset("partial_tree__float", most=2, dtypes=[mx.float32])
    assert len(failed) == n and "use of undeclared identifier 'warp_or_'" in log, log
