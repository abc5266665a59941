// Fused per-token ops of a transformer layer, forward only: residual add + LayerNorm, and
// bias + activation (fp16 / bf16 / fp32 storage, fp32 arithmetic).
//
// Why CUDA C++ next to the Triton kernels of ragged/kernels/triton/fused.py: at small batch a
// transformer layer is bound by host time, and a Triton launch costs 25-40 us of it on the H200
// machine against about 5 us through CuPy. The backward stays the Triton one; these kernels write
// exactly what it reads (y, s, mean, rstd), with the same numerics:
//
//   add_layer_norm: s = x + residual in fp32, rounded to the storage dtype (stored if asked for);
//   mean over the *rounded* s, var = mean((s - mean)^2) (a second pass over registers, no
//   sum-of-squares cancellation), rstd = rsqrt(var + eps), y = (s - mean) * rstd * w + b.
//
//   bias_act: y = act(x + bias[col]), act one of relu, gelu (erf), gelu_tanh, silu, none. For bf16
//   outputs gelu takes erf from a five-term rational approximation (Abramowitz & Stegun 7.1.26,
//   |error| < 1.5e-7, the size of fp32's own rounding of 1 + erf) at half the instructions of
//   erff: with erff the kernel is bound by instruction issue, not memory (41 us against 32 for
//   relu on [8384, 3072] bf16, H200; 29 us with the rational erf). The bf16 result is within one
//   ulp of torch's (fp32 erff, rounded) and equal to it for all but about 4e-5 of normally
//   distributed inputs. fp16 (three more mantissa bits: about 5% of its outputs would move by an
//   ulp) and fp32 outputs keep erff.
//
// Layout. add_layer_norm: one warp per row, RAGGED_LN_WARPS rows per block. Lane l holds the
// 16-byte vectors l, l + 32, ..., l + 32 (ITERS - 1) of its row in registers (as stored: packed
// 16-bit words for fp16 / bf16, so 4096 bf16 features take 64 registers), and the warp reduces
// with shuffles. x and residual rows may be strided (row strides in elements, multiples of the
// vector); y and s rows are contiguous. bias_act: x and y contiguous [N, F], a grid-stride loop
// over 16-byte vectors, RAGGED_BA_UNROLL vectors per thread per trip with the loads first.
// The launcher (ragged/kernels/cuda_fused.py) checks 16-byte alignment of every pointer and row
// stride, and that F is a multiple of the vector (8 elements for 16-bit types, 4 for fp32).
//
// Optional inputs / outputs are null pointers (residual, weight, bias, s, mean, rstd); a null
// test is uniform over the warp, so no divergence. Row offsets are 64-bit (N * F passes 2**31).
//
// Compiles with nvcc (csrc compile check) and NVRTC (CuPy, at first use): no headers, 16-bit
// elements handled as raw words with explicit conversions (one cvt per pair of outputs on sm_80+,
// bf16 rounding in software before; round to nearest even as torch and the GPU do).

typedef long long i64;
typedef unsigned short u16;
typedef unsigned int u32;

#define RAGGED_LN_WARPS 4
#define RAGGED_BA_THREADS 256
#define RAGGED_BA_UNROLL 4

// --------------------------------------------------------------------------------------
// Storage types: a 16-byte vector <-> VEC floats

struct Bf16 {};
struct F16 {};
struct F32 {};

__device__ __forceinline__ float bf16_to_float(u32 bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ u32 float_to_bf16(float f) {
    const u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN (torch's quiet NaN)
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;      // round to nearest, ties to even
}

__device__ __forceinline__ float f16_to_float(u32 bits) {
    float f;
    const u16 h = (u16)bits;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u32 float_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return (u32)h;
}

template <typename T>
struct Vec;

template <>
struct Vec<F32> {
    static constexpr int N = 4;
    static __device__ __forceinline__ void unpack(const uint4& v, float (&f)[N]) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
    static __device__ __forceinline__ uint4 pack(const float (&f)[N]) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
};

// Eight 16-bit elements, element 2 i in the low half of word i (little endian).
template <typename Conv>
struct Vec16 {
    static constexpr int N = 8;
    static __device__ __forceinline__ void unpack_word(u32 w, float& lo, float& hi) {
        lo = Conv::to_float(w & 0xffffu);
        hi = Conv::to_float(w >> 16);
    }
    static __device__ __forceinline__ void unpack(const uint4& v, float (&f)[N]) {
        unpack_word(v.x, f[0], f[1]);
        unpack_word(v.y, f[2], f[3]);
        unpack_word(v.z, f[4], f[5]);
        unpack_word(v.w, f[6], f[7]);
    }
    static __device__ __forceinline__ u32 pack_word(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
        return Conv::pack2(lo, hi);  // one cvt for both halves
#else
        return Conv::from_float(lo) | (Conv::from_float(hi) << 16);
#endif
    }
    static __device__ __forceinline__ uint4 pack(const float (&f)[N]) {
        return make_uint4(pack_word(f[0], f[1]), pack_word(f[2], f[3]), pack_word(f[4], f[5]), pack_word(f[6], f[7]));
    }
};

struct Bf16Conv {
    static __device__ __forceinline__ float to_float(u32 bits) { return bf16_to_float(bits); }
    static __device__ __forceinline__ u32 from_float(float f) { return float_to_bf16(f); }
#if __CUDA_ARCH__ >= 800
    // (bf16(hi) << 16) | bf16(lo), round to nearest even; a NaN becomes a quiet NaN
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 d;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
        return d;
    }
#endif
};

struct F16Conv {
    static __device__ __forceinline__ float to_float(u32 bits) { return f16_to_float(bits); }
    static __device__ __forceinline__ u32 from_float(float f) { return float_to_f16(f); }
#if __CUDA_ARCH__ >= 800
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 d;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
        return d;
    }
#endif
};

template <>
struct Vec<Bf16> : Vec16<Bf16Conv> {};
template <>
struct Vec<F16> : Vec16<F16Conv> {};

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// --------------------------------------------------------------------------------------
// add + LayerNorm: one warp per row.
//
//   x, res: rows at x + row * stride_x (elements); res may be null.
//   weight, bias: [n_cols] or null. y: [n_rows, n_cols]; sum: [n_rows, n_cols] or null.
//   mean_out, rstd_out: [n_rows] fp32 or null (inference skips them).
// The host takes the smallest ITERS with 32 * VEC * ITERS >= n_cols (n_cols a multiple of VEC).

template <typename T, int ITERS>
__device__ __forceinline__ void add_layer_norm_row(const void* __restrict__ x_, const void* __restrict__ res_,
                                                   const void* __restrict__ weight_, const void* __restrict__ bias_,
                                                   void* __restrict__ y_, void* __restrict__ sum_,
                                                   float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                                   i64 n_rows, int n_cols, i64 stride_x, i64 stride_r, float eps) {
    typedef Vec<T> V;
    constexpr int VEC = V::N;
    const i64 row = (i64)blockIdx.x * RAGGED_LN_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;  // the whole warp leaves: the shuffles below stay full-mask
    const int lane = threadIdx.x & 31;
    const int row_vecs = n_cols / VEC;
    const uint4* xr = static_cast<const uint4*>(x_) + row * (stride_x / VEC);

    // s as stored (rounded to T), in registers; vectors past the row stay zero and unused.
    uint4 s[ITERS];
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int v = i * 32 + lane;
        s[i] = v < row_vecs ? xr[v] : zero4();
    }
    if (res_ != nullptr) {
        const uint4* rr = static_cast<const uint4*>(res_) + row * (stride_r / VEC);
        uint4 r[ITERS];
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int v = i * 32 + lane;
            r[i] = v < row_vecs ? rr[v] : zero4();
        }
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            float a[VEC], b[VEC];
            V::unpack(s[i], a);
            V::unpack(r[i], b);
#pragma unroll
            for (int k = 0; k < VEC; ++k) a[k] += b[k];
            s[i] = V::pack(a);
        }
    }
    if (sum_ != nullptr) {
        uint4* sr = static_cast<uint4*>(sum_) + row * row_vecs;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int v = i * 32 + lane;
            if (v < row_vecs) sr[v] = s[i];
        }
    }

    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        if (i * 32 + lane < row_vecs) {
            float a[VEC];
            V::unpack(s[i], a);
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc += a[k];
        }
    }
    const float mean = warp_sum(acc) / (float)n_cols;
    acc = 0.f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        if (i * 32 + lane < row_vecs) {
            float a[VEC];
            V::unpack(s[i], a);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const float d = a[k] - mean;
                acc += d * d;
            }
        }
    }
    const float rstd = rsqrtf(warp_sum(acc) / (float)n_cols + eps);

    const uint4* w = static_cast<const uint4*>(weight_);
    const uint4* b = static_cast<const uint4*>(bias_);
    uint4* yr = static_cast<uint4*>(y_) + row * row_vecs;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int v = i * 32 + lane;
        if (v < row_vecs) {
            float a[VEC];
            V::unpack(s[i], a);
#pragma unroll
            for (int k = 0; k < VEC; ++k) a[k] = (a[k] - mean) * rstd;
            if (w != nullptr) {
                float t[VEC];
                V::unpack(__ldg(w + v), t);
#pragma unroll
                for (int k = 0; k < VEC; ++k) a[k] *= t[k];
            }
            if (b != nullptr) {
                float t[VEC];
                V::unpack(__ldg(b + v), t);
#pragma unroll
                for (int k = 0; k < VEC; ++k) a[k] += t[k];
            }
            yr[v] = V::pack(a);
        }
    }
    if (lane == 0) {
        if (mean_out != nullptr) mean_out[row] = mean;
        if (rstd_out != nullptr) rstd_out[row] = rstd;
    }
}

// --------------------------------------------------------------------------------------
// bias + activation (fp32 in, fp32 out)

struct ActNone {
    static __device__ __forceinline__ float apply(float z) { return z; }
};
struct ActRelu {  // NaN stays NaN, as torch's relu
    static __device__ __forceinline__ float apply(float z) { return z < 0.f ? 0.f : z; }
};
struct ActGelu {  // exact: z * Phi(z)
    static __device__ __forceinline__ float apply(float z) { return 0.5f * z * (1.f + erff(z * 0.70710678f)); }
};
// z * Phi(z) with erf(x) = 1 - (a1 t + ... + a5 t^5) exp(-x^2), t = 1 / (1 + p x), x >= 0
// (Abramowitz & Stegun 7.1.26), for bf16 outputs (see the header).
struct ActGeluRational {
    static __device__ __forceinline__ float apply(float z) {
        const float x = fabsf(z) * 0.70710678f;
        const float t = __fdividef(1.f, fmaf(0.3275911f, x, 1.f));
        float p = fmaf(1.061405429f, t, -1.453152027f);
        p = fmaf(p, t, 1.421413741f);
        p = fmaf(p, t, -0.284496736f);
        p = fmaf(p, t, 0.254829592f);
        const float erf_x = 1.f - p * t * __expf(-x * x);
        return 0.5f * z * (1.f + copysignf(erf_x, z));
    }
};
struct ActGeluTanh {
    static __device__ __forceinline__ float apply(float z) {
        return 0.5f * z * (1.f + tanhf(0.7978845608f * (z + 0.044715f * z * z * z)));
    }
};
struct ActSilu {  // z * sigmoid(z); expf of a large -z is inf, and z / inf is -0 as torch's
    static __device__ __forceinline__ float apply(float z) { return z / (1.f + expf(-z)); }
};

//   x, y: contiguous [n_vecs / row_vecs, row_vecs] 16-byte vectors; bias: [row_vecs] or null.
// Thread g takes vectors g, g + G, g + 2 G, ... (G threads in the grid), so its column moves by
// G mod row_vecs per vector: one 64-bit modulo per thread, none per vector.
template <typename T, typename Act>
__device__ __forceinline__ void bias_act_vectors(const uint4* __restrict__ x, const uint4* __restrict__ bias,
                                                 uint4* __restrict__ y, i64 n_vecs, int row_vecs) {
    typedef Vec<T> V;
    constexpr int VEC = V::N;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 step = (i64)gridDim.x * blockDim.x;
    const int col_step = (int)(step % row_vecs);
    int col = (int)(first % row_vecs);
    for (i64 v0 = first; v0 < n_vecs; v0 += RAGGED_BA_UNROLL * step) {
        uint4 in[RAGGED_BA_UNROLL];
        int cols[RAGGED_BA_UNROLL];
#pragma unroll
        for (int u = 0; u < RAGGED_BA_UNROLL; ++u) {
            const i64 v = v0 + u * step;
            in[u] = v < n_vecs ? x[v] : zero4();
            cols[u] = col;
            col += col_step;
            if (col >= row_vecs) col -= row_vecs;
        }
#pragma unroll
        for (int u = 0; u < RAGGED_BA_UNROLL; ++u) {
            const i64 v = v0 + u * step;
            if (v < n_vecs) {
                float z[VEC];
                V::unpack(in[u], z);
                if (bias != nullptr) {
                    float t[VEC];
                    V::unpack(__ldg(bias + cols[u]), t);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) z[k] += t[k];
                }
#pragma unroll
                for (int k = 0; k < VEC; ++k) z[k] = Act::apply(z[k]);
                y[v] = V::pack(z);
            }
        }
    }
}

// --------------------------------------------------------------------------------------
// extern "C" entry points (the launcher, ragged/kernels/cuda/fused.py, keeps the same tables):
//   ragged_add_layer_norm_{bf16,f16,f32}_i{ITERS}
//   ragged_bias_act_{bf16,f16,f32}_{relu,gelu,gelu_tanh,silu,none}
// NVRTC compiles each kernel on its own (ragged/kernels/cuda/launch.py): this file with the
// instantiation lines blanked, plus the one RAGGED_ADD_LAYER_NORM(...) / RAGGED_BIAS_ACT(...)
// invocation that defines it, read from those lines. So they stay top-level and unconditional,
// one macro invocation each, with plain arguments.

#define RAGGED_ADD_LAYER_NORM(TYPE, TNAME, ITERS)                                                             \
    extern "C" __global__ void __launch_bounds__(RAGGED_LN_WARPS * 32) ragged_add_layer_norm_##TNAME##_i##ITERS( \
        const void* x, const void* res, const void* weight, const void* bias, void* y, void* sum, float* mean,  \
        float* rstd, i64 n_rows, int n_cols, i64 stride_x, i64 stride_r, float eps) {                           \
        add_layer_norm_row<TYPE, ITERS>(x, res, weight, bias, y, sum, mean, rstd, n_rows, n_cols, stride_x,     \
                                        stride_r, eps);                                                         \
    }

#define RAGGED_ADD_LAYER_NORM_ITERS(ITERS)         \
    RAGGED_ADD_LAYER_NORM(Bf16, bf16, ITERS)       \
    RAGGED_ADD_LAYER_NORM(F16, f16, ITERS)         \
    RAGGED_ADD_LAYER_NORM(F32, f32, ITERS)

RAGGED_ADD_LAYER_NORM_ITERS(1)
RAGGED_ADD_LAYER_NORM_ITERS(2)
RAGGED_ADD_LAYER_NORM_ITERS(3)
RAGGED_ADD_LAYER_NORM_ITERS(4)
RAGGED_ADD_LAYER_NORM_ITERS(6)
RAGGED_ADD_LAYER_NORM_ITERS(8)
RAGGED_ADD_LAYER_NORM_ITERS(12)
RAGGED_ADD_LAYER_NORM_ITERS(16)

#define RAGGED_BIAS_ACT(TYPE, TNAME, ACT, ANAME)                                                              \
    extern "C" __global__ void __launch_bounds__(RAGGED_BA_THREADS) ragged_bias_act_##TNAME##_##ANAME(        \
        const uint4* x, const uint4* bias, uint4* y, i64 n_vecs, int row_vecs) {                              \
        bias_act_vectors<TYPE, ACT>(x, bias, y, n_vecs, row_vecs);                                            \
    }

// ACT_BF16 for bf16 outputs, ACT for fp16 and fp32 ones
#define RAGGED_BIAS_ACT_TYPES(ACT_BF16, ACT, ANAME)  \
    RAGGED_BIAS_ACT(Bf16, bf16, ACT_BF16, ANAME)     \
    RAGGED_BIAS_ACT(F16, f16, ACT, ANAME)            \
    RAGGED_BIAS_ACT(F32, f32, ACT, ANAME)

RAGGED_BIAS_ACT_TYPES(ActRelu, ActRelu, relu)
RAGGED_BIAS_ACT_TYPES(ActGeluRational, ActGelu, gelu)
RAGGED_BIAS_ACT_TYPES(ActGeluTanh, ActGeluTanh, gelu_tanh)
RAGGED_BIAS_ACT_TYPES(ActSilu, ActSilu, silu)
RAGGED_BIAS_ACT_TYPES(ActNone, ActNone, none)
