// Fused attention for short sequences, forward only (fp16 / bf16, head dims 32, 64, 128).
//
// The regime: many sequences of a few dozen tokens (B = 256 of 8..32 tokens, H = 12, D = 64),
// where a flash-attention kernel spends its time on bookkeeping. Here one thread block takes one
// (sequence b, query head h) pair and does everything in one pass:
//
//   1. cp.async copies the sequence's K and V rows (key/value head h / group) into shared
//      memory, each warp its own 16-row strip of Q; rows past the sequence are zero-filled by
//      the copy itself (src-size 0), so tokens of other sequences are never read;
//   2. S = Q K^T with mma.sync m16n8k16 (fp32 accumulators), fragments through ldmatrix;
//   3. masking (length, bottom-right causal) and the softmax in fp32 registers (exp2 with the
//      scale folded in, row max / row sum across the four lanes of a quad);
//   4. O = P V with mma.sync, P taken straight from the S accumulators (the C fragment of two
//      8-key tiles is the A fragment of one 16-key step), V through ldmatrix.trans;
//   5. O / l goes back through the warp's Q strip in shared memory, then out in 16-byte rows;
//      lse (natural log) per row; a row that sees no key gets O = 0 and lse = -inf.
//
// Sizes. A warp owns a 16-query strip; a block of W warps covers 16 W queries per round and
// loops over rounds for longer sequences. Keys go through shared memory in chunks of C rows
// (C = 32, 64 or 128; the launcher takes the smallest C >= max_seqlen_k, so the usual case is a
// single chunk, loaded once for all rounds); longer key ranges take several chunks with the
// online-softmax rescale in between. Only the 16-key steps a strip can see are computed (the
// chunk's length, and the causal diagonal). Shared memory rows are padded by 16 bytes (D + 8
// elements) so that ldmatrix and the 4-byte output staging stores are free of bank conflicts;
// all of it is static (at most 46 KB per block, under the 48 KB limit without opt-in).
//
// Inputs: q [Tq, H, D], k / v [Tk, H_kv, D], rows contiguous in D and 16-byte aligned (the
// launcher copies otherwise); token and head strides in elements. Offsets cu_q / cu_k [B+1] are
// int32 or int64 (bit 0 / bit 1 of `offsets64`). Output out [Tq, H, D] contiguous, lse [Tq, H]
// float32. Index arithmetic on tokens is 64-bit (T * H * D can pass 2**31).
//
// Needs sm_80+ (bf16 mma.sync, cp.async, ldmatrix). Compiles with nvcc (csrc compile check) and
// NVRTC (CuPy, at first use): no headers, elements handled as raw 16-bit words.

typedef long long i64;
typedef unsigned short u16;
typedef unsigned int u32;

#define RAGGED_LN2 0.6931471805599453f

// --------------------------------------------------------------------------------------
// PTX wrappers

struct Bf16 {};
struct F16 {};

template <typename T>
struct Mma;

template <>
struct Mma<Bf16> {
    // c += a (16x16, row) * b (16x8, col), fp32 accumulators.
    static __device__ __forceinline__ void run(float* c, const u32* a, u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats -> one 32-bit word of two elements, `lo` in the low half (round to nearest).
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

template <>
struct Mma<F16> {
    static __device__ __forceinline__ void run(float* c, const u32* a, u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

__device__ __forceinline__ u32 smem_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, asynchronously; bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void copy16_async(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 matrices of 16-bit elements; lane i gives the row address of matrix i / 8, row i % 8.
__device__ __forceinline__ void ldmatrix_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ float exp2_approx(float x) {  // 2**x; -inf -> 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ i64 load_offset(const void* offsets, int wide, int i) {
    return wide ? (i64)__ldg(static_cast<const long long*>(offsets) + i)
                : (i64)__ldg(static_cast<const int*>(offsets) + i);
}

// Rows [0, rows) of a tile of D columns into shared memory at `dst` (row stride RS elements);
// rows >= valid are zero-filled. Threads tid, tid + nthreads, ... each move 16 bytes at a time.
template <int D, int RS>
__device__ __forceinline__ void load_tile(u32 dst, const u16* src, i64 stride, int valid, int rows, int tid,
                                          int nthreads) {
    constexpr int VPR = D / 8;  // 16-byte vectors per row
    for (int i = tid; i < rows * VPR; i += nthreads) {
        const int r = i / VPR, c = i % VPR;
        const bool ok = r < valid;
        const u16* p = src + (ok ? (i64)r * stride : (i64)0) + c * 8;
        copy16_async(dst + (u32)((r * RS + c * 8) * 2), p, ok ? 16 : 0);
    }
}

// --------------------------------------------------------------------------------------
// The kernel body: D head dim, C key rows per chunk, W warps.

template <typename T, int D, int C, int W>
__device__ __forceinline__ void attention_short(const u16* __restrict__ q, const u16* __restrict__ k,
                                                const u16* __restrict__ v, u16* __restrict__ out,
                                                float* __restrict__ lse, const void* cu_q, const void* cu_k,
                                                int offsets64, int heads, int group, i64 sq_t, i64 sq_h, i64 sk_t,
                                                i64 sk_h, i64 sv_t, i64 sv_h, float scale_log2, int causal) {
    constexpr int RS = D + 8;  // shared row stride (elements): 16 bytes of padding
    constexpr int KD = D / 16;  // 16-wide steps over the head dim
    constexpr int NS = C / 8;   // 8-key tiles of S per chunk
    constexpr int NO = D / 8;   // 8-column tiles of O
    const float neg_inf = __int_as_float(0xff800000);

    __shared__ __align__(16) u16 s_q[W * 16 * RS];
    __shared__ __align__(16) u16 s_k[C * RS];
    __shared__ __align__(16) u16 s_v[C * RS];

    const int b = blockIdx.x / heads;
    const int h = blockIdx.x - b * heads;
    const i64 q_start = load_offset(cu_q, offsets64 & 1, b);
    const int lq = (int)(load_offset(cu_q, offsets64 & 1, b + 1) - q_start);
    if (lq <= 0) return;
    const i64 k_start = load_offset(cu_k, offsets64 & 2, b);
    const int lk = (int)(load_offset(cu_k, offsets64 & 2, b + 1) - k_start);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: row group, column pair
    const int hk = h / group;
    const u16* qh = q + q_start * sq_t + (i64)h * sq_h;
    const u16* kh = k + k_start * sk_t + (i64)hk * sk_h;
    const u16* vh = v + k_start * sv_t + (i64)hk * sv_h;

    const int n_strips = (lq + 15) >> 4;
    const int n_chunks = (lk + C - 1) / C;
    const int shift = lk - lq;  // causal: query i sees keys j <= i + shift

    u16* strip_smem = s_q + warp * 16 * RS;
    const u32 q_addr = smem_address(strip_smem);
    const u32 k_addr = smem_address(s_k);
    const u32 v_addr = smem_address(s_v);
    // Per-lane ldmatrix offsets (bytes): Q as the A operand (rows lane % 16, columns 8 (lane / 16));
    // K as the col-major B operand of two 8-key tiles (keys lane % 8 + 8 (lane / 16), columns
    // 8 ((lane / 8) % 2)); V transposed (keys lane % 8 + 8 ((lane / 8) % 2), columns 8 (lane / 16)).
    const u32 q_lane = (u32)(((lane & 15) * RS + ((lane >> 4) << 3)) * 2);
    const u32 k_lane = (u32)((((lane & 7) + ((lane >> 4) << 3)) * RS + (((lane >> 3) & 1) << 3)) * 2);
    const u32 v_lane = (u32)((((lane & 7) + (((lane >> 3) & 1) << 3)) * RS + ((lane >> 4) << 3)) * 2);

    for (int s0 = 0; s0 < n_strips; s0 += W) {
        const int strip = s0 + warp;
        const bool active = strip < n_strips;  // warp-uniform
        const int row0 = strip * 16;
        __syncwarp();  // the strip's shared rows of the last round are read
        if (active) load_tile<D, RS>(q_addr, qh + (i64)row0 * sq_t, sq_t, min(16, lq - row0), 16, lane, 32);
        copy_commit();

        float o[NO][4];
#pragma unroll
        for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
        float m0 = neg_inf, m1 = neg_inf, l0 = 0.f, l1 = 0.f;  // rows g and g + 8 (log2 units)
        // Keys [0, seen) may be visible to some row of the strip.
        const int seen = causal ? min(lk, row0 + 16 + shift) : lk;

        for (int c = 0; c < n_chunks; ++c) {
            const int base = c * C;
            const int ck = min(C, lk - base);
            if (n_chunks > 1 || s0 == 0) {
                if (c > 0 || s0 > 0) __syncthreads();  // every warp is done with the last chunk
                const int rows = (ck + 15) & ~15;
                load_tile<D, RS>(k_addr, kh + (i64)base * sk_t, sk_t, ck, rows, tid, W * 32);
                copy_commit();
                load_tile<D, RS>(v_addr, vh + (i64)base * sv_t, sv_t, ck, rows, tid, W * 32);
                copy_commit();
            } else {
                copy_commit();
                copy_commit();
            }
            copy_wait<1>();  // Q and K have landed (V may still be in flight)
            __syncthreads();

            const int vis = min(ck, seen - base);  // keys of this chunk the strip may see
            const bool work = active && vis > 0;     // warp-uniform
            const int nkt = (vis + 15) >> 4;         // 16-key steps to compute
            float s[NS][4];
            if (work) {
#pragma unroll
                for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
                for (int kt = 0; kt < C / 16; ++kt) {
                    if (kt < nkt) {
#pragma unroll
                        for (int kk = 0; kk < KD; ++kk) {
                            u32 qa[4], bk[4];
                            ldmatrix_x4(qa, q_addr + q_lane + kk * 32);
                            ldmatrix_x4(bk, k_addr + k_lane + (u32)((kt * 16 * RS + kk * 16) * 2));
                            Mma<T>::run(s[2 * kt], qa, bk[0], bk[1]);
                            Mma<T>::run(s[2 * kt + 1], qa, bk[2], bk[3]);
                        }
                    }
                }
                // Mask, scale (log2 units), row max over the quad.
                const int r0 = row0 + g, r1 = r0 + 8;
                float mx0 = neg_inf, mx1 = neg_inf;
#pragma unroll
                for (int j = 0; j < NS; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = base + j * 8 + 2 * t + (e & 1);
                        const int row = e < 2 ? r0 : r1;
                        const bool ok = col < lk && (!causal || col <= row + shift);
                        s[j][e] = ok ? s[j][e] * scale_log2 : neg_inf;
                    }
                    mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
                }
                mx0 = fmaxf(m0, quad_max(mx0));
                mx1 = fmaxf(m1, quad_max(mx1));
                const float u0 = mx0 == neg_inf ? 0.f : mx0;  // a row with no key so far: exp2(-inf) = 0
                const float u1 = mx1 == neg_inf ? 0.f : mx1;
                const float a0 = exp2_approx(m0 - u0), a1 = exp2_approx(m1 - u1);
                m0 = mx0;
                m1 = mx1;
                l0 *= a0;
                l1 *= a1;
#pragma unroll
                for (int j = 0; j < NO; ++j) {
                    o[j][0] *= a0;
                    o[j][1] *= a0;
                    o[j][2] *= a1;
                    o[j][3] *= a1;
                }
#pragma unroll
                for (int j = 0; j < NS; ++j) {
                    s[j][0] = exp2_approx(s[j][0] - u0);
                    s[j][1] = exp2_approx(s[j][1] - u0);
                    s[j][2] = exp2_approx(s[j][2] - u1);
                    s[j][3] = exp2_approx(s[j][3] - u1);
                    l0 += s[j][0] + s[j][1];
                    l1 += s[j][2] + s[j][3];
                }
            }
            copy_wait<0>();  // V has landed
            __syncthreads();
            if (work) {
#pragma unroll
                for (int kt = 0; kt < C / 16; ++kt) {
                    if (kt < nkt) {
                        u32 pa[4];
                        pa[0] = Mma<T>::pack(s[2 * kt][0], s[2 * kt][1]);
                        pa[1] = Mma<T>::pack(s[2 * kt][2], s[2 * kt][3]);
                        pa[2] = Mma<T>::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]);
                        pa[3] = Mma<T>::pack(s[2 * kt + 1][2], s[2 * kt + 1][3]);
#pragma unroll
                        for (int dt = 0; dt < D / 16; ++dt) {
                            u32 bv[4];
                            ldmatrix_x4_trans(bv, v_addr + v_lane + (u32)((kt * 16 * RS + dt * 16) * 2));
                            Mma<T>::run(o[2 * dt], pa, bv[0], bv[1]);
                            Mma<T>::run(o[2 * dt + 1], pa, bv[2], bv[3]);
                        }
                    }
                }
            }
        }

        if (active) {
            l0 = quad_sum(l0);
            l1 = quad_sum(l1);
            const float i0 = l0 > 0.f ? 1.f / l0 : 0.f;
            const float i1 = l1 > 0.f ? 1.f / l1 : 0.f;
            copy_wait<0>();  // (no key chunk: the strip's Q copy was never waited for)
            __syncwarp();    // every lane's ldmatrix of the strip is done
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                *reinterpret_cast<u32*>(strip_smem + g * RS + j * 8 + 2 * t) = Mma<T>::pack(o[j][0] * i0, o[j][1] * i0);
                *reinterpret_cast<u32*>(strip_smem + (g + 8) * RS + j * 8 + 2 * t) =
                    Mma<T>::pack(o[j][2] * i1, o[j][3] * i1);
            }
            if (t == 0) {
                const int r0 = row0 + g, r1 = r0 + 8;
                if (r0 < lq) lse[(q_start + r0) * heads + h] = l0 > 0.f ? (m0 + log2f(l0)) * RAGGED_LN2 : neg_inf;
                if (r1 < lq) lse[(q_start + r1) * heads + h] = l1 > 0.f ? (m1 + log2f(l1)) * RAGGED_LN2 : neg_inf;
            }
            __syncwarp();
            const int rows = min(16, lq - row0);
            for (int i = lane; i < rows * NO; i += 32) {
                const int r = i / NO, c = i % NO;
                *reinterpret_cast<uint4*>(out + ((q_start + row0 + r) * heads + h) * D + c * 8) =
                    *reinterpret_cast<const uint4*>(strip_smem + r * RS + c * 8);
            }
        }
    }
}

// --------------------------------------------------------------------------------------
// extern "C" entry points: ragged_attention_short_{bf16,f16}_d{D}_c{C}, W warps per block, at least
// MINB blocks per multiprocessor (a register cap: the small tiles of the common case are latency
// bound, and more resident blocks hide more of it). The launcher (ragged/kernels/cuda_attention.py)
// keeps the same (D, C, W) table.

#define RAGGED_ATTENTION_SHORT(TYPE, TNAME, D, C, W, MINB)                                                   \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB) ragged_attention_short_##TNAME##_d##D##_c##C(  \
        const u16* q, const u16* k, const u16* v, u16* out, float* lse, const void* cu_q, const void* cu_k,   \
        int offsets64, int heads, int group, i64 sq_t, i64 sq_h, i64 sk_t, i64 sk_h, i64 sv_t, i64 sv_h,      \
        float scale_log2, int causal) {                                                                       \
        attention_short<TYPE, D, C, W>(q, k, v, out, lse, cu_q, cu_k, offsets64, heads, group, sq_t, sq_h,    \
                                       sk_t, sk_h, sv_t, sv_h, scale_log2, causal);                           \
    }

#define RAGGED_ATTENTION_SHORT_TYPES(D, C, W, MINB)      \
    RAGGED_ATTENTION_SHORT(Bf16, bf16, D, C, W, MINB)    \
    RAGGED_ATTENTION_SHORT(F16, f16, D, C, W, MINB)

RAGGED_ATTENTION_SHORT_TYPES(32, 32, 2, 16)
RAGGED_ATTENTION_SHORT_TYPES(32, 64, 4, 4)
RAGGED_ATTENTION_SHORT_TYPES(32, 128, 4, 1)
RAGGED_ATTENTION_SHORT_TYPES(64, 32, 2, 12)
RAGGED_ATTENTION_SHORT_TYPES(64, 64, 4, 4)
RAGGED_ATTENTION_SHORT_TYPES(64, 128, 4, 1)
RAGGED_ATTENTION_SHORT_TYPES(128, 32, 2, 6)
RAGGED_ATTENTION_SHORT_TYPES(128, 64, 2, 1)
