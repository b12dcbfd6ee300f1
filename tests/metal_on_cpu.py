"""A Metal kernel's own source, compiled by clang for this CPU and run over its grid.

What a Mac would compile (the variant's source as MLX builds it, lowered as
scripts/check_metal_kernels.py lowers it) becomes a shared library here: every
thread of a threadgroup is a fiber of one thread of this machine, a simdgroup's 32 lanes meet
at a barrier for each SIMD builtin (``simd_sum`` and ``simd_max`` take the lanes
in order, ``simd_shuffle_down`` and ``simd_shuffle_xor`` exchange within the 32),
and ``threadgroup_barrier`` waits for the whole threadgroup. half arithmetic
rounds each operation, as an Apple GPU's does (no excess precision). A test
then holds the kernel's outputs to a plain transcription of the order it claims.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

from repo_files import repo_module

# The threads of a threadgroup as fibers on one OS thread: a fiber runs until it
# waits at a barrier, then the next one runs; a barrier opens once all of its
# fibers reached it. (Deterministic, and a missing barrier shows at once: a fiber
# reads what the others have not written yet.)
FIBERS = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
namespace fibers {
struct Barrier {
  unsigned need, arrived = 0, generation = 0;
};
struct Fiber {
  ucontext_t context;
  unsigned index;
  bool done;
};
static ucontext_t scheduler;
static Fiber* current;
static unsigned long moved;  // arrivals and ends: a round of the fibers without any is a deadlock
static std::function<void(unsigned)> body;
static std::vector<char*> stacks;
constexpr size_t STACK_BYTES = 1 << 18;
// A stack with an unmapped page below it: a fiber that overflows its stack
// faults there instead of writing into the next fiber's.
static char* guarded_stack() {
  const size_t page = sysconf(_SC_PAGESIZE);
  void* at = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED || mprotect(at, page, PROT_NONE) != 0) {
    std::fputs("metal_on_cpu: no memory for a fiber's stack\n", stderr);
    std::abort();
  }
  return static_cast<char*>(at) + page;
}
static unsigned index() { return current->index; }
static void enter() {
  body(current->index);
  current->done = true;
  ++moved;
}
static void wait(Barrier& b) {
  ++moved;
  const unsigned generation = b.generation;
  if (++b.arrived == b.need) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  while (b.generation == generation) swapcontext(&current->context, &scheduler);
}
// Runs f(0) .. f(threads - 1), each a fiber, to their ends; returns how many
// were left waiting at barriers that never open (a deadlock; they are dropped).
static unsigned run(unsigned threads, std::function<void(unsigned)> f) {
  body = std::move(f);
  while (stacks.size() < threads) stacks.push_back(guarded_stack());
  std::vector<Fiber> all(threads);
  for (unsigned i = 0; i < threads; ++i) {
    all[i].index = i;
    all[i].done = false;
    getcontext(&all[i].context);
    all[i].context.uc_stack.ss_sp = stacks[i];
    all[i].context.uc_stack.ss_size = STACK_BYTES;
    all[i].context.uc_link = &scheduler;
    makecontext(&all[i].context, enter, 0);
  }
  for (unsigned left = threads; left;) {
    const unsigned long before = moved;
    for (Fiber& fiber : all) {
      if (fiber.done) continue;
      current = &fiber;
      swapcontext(&scheduler, &fiber.context);
      left -= fiber.done;
    }
    if (left && moved == before) return left;
  }
  return 0;
}
// A threadgroup's barriers: the whole group's and each simdgroup's (at most 1024 threads).
static Barrier group_bar, simd_bars[32];
// The kernel's threadgroup arrays are statics here: each threadgroup finds them
// poisoned (all bits set: NaN as a float or half), not as the last one left them.
static unsigned long group_number;
static std::map<void*, unsigned long> poisoned;
// run() over a threadgroup of ``threads`` threads, its barriers and memory fresh.
static unsigned threadgroup(unsigned threads, std::function<void(unsigned)> f) {
  ++group_number;
  group_bar = {threads};
  for (unsigned sg = 0; sg < threads / 32; ++sg) simd_bars[sg] = {32};
  return run(threads, std::move(f));
}
}  // namespace fibers
extern "C" void harness_group_barrier() { fibers::wait(fibers::group_bar); }
// Called by every thread at a threadgroup array's declaration; the first one of
// each threadgroup to get there (before any thread of it could write) poisons it.
extern "C" void harness_threadgroup_memory(void* at, unsigned long bytes) {
  unsigned long& last = fibers::poisoned[at];
  if (last == fibers::group_number) return;
  last = fibers::group_number;
  std::memset(at, 0xff, bytes);
}
"""


def with_poisoned_threadgroup_memory(text: str) -> str:
    """A lowered source whose threadgroup arrays (statics here) are poisoned
    at their declaration, once a threadgroup (FIBERS' harness_threadgroup_memory)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        names = re.findall(r"constexpr size_t metal_stub_tg_bytes_\d+ = [^;]*\(sizeof\((\w+)\) \+ 15\)", line)
        lines[i] += "".join(f" harness_threadgroup_memory((void*)&{n}, sizeof({n}));" for n in names)
    declaration = 'extern "C" void harness_threadgroup_memory(void*, unsigned long);\n'
    return declaration + "\n".join(lines)


DRIVER = (
    FIBERS
    + r"""
extern "C" void harness_thread(void** bufs, unsigned sg, unsigned lane, unsigned tgx, unsigned tgy, unsigned gx, unsigned gy);
static float slots[32][32];
static unsigned sg_now() { return fibers::index() / 32; }
static unsigned lane_now() { return fibers::index() % 32; }
static void simd_meet(float v) { slots[sg_now()][lane_now()] = v; fibers::wait(fibers::simd_bars[sg_now()]); }
static void simd_part() { fibers::wait(fibers::simd_bars[sg_now()]); }
extern "C" float harness_simd_sum(float v) {
  simd_meet(v);
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += slots[sg_now()][i];
  simd_part();
  return s;
}
extern "C" float harness_simd_max(float v) {
  simd_meet(v);
  float m = slots[sg_now()][0];
  for (int i = 1; i < 32; ++i) m = slots[sg_now()][i] > m ? slots[sg_now()][i] : m;
  simd_part();
  return m;
}
extern "C" float harness_shuffle_down(float v, unsigned delta) {
  simd_meet(v);
  const float got = lane_now() + delta < 32 ? slots[sg_now()][lane_now() + delta] : v;
  simd_part();
  return got;
}
extern "C" float harness_shuffle_xor(float v, unsigned mask) {
  simd_meet(v);
  const float got = slots[sg_now()][(lane_now() ^ mask) & 31u];
  simd_part();
  return got;
}
extern "C" unsigned harness_run(void** bufs, unsigned gx, unsigned gy, unsigned simdgroups) {
  for (unsigned tgy = 0; tgy < gy; ++tgy)
    for (unsigned tgx = 0; tgx < gx; ++tgx) {
      const unsigned stuck = fibers::threadgroup(simdgroups * 32, [=](unsigned t) { harness_thread(bufs, t / 32, t % 32, tgx, tgy, gx, gy); });
      if (stuck) return stuck;
    }
  return 0;
}
"""
)
# Definitions of the builtins the stand-in header only declares (scripts/metal_stub.h).
BUILTINS = r"""#pragma once
#include "metal_stub_decls.h"
extern "C" float harness_simd_sum(float);
extern "C" float harness_simd_max(float);
extern "C" float harness_shuffle_down(float, unsigned);
extern "C" float harness_shuffle_xor(float, unsigned);
extern "C" void harness_group_barrier();
namespace metal {
template <typename T, typename U> T simd_sum(T v) { return T(harness_simd_sum(float(v))); }
template <typename T, typename U> T simd_max(T v) { return T(harness_simd_max(float(v))); }
template <typename T, typename U> T simd_shuffle_down(T v, ushort delta) { return T(harness_shuffle_down(float(v), delta)); }
template <typename T, typename U> T simd_shuffle_xor(T v, ushort mask) { return T(harness_shuffle_xor(float(v), mask)); }
void threadgroup_barrier(mem_flags) { harness_group_barrier(); }
template <typename T, typename U> T fma(T a, T b, T c) { return __builtin_fmaf(a, b, c); }
}
"""
# A kernel's thread-position arguments, in the driver's terms.
ATTRIBUTE_VALUES = {
    "simdgroup_index_in_threadgroup": "sg",
    "thread_index_in_simdgroup": "lane",
    "thread_position_in_threadgroup": "uint3(sg * 32 + lane, 0u, 0u)",
    "threadgroup_position_in_grid": "uint3(tgx, tgy, 0u)",
    "threadgroups_per_grid": "uint3(gx, gy, 1u)",
}


def clang_with_float16():
    """A clang++ that has _Float16 on this machine (15 on), or None."""
    for name in [f"clang++-{v}" for v in range(30, 14, -1)] + ["clang++"]:
        path = shutil.which(name)
        if path:
            probe = subprocess.run([path, "-x", "c++", "-fsyntax-only", "-"], input=b"_Float16 h;", capture_output=True)
            if probe.returncode == 0:
                return path
    return None


CLANG_F16 = clang_with_float16()


def check_metal_script():
    """scripts/check_metal_kernels.py as a module (its ``lower``, ``STUB``, ``Recorder``)."""
    return repo_module("scripts/check_metal_kernels.py")


def with_thread_entry(text: str, buffers: list[str], attributes: dict[str, str], thread: str) -> str:
    """A lowered kernel source plus ``harness_thread(void** bufs, <thread>)``,
    which calls the kernel's instance with its buffer arguments read from
    ``bufs`` (in the order of ``buffers``) and its thread-position arguments
    as ``attributes`` writes them in terms of ``thread``'s parameters."""
    start = re.search(r"void (custom_kernel_\w+)\(\n", text)
    args = []
    for param in text[start.end() : text.index(") {", start.end())].split(","):
        name = re.search(r"(\w+)\s*$", param).group(1)
        kind = param[: param.rindex(name)].strip()
        args.append(f"({kind})bufs[{buffers.index(name)}]" if name in buffers else attributes[name])
    instance = re.search(r"decltype\((\w+<[^()]*>)\)", text).group(1)
    return text + f'\nextern "C" void harness_thread(void** bufs, {thread}) {{\n  {instance}({", ".join(args)});\n}}\n'


def run_grid(lib, *args) -> None:
    """``lib.harness_run(*args)``: the grid run to its end, or a failed test
    naming the threads left waiting at a barrier that never opens."""
    stuck = lib.harness_run(*args)
    assert stuck == 0, f"deadlock: {stuck} threads of a threadgroup wait at barriers that never open"


def build_on_cpu(script, source: str, buffers: list[str], tmp_path):
    """The variant's source compiled for this CPU: ``harness_run(buffers, groups x,
    groups y, simdgroups)`` runs its grid, ``buffers`` naming the kernel's buffer
    arguments in the order of the pointers passed."""
    text, problems = script.lower(source)
    assert not problems, problems
    text = with_poisoned_threadgroup_memory(text)
    shutil.copy(script.STUB, tmp_path / "metal_stub_decls.h")
    (tmp_path / "metal_stub.h").write_text(BUILTINS)
    thread = "unsigned sg, unsigned lane, unsigned tgx, unsigned tgy, unsigned gx, unsigned gy"
    (tmp_path / "kernel.cpp").write_text(with_thread_entry(text, buffers, ATTRIBUTE_VALUES, thread))
    (tmp_path / "driver.cpp").write_text(DRIVER)
    flags = ["-O1", "-fPIC", "-c"]
    kernel_flags = ["-Xclang", "-ffloat16-excess-precision=none", "-nostdinc", "-nostdinc++", "-fno-exceptions"]
    for cmd in (
        [CLANG_F16, "-std=c++17", *flags, *kernel_flags, "-fno-rtti", "-I", str(tmp_path)]
        + [str(tmp_path / "kernel.cpp"), "-o", str(tmp_path / "k.o")],
        [CLANG_F16, "-std=c++20", *flags, str(tmp_path / "driver.cpp"), "-o", str(tmp_path / "d.o")],
        [CLANG_F16, "-shared", str(tmp_path / "k.o"), str(tmp_path / "d.o"), "-o", str(tmp_path / "h.so")],
    ):
        run = subprocess.run(cmd, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
    return ctypes.CDLL(str(tmp_path / "h.so"))
