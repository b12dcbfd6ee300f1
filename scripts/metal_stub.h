// A stand-in for Apple's Metal headers, so that clang++ (C++17, no Mac) can
// check the Metal sources dflash-mlx hands MLX: scripts/check_metal_kernels.py
// compiles each variant against this with -fsyntax-only. It declares what the
// project's kernels use and Metal's near relatives of it, with Metal's own
// rules where the C++ compiler can hold them:
//
// - address spaces are real and distinct (clang's address_space attribute):
//   device, constant and threadgroup pointers do not convert to one another
//   or to thread (plain) pointers, as with Apple's compiler;
// - builtins take exactly Metal's arguments (simd_shuffle_xor(data, mask),
//   simd_sum(data), threadgroup_barrier(flags), ...), and only the types
//   Metal defines them for (no double, no pointers);
// - vector types are clang's ext vectors, built as Metal builds them
//   (float2(a, b), float2(x));
// - half is _Float16 and bfloat __fp16 (a storage type that computes in
//   float): the script targets aarch64, where both exist.
//
// What it cannot show: results, register or threadgroup-size limits of a
// compiled pipeline, or anything only Apple's compiler knows. Declarations
// only: nothing here is ever run.
#pragma once

#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread

#define INFINITY __builtin_huge_valf()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_huge_valf()
#define FLT_MAX 0x1.fffffep+127f
#define FLT_MIN 0x1p-126f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LN2_F 0.693147180559945309417f

typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __fp16 bfloat;

namespace metal {

template <bool B, typename T = void> struct enable_if {};
template <typename T> struct enable_if<true, T> { typedef T type; };
template <typename A, typename B> struct is_same { static constexpr bool value = false; };
template <typename A> struct is_same<A, A> { static constexpr bool value = true; };

template <typename T, int N> using vec = T __attribute__((ext_vector_type(N)));

// The element types Metal's arithmetic builtins take (scalars; vectors of them below).
template <typename T> struct is_scalar_number { static constexpr bool value = false; };
#define METAL_STUB_NUMBER(T) template <> struct is_scalar_number<T> { static constexpr bool value = true; };
METAL_STUB_NUMBER(float) METAL_STUB_NUMBER(half) METAL_STUB_NUMBER(bfloat) METAL_STUB_NUMBER(char)
METAL_STUB_NUMBER(signed char) METAL_STUB_NUMBER(uchar) METAL_STUB_NUMBER(short) METAL_STUB_NUMBER(ushort)
METAL_STUB_NUMBER(int) METAL_STUB_NUMBER(uint) METAL_STUB_NUMBER(long) METAL_STUB_NUMBER(ulong)
#undef METAL_STUB_NUMBER
template <typename T> struct is_floating { static constexpr bool value = false; };
template <> struct is_floating<float> { static constexpr bool value = true; };
template <> struct is_floating<half> { static constexpr bool value = true; };
template <> struct is_floating<bfloat> { static constexpr bool value = true; };

template <typename T> struct element { typedef T type; static constexpr bool scalar = true; };
template <typename T, int N> struct element<T __attribute__((ext_vector_type(N)))> {
  typedef T type;
  static constexpr bool scalar = false;
};
template <typename T> using number_t = typename enable_if<is_scalar_number<typename element<T>::type>::value, T>::type;
template <typename T> using floating_t = typename enable_if<is_floating<typename element<T>::type>::value, T>::type;
template <typename T> using scalar_number_t =
    typename enable_if<element<T>::scalar && is_scalar_number<T>::value, T>::type;

// Vector constructors, as Metal spells them: floatN() (zeros), floatN(x)
// (every element x) or floatN(e0, ..., eN-1) (the macros below route
// floatN(...) here; floatN alone stays the type). C++14 throughout, like
// Metal before 4.0.
template <typename T, int N> inline vec<T, N> make_vec() { return vec<T, N>(T(0)); }
template <typename T, int N, typename A> inline vec<T, N> make_vec(A a) { return vec<T, N>(T(a)); }
template <typename T, int N, typename A0, typename A1, typename... A> inline vec<T, N> make_vec(A0 a0, A1 a1, A... a) {
  static_assert(2 + sizeof...(A) == N, "a vector is built from one scalar or one per element");
  return vec<T, N>{T(a0), T(a1), T(a)...};
}

// Barriers and their memory flags.
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

// SIMD-group functions (exact arities; a lane or mask is a ushort).
template <typename T, typename = number_t<T>> T simd_sum(T data);
template <typename T, typename = number_t<T>> T simd_product(T data);
template <typename T, typename = number_t<T>> T simd_max(T data);
template <typename T, typename = number_t<T>> T simd_min(T data);
template <typename T, typename = number_t<T>> T simd_prefix_inclusive_sum(T data);
template <typename T, typename = number_t<T>> T simd_prefix_exclusive_sum(T data);
template <typename T, typename = number_t<T>> T simd_broadcast(T data, ushort broadcast_lane_id);
template <typename T, typename = number_t<T>> T simd_broadcast_first(T data);
template <typename T, typename = number_t<T>> T simd_shuffle(T data, ushort simd_lane_id);
template <typename T, typename = number_t<T>> T simd_shuffle_xor(T data, ushort mask);
template <typename T, typename = number_t<T>> T simd_shuffle_down(T data, ushort delta);
template <typename T, typename = number_t<T>> T simd_shuffle_up(T data, ushort delta);
template <typename T, typename = number_t<T>> T simd_shuffle_rotate_down(T data, ushort delta);
template <typename T, typename = number_t<T>> T simd_shuffle_rotate_up(T data, ushort delta);
bool simd_any(bool expr);
bool simd_all(bool expr);
bool simd_is_first();
template <typename T, typename = number_t<T>> T quad_sum(T data);
template <typename T, typename = number_t<T>> T quad_shuffle_xor(T data, ushort mask);

// Reinterpretation of a value's bits.
template <typename To, typename From> To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: the two types differ in size");
  return __builtin_bit_cast(To, x);
}

// The math functions (metal::, metal::fast::, metal::precise::): floating types, one type throughout.
#define METAL_STUB_UNARY(f) template <typename T, typename = floating_t<T>> T f(T x);
#define METAL_STUB_BINARY(f) template <typename T, typename = floating_t<T>> T f(T x, T y);
#define METAL_STUB_MATH                                                                           \
  METAL_STUB_UNARY(exp) METAL_STUB_UNARY(exp2) METAL_STUB_UNARY(exp10) METAL_STUB_UNARY(log)        \
  METAL_STUB_UNARY(log2) METAL_STUB_UNARY(log10) METAL_STUB_UNARY(sqrt) METAL_STUB_UNARY(rsqrt)     \
  METAL_STUB_UNARY(sin) METAL_STUB_UNARY(cos) METAL_STUB_UNARY(tan) METAL_STUB_UNARY(tanh)          \
  METAL_STUB_UNARY(sinh) METAL_STUB_UNARY(cosh) METAL_STUB_UNARY(asin) METAL_STUB_UNARY(acos)       \
  METAL_STUB_UNARY(atan) METAL_STUB_UNARY(fabs) METAL_STUB_UNARY(floor) METAL_STUB_UNARY(ceil)      \
  METAL_STUB_UNARY(round) METAL_STUB_UNARY(rint) METAL_STUB_UNARY(trunc) METAL_STUB_UNARY(fract)    \
  METAL_STUB_UNARY(erf) METAL_STUB_BINARY(pow) METAL_STUB_BINARY(powr) METAL_STUB_BINARY(fmax)      \
  METAL_STUB_BINARY(fmin) METAL_STUB_BINARY(atan2) METAL_STUB_BINARY(fmod) METAL_STUB_BINARY(copysign) \
  template <typename T, typename = floating_t<T>> T fma(T a, T b, T c);                             \
  template <typename T, typename = floating_t<T>> T sincos(T x, thread T& cosval);
METAL_STUB_MATH
namespace fast { METAL_STUB_MATH }
namespace precise { METAL_STUB_MATH }
#undef METAL_STUB_MATH
#undef METAL_STUB_UNARY
#undef METAL_STUB_BINARY
// Common to every number type.
template <typename T, typename = number_t<T>> T max(T x, T y);
template <typename T, typename = number_t<T>> T min(T x, T y);
template <typename T, typename = number_t<T>> T abs(T x);
template <typename T, typename = number_t<T>> T clamp(T x, T lo, T hi);
template <typename T, typename = floating_t<T>> T saturate(T x);
template <typename T, typename = floating_t<T>> T mix(T x, T y, T a);
template <typename T, typename = floating_t<T>> T step(T edge, T x);
template <typename T, typename = scalar_number_t<T>> T select(T a, T b, bool c);
template <typename T, typename = floating_t<T>> bool isnan(T x);
template <typename T, typename = floating_t<T>> bool isinf(T x);
template <typename T, typename = floating_t<T>> bool isfinite(T x);
template <typename T, int N> T dot(vec<T, N> x, vec<T, N> y);

// Matrices of the SIMD group: 8 x 8 of float, half or bfloat; each thread holds two elements.
template <typename T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix is 8 x 8");
  static_assert(is_floating<T>::value, "simdgroup_matrix holds float, half or bfloat");
  typedef vec<T, 2> elements_t;
  simdgroup_matrix() = default;
  thread elements_t& thread_elements();
  const thread elements_t& thread_elements() const;

 private:
  elements_t elements_;
};
template <typename T, int Cols, int Rows> simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value);
template <typename T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const device T* src, ulong elements_per_row = Cols,
                    vec<ulong, 2> matrix_origin = 0, bool transpose_matrix = false);
template <typename T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const threadgroup T* src, ulong elements_per_row = Cols,
                    vec<ulong, 2> matrix_origin = 0, bool transpose_matrix = false);
template <typename T, int Cols, int Rows>
void simdgroup_store(const thread simdgroup_matrix<T, Cols, Rows>& a, device T* dst, ulong elements_per_row = Cols,
                     vec<ulong, 2> matrix_origin = 0, bool transpose_matrix = false);
template <typename T, int Cols, int Rows>
void simdgroup_store(const thread simdgroup_matrix<T, Cols, Rows>& a, threadgroup T* dst,
                     ulong elements_per_row = Cols, vec<ulong, 2> matrix_origin = 0, bool transpose_matrix = false);
// d = a b + c (d and c: K columns, M rows; a: N columns, M rows; b: K columns, N rows).
template <typename TD, typename TA, typename TB, typename TC, int K, int M, int N>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, K, M>& d, const thread simdgroup_matrix<TA, N, M>& a,
                                   const thread simdgroup_matrix<TB, K, N>& b,
                                   const thread simdgroup_matrix<TC, K, M>& c);
template <typename TD, typename TA, typename TB, int K, int M, int N>
void simdgroup_multiply(thread simdgroup_matrix<TD, K, M>& d, const thread simdgroup_matrix<TA, N, M>& a,
                        const thread simdgroup_matrix<TB, K, N>& b);

template <typename T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float max() { return FLT_MAX; }
  static constexpr float min() { return FLT_MIN; }
  static constexpr float lowest() { return -FLT_MAX; }
  static constexpr float infinity() { return __builtin_huge_valf(); }
};

}  // namespace metal

// Vector types, in the global namespace as Metal has them.
#define METAL_STUB_VECTORS(T)                                                                   \
  typedef metal::vec<T, 2> T##2;                                                                \
  typedef metal::vec<T, 3> T##3;                                                                \
  typedef metal::vec<T, 4> T##4;
METAL_STUB_VECTORS(float) METAL_STUB_VECTORS(half) METAL_STUB_VECTORS(bfloat) METAL_STUB_VECTORS(int)
METAL_STUB_VECTORS(uint) METAL_STUB_VECTORS(short) METAL_STUB_VECTORS(ushort) METAL_STUB_VECTORS(char)
METAL_STUB_VECTORS(uchar) METAL_STUB_VECTORS(long) METAL_STUB_VECTORS(ulong)
#undef METAL_STUB_VECTORS
// floatN(...) builds a vector (a function-like macro expands only before "(").
#define float2(...) metal::make_vec<float, 2>(__VA_ARGS__)
#define float3(...) metal::make_vec<float, 3>(__VA_ARGS__)
#define float4(...) metal::make_vec<float, 4>(__VA_ARGS__)
#define half2(...) metal::make_vec<half, 2>(__VA_ARGS__)
#define half3(...) metal::make_vec<half, 3>(__VA_ARGS__)
#define half4(...) metal::make_vec<half, 4>(__VA_ARGS__)
#define bfloat2(...) metal::make_vec<bfloat, 2>(__VA_ARGS__)
#define bfloat4(...) metal::make_vec<bfloat, 4>(__VA_ARGS__)
#define int2(...) metal::make_vec<int, 2>(__VA_ARGS__)
#define int3(...) metal::make_vec<int, 3>(__VA_ARGS__)
#define int4(...) metal::make_vec<int, 4>(__VA_ARGS__)
#define uint2(...) metal::make_vec<uint, 2>(__VA_ARGS__)
#define uint3(...) metal::make_vec<uint, 3>(__VA_ARGS__)
#define uint4(...) metal::make_vec<uint, 4>(__VA_ARGS__)
#define ushort2(...) metal::make_vec<ushort, 2>(__VA_ARGS__)
#define ushort4(...) metal::make_vec<ushort, 4>(__VA_ARGS__)

// What MLX's kernels/utils.h (metal::utils(), before every custom kernel) adds that a kernel may use.
using namespace metal;
typedef bfloat bfloat16_t;
typedef half float16_t;

// Apple GPUs have no double (a literal such as 1.0 still converts).
#pragma clang poison double
