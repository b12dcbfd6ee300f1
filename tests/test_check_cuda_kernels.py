"""scripts/check_cuda_kernels.py without NVRTC: the recording factory
captures every variant the kernels' self-checks launch, each wrapped as MLX
wraps a custom kernel."""

import re

import mlx.core as mx
from repo_files import repo_module


def load_script():
    return repo_module("scripts/check_cuda_kernels.py")


def test_every_kernel_family_and_launch_shape_is_recorded_and_wrapped():
    script = load_script()
    recorder = script.Recorder()
    script.record_all(recorder)
    names = list(recorder.variants)
    for family in (
        "dflash_block_attn_partial_tiles",
        "dflash_block_attn_partial_",
        "dflash_block_attn_merge",
        "dflash_norm_rope_v",
        "dflash_block_product_bf16",
        "dflash_block_product_f16",
    ):
        assert any(n.startswith(family) for n in names), family
    from dflash_mlx.kernels.cuda import products as bp

    for shape in (bp.SHAPE, bp.WIDE_SHAPE, bp.LONG_K_SHAPE):
        tag = "_" + "_".join(map(str, shape)) + "_"
        # (a plain product's variant: names end in SWIGLU, HAS_NORM, EPS_BITS)
        assert any(
            n.startswith("dflash_block_product_bf16") and tag in n and n.endswith("_False_False_0") for n in names
        ), shape
    src = next(
        v
        for n, v in recorder.variants.items()  # (a bias and a residual)
        if n.startswith("dflash_block_product_bf16") and n.endswith("True_True_False_False_0")
    )
    # MLX's layout: typed pointers, the shapes the body reads, outputs, then the template constants
    signature = re.search(r"__global__ void (\w+)\((.*?)\) \{", src, re.S).group(2)
    assert [p.strip() for p in signature.split(",")] == [
        "const __nv_bfloat16* x",
        "const __grid_constant__ Shape x_shape",
        "const __nv_bfloat16* w",
        "const __grid_constant__ Shape w_shape",
        "const __nv_bfloat16* b",
        "const __nv_bfloat16* r",
        "const __nv_bfloat16* nw",
        "__nv_bfloat16* y",
    ]
    assert "using T = __nv_bfloat16;" in src and "constexpr bool HAS_BIAS = true;" in src
    assert "constexpr bool HAS_RESIDUAL = true;" in src and "constexpr bool SWIGLU = false;" in src
    # the SwiGLU epilogue: its own variant, two tiles a warp
    swiglu = next(
        v
        for n, v in recorder.variants.items()
        if n.startswith("dflash_block_product_bf16") and n.endswith("False_False_True_False_0")
    )
    assert "constexpr bool SWIGLU = true;" in swiglu and "constexpr int NT = 2;" in swiglu
    # the RMSNorm prologue: its epsilon's float32 bits a template constant, alone and with the SwiGLU
    eps = bp.float_bits(1e-6)
    normed = [
        v
        for n, v in recorder.variants.items()
        if n.startswith("dflash_block_product_bf16") and n.endswith(f"_True_{eps}")
    ]
    assert any("constexpr bool SWIGLU = true;" in v for v in normed)
    assert any("constexpr bool SWIGLU = false;" in v for v in normed)
    assert all("constexpr bool HAS_NORM = true;" in v and f"constexpr int EPS_BITS = {eps};" in v for v in normed)


def test_a_launch_returns_zeros_of_its_output_shapes():
    script = load_script()
    launch = script.Recorder().factory(name="k", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
    (out,) = launch(inputs=[mx.ones((3,))], output_shapes=[(2, 5)], output_dtypes=[mx.float16])
    assert out.shape == (2, 5) and out.dtype == mx.float16 and not out.any().item()


def test_every_quantized_product_variant_is_recorded_and_wrapped():
    from dflash_mlx.kernels import quantized

    script = load_script()
    recorder = script.Recorder()
    script.record_all(recorder)
    names = [n for n in recorder.variants if n.startswith("dflash_quantized_product")]
    # one row tile on CUDA at three outputs a warp (as N needs), two words a lane a step (qmv's),
    # and the affine variants' two dequantizations (one rounding or two)
    affine = sum(mode == "affine" for *_, mode in quantized.all_variants())
    assert len(names) == (len(list(quantized.all_variants())) + affine) * 3
    src = recorder.variants[f"dflash_quantized_product_v{quantized.VERSION}_bfloat16_uint8_4_32_True_2_False_4_4_8_4"]
    assert "using S = uint8_t;" in src and "constexpr bool MXFP4 = true;" in src
    fused = recorder.variants[
        f"dflash_quantized_product_v{quantized.VERSION}_float16_float16_4_64_False_2_True_4_2_8_4"
    ]
    assert "constexpr bool FUSED = true;" in fused and "using T = __half;" in fused
    signature = re.search(r"__global__ void (\w+)\((.*?)\) \{", src, re.S).group(2)
    assert [p.strip() for p in signature.split(",")] == [
        "const __nv_bfloat16* x",
        "const __grid_constant__ Shape x_shape",
        "const uint32_t* w",
        "const __grid_constant__ Shape w_shape",
        "const uint8_t* scales",
        "const __nv_bfloat16* biases",
        "__nv_bfloat16* y",
    ]


def test_every_kernel_module_listed_records_its_variants():
    """A kernel joins the check by its module's name in KERNEL_MODULES (its record_variants hook)."""
    script = load_script()
    assert "dflash_mlx.kernels.gated_delta" in script.KERNEL_MODULES
    for module in script.KERNEL_MODULES:
        recorder, bare = script.Recorder(), script.Recorder()
        script.record_all(recorder, modules=[module])
        script.record_all(bare, modules=[])
        assert set(recorder.variants) - set(bare.variants), module


def test_every_exact_product_variant_is_recorded_and_wrapped():
    """The exact verify product: each dtype, CUDA one-row order (4, 2 or 1
    values a lane), multiply-add form, row tile and bias, wrapped as MLX wraps it."""
    from dflash_mlx.kernels import exact_products

    script = load_script()
    assert "dflash_mlx.kernels.exact_products" in script.KERNEL_MODULES
    recorder = script.Recorder()
    script.record_all(recorder, modules=["dflash_mlx.kernels.exact_products"])
    names = [n for n in recorder.variants if n.startswith("dflash_exact_product")]
    tiles = len(exact_products.TILES)
    assert len(names) == len(exact_products.DTYPES) * 3 * len(exact_products.FORMS["cuda"]) * tiles * 2
    at = exact_products.launch_for("cuda", exact_products.Order(32, 2, 1, False), 16)
    src = recorder.variants[
        f"dflash_exact_product_v{exact_products.VERSION}_bfloat16_32_2_1_False_1_{at.rows}_{at.outputs}_{at.groups}_True_{at.ahead}"
    ]
    signature = re.search(r"__global__ void (\w+)\((.*?)\) \{", src, re.S).group(2)
    assert [p.strip() for p in signature.split(",")] == [
        "const __nv_bfloat16* x",
        "const __grid_constant__ Shape x_shape",
        "const __nv_bfloat16* w",
        "const __grid_constant__ Shape w_shape",
        "const __nv_bfloat16* bias",
        "__nv_bfloat16* y",
    ]
    assert "constexpr int VPT = 2;" in src and "constexpr int FORM = 1;" in src and "__shfl_down_sync" in src
    assert f"constexpr int AHEAD = {at.ahead};" in src


def test_every_tree_variant_of_the_self_check_is_recorded_and_wrapped():
    """Both partial passes over a draft tree, each dtype, head dim and window
    the check covers, causal; ancestors and depths after the block's inputs."""
    from dflash_mlx.kernels import attention_tiles, ops

    script = load_script()
    recorder = script.Recorder()
    script.record_all(recorder, modules=[])
    tiles = [n for n in recorder.variants if n.startswith("dflash_block_attn_partial_tiles_tree_")]
    simt = [n for n in recorder.variants if n.startswith("dflash_block_attn_partial_tree_")]
    for d in ops.HEAD_DIMS:
        for window in (0, 45):
            kt = attention_tiles.TILE_KEYS["cuda"][d]
            for dtype in ("bfloat16", "float16"):
                assert any(n.startswith(f"dflash_block_attn_partial_tiles_tree_{dtype}_{d}_") for n in tiles)
                assert any(n.endswith(f"_True_{window}_{kt}_2") for n in tiles if f"_{dtype}_{d}_" in n), (dtype, d)
            assert any(f"float32_{d}_" in n and n.endswith(f"_True_{window}_4") for n in simt), (d, window)
    assert all("_True_" in n for n in tiles + simt)  # (causal, every one)
    src = recorder.variants[tiles[0]]
    signature = re.search(r"__global__ void (\w+)\((.*?)\) \{", src, re.S).group(2)
    params = [p.strip() for p in signature.split(",")]
    at = params.index("const float* params")
    assert params[at + 1 : at + 5] == [
        "const bool* ancestors",
        "const __grid_constant__ Strides ancestors_strides",
        "const int32_t* depths",
        "const __grid_constant__ Strides depths_strides",
    ]
    assert "__device__ __forceinline__ unsigned int warp_or(" in src and "#define tree_sees(" in src
