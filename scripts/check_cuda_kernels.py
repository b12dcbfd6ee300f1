"""Compile dflash-mlx's CUDA kernels with NVRTC on a machine without a GPU.

    pip download --no-deps -d /tmp/cuda "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*" "nvidia-cuda-cccl==13.*"
    for w in /tmp/cuda/*.whl; do python -m zipfile -e "$w" /tmp/cuda/x; done
    python scripts/check_cuda_kernels.py --cuda /tmp/cuda/x/nvidia/cu13

A kernel's source reaches NVRTC only when MLX's CUDA backend first launches
it, on a GPU. This script gets there sooner: it builds each kernel object
(block attention, the q/k norm + RoPE, the block products, and each module of
KERNEL_MODULES, e.g. the quantized verify product) with a recording
factory in place of ``mx.fast.cuda_kernel``, drives it through its own
self-check cases on the CPU (every dtype, head dim, window, launch shape and
bias its check covers; block attention's and the norm + RoPE's over a block
and a draft tree), and compiles each variant it recorded, wrapped as MLX
wraps a custom kernel (its parameters, shapes, strides and template
constants; MLX's device header replaced by a small stand-in), for
``--arch``. A syntax or type error, a name a body uses but no header defines,
shows here instead of as a failed self-check on the device. What it does not
show: results, speed, or anything that depends on MLX's own header.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Modules whose record_variants launches every variant of their kernel.
from dflash_mlx.kernels import RECORDED_MODULES as KERNEL_MODULES  # noqa: E402

CUDA_TYPES = {
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.float32: "float",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.bool_: "bool",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
}


# In place of MLX's "mlx/backend/cuda/device/utils.cuh": the types the
# generated parameters use.
STAND_IN = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/limits>
#include <cooperative_groups.h>
struct Shape { int d[10]; __device__ int operator[](int i) const { return d[i]; } };
struct Strides { long long d[10]; __device__ long long operator[](int i) const { return d[i]; } };
#define inf cuda::std::numeric_limits<float>::infinity()
"""


class Recorder:
    """A stand-in for mx.fast.cuda_kernel: keeps what each kernel was made
    with and launched with; a launch returns zeros of the output shapes."""

    def __init__(self):
        self.variants: dict[str, str] = {}

    def factory(
        self, *, name, input_names, output_names, source, header="", ensure_row_contiguous=True, shared_memory=0, **_
    ):
        def launch(*, inputs, template=(), output_shapes, output_dtypes, **_):
            src = wrap(name, header, source, input_names, inputs, output_names, output_dtypes, template)
            tags = "".join(f"_{str(v).split('.')[-1]}" for _, v in template)
            self.variants.setdefault(name + tags, src)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch


def wrap(name, header, source, input_names, inputs, output_names, output_dtypes, template) -> str:
    """The source MLX would compile for this launch (mlx/backend/cuda/custom_kernel.cpp's layout)."""
    params = []
    for n, a in zip(input_names, inputs):
        params.append(f"const {CUDA_TYPES[a.dtype]}* {n}")
        if a.ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + suffix in source:
                    params.append(f"const __grid_constant__ {kind} {n}{suffix}")
    params += [f"{CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    consts = []
    for k, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {str(v).lower()};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};")
        else:
            consts.append(f"  using {k} = {CUDA_TYPES[v]};")
    return (
        STAND_IN + header + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        f"__global__ void {name}(\n    "
        + ",\n    ".join(params)
        + ") {\n"
        + "\n".join(consts)
        + "\n"
        + source
        + "\n}\n}\n"
    )


def nvrtc(cuda_root: str):
    found = sorted(glob.glob(os.path.join(cuda_root, "lib", "libnvrtc.so*")))
    found = [f for f in found if "builtins" not in f]
    if not found:
        raise SystemExit(
            f"no libnvrtc.so under {cuda_root}/lib: point --cuda at an unpacked nvidia-cuda-nvrtc "
            "wheel's nvidia/cu13 (see this script's docstring)."
        )
    return ctypes.CDLL(found[0])


def compile_source(lib, src: str, cuda_root: str, arch: str) -> tuple[bool, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernel.cu", 0, None, None) != 0:
        return False, "nvrtcCreateProgram failed"
    opts = [
        f"--gpu-architecture={arch}".encode(),
        b"--std=c++17",
        f"-I{cuda_root}/include".encode(),
        f"-I{cuda_root}/include/cccl".encode(),
    ]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace").strip()


def record_all(recorder: Recorder, modules=KERNEL_MODULES) -> None:
    """Every variant the kernels' self-checks launch, recorded; then every
    variant of each module in ``modules`` (its ``record_variants`` hook)."""
    from dflash_mlx.kernels import dispatch, norm_rope
    from dflash_mlx.kernels.attention import BlockAttentionKernel
    from dflash_mlx.kernels.cuda import products as block_products
    from dflash_mlx.kernels.ops import DTYPES, HEAD_DIMS

    attention = BlockAttentionKernel("cuda", factory=recorder.factory)
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for windowed in (False, True):
                for q, k, v, kw in dispatch._check_cases(dtype, d, windowed):
                    attention(q, k, v, **kw)
                for q, k, v, kw in dispatch._tree_check_cases(dtype, d, windowed):
                    attention(q, k, v, causal=True, **kw)
            rope = norm_rope.NormRopeKernel("cuda", factory=recorder.factory)
            for q, k, qn, kn, rp, offset in norm_rope._check_cases(dtype, d):
                rope(q, k, qn.weight, kn.weight, eps=qn.eps, scale=rp.scale, base=rp.base, offset=offset)
    products = block_products.BlockProductKernel("cuda", factory=recorder.factory)
    for dtype in block_products.DTYPES:
        for x, w, bias, residual, heads in block_products.check_cases(dtype):
            products(x, w, bias, residual, heads=heads)
        for x, w in block_products.swiglu_check_cases(dtype):
            products(x, w, swiglu=True)
        for x, w, bias, residual, norm, swiglu in block_products.norm_check_cases(dtype, swiglu=True):
            products(x, w, bias, residual, swiglu=swiglu, norm=norm)
    for name in modules:
        importlib.import_module(name).record_variants(recorder.factory, "cuda")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", required=True, help="a CUDA include/lib root: an unpacked nvidia wheel's nvidia/cu13")
    ap.add_argument("--arch", default="sm_90", help="NVRTC's --gpu-architecture (sm_90: H100/H200)")
    args = ap.parse_args()
    lib = nvrtc(args.cuda)
    recorder = Recorder()
    record_all(recorder)
    failed = 0
    for name, src in sorted(recorder.variants.items()):
        ok, log = compile_source(lib, src, args.cuda, args.arch)
        failed += not ok
        print(f"{'ok    ' if ok else 'FAILED'} {name}")
        if not ok:
            print("\n".join("    " + line for line in log.splitlines()[:30]))
    print(f"{len(recorder.variants) - failed} of {len(recorder.variants)} variants compiled for {args.arch}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
