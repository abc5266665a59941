// Fused attention for short sequences, forward only (fp16 / bf16, head dims 32, 64, 128).
//
// The regime: many sequences of a few dozen tokens (B = 256 of 8..32 tokens, H = 12, D = 64),
// where a flash-attention kernel spends its time on bookkeeping. Here a thread block takes one
// sequence b and one query head h (or, in the pipelined kernel, a few heads in turn) and does
// everything in one pass:
//
//   1. cp.async copies the sequence's K and V rows (key/value head h / group) into shared
//      memory, each warp its own 16-row strip of Q; rows past the sequence are zero-filled by
//      the copy itself (src-size 0), so tokens of other sequences are never read;
//   2. S = Q K^T with mma.sync m16n8k16 (fp32 accumulators), fragments through ldmatrix;
//   3. masking (length, bottom-right causal), an optional relative-position bias (one float per
//      score from the head's row of a distance table, already in log2 units), and the softmax
//      in fp32 registers (exp2 with the scale folded in, row max / row sum across a quad);
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
// Pipelined kernel (the common case, every sequence within one round and one key chunk): a block
// takes HPB consecutive heads of a sequence with two shared stages, the copies of head j + 1 in
// flight while the warps compute head j. A block per head pays the memory latency of its copies
// with nothing to overlap it; here it is paid about once per block.
//
// Inputs: q [Tq, H, D], k / v [Tk, H_kv, D], rows contiguous in D and 16-byte aligned (the
// launcher copies otherwise); token and head strides in elements. Offsets cu_q / cu_k [B+1] are
// int32 or int64 (bit 0 / bit 1 of `offsets64`). Output out [Tq, H, D] contiguous, lse [Tq, H]
// float32 (or nullptr: not written). Index arithmetic on tokens is 64-bit (T * H * D can pass 2**31).
// Position bias (or bias = nullptr: none): bias [H, span] float32, the bias of query i and key j
// of a sequence (positions within it) times log2(e) at bias[h * span + j - i + origin], the index
// clamped into [0, span) (a row or key past max_seqlen hints reads an edge value, never outside).
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
// One warp, one 16-query strip: the pieces shared by both kernels.

// Per-lane ldmatrix offsets (bytes) into a tile of row stride RS elements: Q as the A operand
// (rows lane % 16, columns 8 (lane / 16)); K as the col-major B operand of two 8-key tiles (keys
// lane % 8 + 8 (lane / 16), columns 8 ((lane / 8) % 2)); V transposed (keys lane % 8 + 8 ((lane / 8)
// % 2), columns 8 (lane / 16)).
template <int RS>
__device__ __forceinline__ u32 q_lane_offset(int lane) {
    return (u32)(((lane & 15) * RS + ((lane >> 4) << 3)) * 2);
}
template <int RS>
__device__ __forceinline__ u32 k_lane_offset(int lane) {
    return (u32)((((lane & 7) + ((lane >> 4) << 3)) * RS + (((lane >> 3) & 1) << 3)) * 2);
}
template <int RS>
__device__ __forceinline__ u32 v_lane_offset(int lane) {
    return (u32)((((lane & 7) + (((lane >> 3) & 1) << 3)) * RS + ((lane >> 4) << 3)) * 2);
}

// The running state of a strip: O (fp32, the mma C layout: rows g and g + 8 of the strip, columns
// 8 j + 2 t and + 1), the row max m (log2 units) and the lane's part of the row sum l.
template <int D>
struct StripState {
    float o[D / 8][4];
    float m0, m1, l0, l1;

    __device__ __forceinline__ void reset() {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
        m0 = m1 = __int_as_float(0xff800000);
        l0 = l1 = 0.f;
    }
};

// S = Q K^T for the first nkt 16-key steps of a key chunk (keys base.. of the sequence), the mask
// (key < lk; causal: key <= row + shift), and the online-softmax update: on return s holds
// P = exp2(S - m) (0 where masked) and o, l are rescaled to the new row max.
template <typename T, int D, int C, int RS, bool BIAS>
__device__ __forceinline__ void strip_scores(StripState<D>& st, float (&s)[C / 8][4], u32 q_frag, u32 k_frag,
                                             int nkt, int base, int lk, int row0, int shift, int causal,
                                             float scale_log2, const float* __restrict__ bias_row, int bias_span,
                                             int bias_origin, int lane) {
    const float neg_inf = __int_as_float(0xff800000);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < C / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kt = 0; kt < C / 16; ++kt) {
        if (kt < nkt) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 qa[4], bk[4];
                ldmatrix_x4(qa, q_frag + kk * 32);
                ldmatrix_x4(bk, k_frag + (u32)((kt * 16 * RS + kk * 16) * 2));
                Mma<T>::run(s[2 * kt], qa, bk[0], bk[1]);
                Mma<T>::run(s[2 * kt + 1], qa, bk[2], bk[3]);
            }
        }
    }
    const int r0 = row0 + g, r1 = r0 + 8;
    float mx0 = neg_inf, mx1 = neg_inf;
#pragma unroll
    for (int j = 0; j < C / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = base + j * 8 + 2 * t + (e & 1);
            const int row = e < 2 ? r0 : r1;
            const bool ok = col < lk && (!causal || col <= row + shift);
            float b = 0.f;
            if (BIAS && ok) b = __ldg(bias_row + min(max(col - row + bias_origin, 0), bias_span - 1));
            s[j][e] = ok ? (BIAS ? s[j][e] * scale_log2 + b : s[j][e] * scale_log2) : neg_inf;
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
    mx0 = fmaxf(st.m0, quad_max(mx0));
    mx1 = fmaxf(st.m1, quad_max(mx1));
    const float u0 = mx0 == neg_inf ? 0.f : mx0;  // a row with no key so far: exp2(-inf) = 0
    const float u1 = mx1 == neg_inf ? 0.f : mx1;
    const float a0 = exp2_approx(st.m0 - u0), a1 = exp2_approx(st.m1 - u1);
    st.m0 = mx0;
    st.m1 = mx1;
    st.l0 *= a0;
    st.l1 *= a1;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        st.o[j][0] *= a0;
        st.o[j][1] *= a0;
        st.o[j][2] *= a1;
        st.o[j][3] *= a1;
    }
#pragma unroll
    for (int j = 0; j < C / 8; ++j) {
        s[j][0] = exp2_approx(s[j][0] - u0);
        s[j][1] = exp2_approx(s[j][1] - u0);
        s[j][2] = exp2_approx(s[j][2] - u1);
        s[j][3] = exp2_approx(s[j][3] - u1);
        st.l0 += s[j][0] + s[j][1];
        st.l1 += s[j][2] + s[j][3];
    }
}

// O += P V over the first nkt 16-key steps (P from the S accumulators: the C fragments of 8-key
// tiles 2 kt and 2 kt + 1 are the A fragment of 16-key step kt).
template <typename T, int D, int C, int RS>
__device__ __forceinline__ void strip_pv(StripState<D>& st, const float (&s)[C / 8][4], u32 v_frag, int nkt) {
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
                ldmatrix_x4_trans(bv, v_frag + (u32)((kt * 16 * RS + dt * 16) * 2));
                Mma<T>::run(st.o[2 * dt], pa, bv[0], bv[1]);
                Mma<T>::run(st.o[2 * dt + 1], pa, bv[2], bv[3]);
            }
        }
    }
}

// O / l and lse of the strip's rows < lq: O goes through the strip's shared rows (whose Q the
// warp no longer needs, and whose copy the caller has waited for) and out as 16-byte row pieces.
template <typename T, int D, int RS>
__device__ __forceinline__ void strip_store(StripState<D>& st, u16* strip_smem, u16* __restrict__ out,
                                            float* __restrict__ lse, i64 q_start, int row0, int lq, int heads,
                                            int h, int lane) {
    constexpr int NO = D / 8;
    const int g = lane >> 2, t = lane & 3;
    const float l0 = quad_sum(st.l0), l1 = quad_sum(st.l1);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f;
    const float i1 = l1 > 0.f ? 1.f / l1 : 0.f;
    __syncwarp();  // every lane's ldmatrix of the strip is done
#pragma unroll
    for (int j = 0; j < NO; ++j) {
        *reinterpret_cast<u32*>(strip_smem + g * RS + j * 8 + 2 * t) = Mma<T>::pack(st.o[j][0] * i0, st.o[j][1] * i0);
        *reinterpret_cast<u32*>(strip_smem + (g + 8) * RS + j * 8 + 2 * t) =
            Mma<T>::pack(st.o[j][2] * i1, st.o[j][3] * i1);
    }
    if (t == 0 && lse != nullptr) {  // inference callers may skip lse
        const float neg_inf = __int_as_float(0xff800000);
        const int r0 = row0 + g, r1 = r0 + 8;
        if (r0 < lq) lse[(q_start + r0) * heads + h] = l0 > 0.f ? (st.m0 + log2f(l0)) * RAGGED_LN2 : neg_inf;
        if (r1 < lq) lse[(q_start + r1) * heads + h] = l1 > 0.f ? (st.m1 + log2f(l1)) * RAGGED_LN2 : neg_inf;
    }
    __syncwarp();
    const int rows = min(16, lq - row0);
    for (int i = lane; i < rows * NO; i += 32) {
        const int r = i / NO, c = i % NO;
        *reinterpret_cast<uint4*>(out + ((q_start + row0 + r) * heads + h) * D + c * 8) =
            *reinterpret_cast<const uint4*>(strip_smem + r * RS + c * 8);
    }
}

// Block-wide problem description.
struct Problem {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* out;
    float* lse;
    i64 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h;
    int heads, group, causal;
    float scale_log2;
    i64 total_q, total_k;  // rows of q and k: every offset is clipped to [0, total]
    const float* bias;     // [heads, bias_span] or nullptr
    int bias_span, bias_origin;

    __device__ __forceinline__ const float* bias_row(int h) const {
        return bias == nullptr ? nullptr : bias + (i64)h * bias_span;
    }
};

struct Sequence {
    i64 q_start, k_start;
    int lq, lk;
};

// An offset clipped to [0, total]: offsets are not checked before a launch (that costs a sync),
// so a sequence past T (or a negative, decreasing offset) must not take a block outside q, k, out.
__device__ __forceinline__ i64 clip_offset(i64 x, i64 total) { return x < 0 ? 0 : (x > total ? total : x); }

__device__ __forceinline__ Sequence load_sequence(const void* cu_q, const void* cu_k, int offsets64, int b,
                                                  i64 total_q, i64 total_k) {
    // All four loads before any use: one memory round trip.
    const i64 q0 = load_offset(cu_q, offsets64 & 1, b), q1 = load_offset(cu_q, offsets64 & 1, b + 1);
    const i64 k0 = load_offset(cu_k, offsets64 & 2, b), k1 = load_offset(cu_k, offsets64 & 2, b + 1);
    Sequence s;
    s.q_start = clip_offset(q0, total_q);
    s.k_start = clip_offset(k0, total_k);
    const i64 lq = clip_offset(q1, total_q) - s.q_start, lk = clip_offset(k1, total_k) - s.k_start;
    s.lq = (int)(lq > 0 ? lq : 0);
    s.lk = (int)(lk > 0 ? lk : 0);
    return s;
}

// --------------------------------------------------------------------------------------
// General path: one query head h of one sequence, any lengths. A block of W warps covers 16 W
// queries per round; keys go through shared memory in chunks of C rows, K and V of a chunk
// loaded once for all rounds when there is one chunk. s_q: W * 16 rows, s_k / s_v: C rows.

template <typename T, int D, int C, int W, bool BIAS>
__device__ __forceinline__ void attend_head(const Problem& p, const Sequence& sq, int h, u16* s_q, u16* s_k,
                                            u16* s_v) {
    constexpr int RS = D + 8;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int lq = sq.lq, lk = sq.lk;
    const u16* qh = p.q + sq.q_start * p.sq_t + (i64)h * p.sq_h;
    const u16* kh = p.k + sq.k_start * p.sk_t + (i64)(h / p.group) * p.sk_h;
    const u16* vh = p.v + sq.k_start * p.sv_t + (i64)(h / p.group) * p.sv_h;
    const int n_strips = (lq + 15) >> 4;
    const int n_chunks = (lk + C - 1) / C;
    const int shift = lk - lq;  // causal: query i sees keys j <= i + shift

    u16* strip_smem = s_q + warp * 16 * RS;
    const u32 q_addr = smem_address(strip_smem);
    const u32 k_addr = smem_address(s_k);
    const u32 v_addr = smem_address(s_v);
    const u32 q_frag = q_addr + q_lane_offset<RS>(lane);
    const u32 k_frag = k_addr + k_lane_offset<RS>(lane);
    const u32 v_frag = v_addr + v_lane_offset<RS>(lane);

    for (int s0 = 0; s0 < n_strips; s0 += W) {
        const int strip = s0 + warp;
        const bool active = strip < n_strips;  // warp-uniform
        const int row0 = strip * 16;
        __syncwarp();  // the strip's shared rows of the last round are read
        if (active) load_tile<D, RS>(q_addr, qh + (i64)row0 * p.sq_t, p.sq_t, min(16, lq - row0), 16, lane, 32);
        copy_commit();

        StripState<D> st;
        st.reset();
        // Keys [0, seen) may be visible to some row of the strip.
        const int seen = p.causal ? min(lk, row0 + 16 + shift) : lk;

        for (int c = 0; c < n_chunks; ++c) {
            const int base = c * C;
            const int ck = min(C, lk - base);
            if (n_chunks > 1 || s0 == 0) {
                if (c > 0 || s0 > 0) __syncthreads();  // every warp is done with the last chunk
                const int rows = (ck + 15) & ~15;
                load_tile<D, RS>(k_addr, kh + (i64)base * p.sk_t, p.sk_t, ck, rows, tid, W * 32);
                copy_commit();
                load_tile<D, RS>(v_addr, vh + (i64)base * p.sv_t, p.sv_t, ck, rows, tid, W * 32);
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
            float s[C / 8][4];
            if (work) strip_scores<T, D, C, RS, BIAS>(st, s, q_frag, k_frag, nkt, base, lk, row0, shift, p.causal,
                                                p.scale_log2, p.bias_row(h), p.bias_span, p.bias_origin, lane);
            copy_wait<0>();  // V has landed
            __syncthreads();
            if (work) strip_pv<T, D, C, RS>(st, s, v_frag, nkt);
        }
        copy_wait<0>();  // (a strip without keys never waited for its Q copy)
        if (active) strip_store<T, D, RS>(st, strip_smem, p.out, p.lse, sq.q_start, row0, lq, p.heads, h, lane);
    }
}

// One block per (sequence, query head).
template <typename T, int D, int C, int W, bool BIAS>
__device__ __forceinline__ void attention_short(const Problem& p, const void* cu_q, const void* cu_k, int offsets64) {
    constexpr int RS = D + 8;
    __shared__ __align__(16) u16 s_q[W * 16 * RS];
    __shared__ __align__(16) u16 s_k[C * RS];
    __shared__ __align__(16) u16 s_v[C * RS];
    const int b = blockIdx.x / p.heads;
    const int h = blockIdx.x - b * p.heads;
    const Sequence sq = load_sequence(cu_q, cu_k, offsets64, b, p.total_q, p.total_k);
    if (sq.lq <= 0) return;
    attend_head<T, D, C, W, BIAS>(p, sq, h, s_q, s_k, s_v);
}

// --------------------------------------------------------------------------------------
// Pipelined path for the common case (every query strip in one round: lq <= 16 W, and one key
// chunk: lk <= C): one block per (sequence, group of HPB consecutive query heads). Two shared
// stages: while the warps compute head j from one, the copies of head j + 1 land in the other, so
// the block's memory latency is paid about once instead of once per head. A sequence longer than
// that (max_seqlen hints that were too small) takes the general path head by head.

template <typename T, int D, int C, int W, int HPB, bool BIAS>
__device__ __forceinline__ void attention_short_pipelined(const Problem& p, const void* cu_q, const void* cu_k,
                                                          int offsets64) {
    constexpr int RS = D + 8;
    constexpr int QROWS = W * 16;
    __shared__ __align__(16) u16 s_q[2][QROWS * RS];
    __shared__ __align__(16) u16 s_k[2][C * RS];
    __shared__ __align__(16) u16 s_v[2][C * RS];

    const int groups = (p.heads + HPB - 1) / HPB;
    const int b = blockIdx.x / groups;
    const int h0 = (blockIdx.x - b * groups) * HPB;
    const int nh = min(HPB, p.heads - h0);
    const Sequence sq = load_sequence(cu_q, cu_k, offsets64, b, p.total_q, p.total_k);
    const int lq = sq.lq, lk = sq.lk;
    if (lq <= 0) return;
    if (lq > QROWS || lk > C) {
        for (int j = 0; j < nh; ++j) {
            if (j > 0) __syncthreads();
            attend_head<T, D, C, W, BIAS>(p, sq, h0 + j, s_q[0], s_k[0], s_v[0]);
        }
        return;
    }

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int row0 = warp * 16;
    const bool active = row0 < lq;  // warp-uniform
    const int q_rows = min(16, lq - row0);
    const int k_rows = (lk + 15) & ~15;
    const int shift = lk - lq;
    const int seen = p.causal ? min(lk, row0 + 16 + shift) : lk;
    const int nkt = seen > 0 ? (seen + 15) >> 4 : 0;  // 16-key steps this strip computes
    const u16* q_seq = p.q + sq.q_start * p.sq_t;
    const u16* k_seq = p.k + sq.k_start * p.sk_t;
    const u16* v_seq = p.v + sq.k_start * p.sv_t;

    // Copies of head h0 + j into stage j % 2 (one commit group).
    auto issue = [&](int j) {
        const int h = h0 + j, hk = h / p.group, stage = j & 1;
        if (active)
            load_tile<D, RS>(smem_address(&s_q[stage][row0 * RS]), q_seq + (i64)row0 * p.sq_t + (i64)h * p.sq_h,
                             p.sq_t, q_rows, 16, lane, 32);
        if (lk > 0) {
            load_tile<D, RS>(smem_address(s_k[stage]), k_seq + (i64)hk * p.sk_h, p.sk_t, lk, k_rows, tid, W * 32);
            load_tile<D, RS>(smem_address(s_v[stage]), v_seq + (i64)hk * p.sv_h, p.sv_t, lk, k_rows, tid, W * 32);
        }
        copy_commit();
    };

    issue(0);
    for (int j = 0; j < nh; ++j) {
        const int stage = j & 1;
        if (j + 1 < nh) issue(j + 1);
        else copy_commit();
        copy_wait<1>();  // head j's copies have landed (head j + 1's may still be in flight)
        __syncthreads();
        if (active) {
            u16* strip_smem = &s_q[stage][row0 * RS];
            StripState<D> st;
            st.reset();
            if (nkt > 0) {
                float s[C / 8][4];
                const u32 q_frag = smem_address(strip_smem) + q_lane_offset<RS>(lane);
                strip_scores<T, D, C, RS, BIAS>(st, s, q_frag, smem_address(s_k[stage]) + k_lane_offset<RS>(lane), nkt,
                                                0,
                                          lk, row0, shift, p.causal, p.scale_log2, p.bias_row(h0 + j), p.bias_span,
                                          p.bias_origin, lane);
                strip_pv<T, D, C, RS>(st, s, smem_address(s_v[stage]) + v_lane_offset<RS>(lane), nkt);
            }
            strip_store<T, D, RS>(st, strip_smem, p.out, p.lse, sq.q_start, row0, lq, p.heads, h0 + j, lane);
        }
        __syncthreads();  // stage j % 2 is free for head j + 2
    }
}

// --------------------------------------------------------------------------------------
// extern "C" entry points (the launcher, ragged/kernels/cuda/attention.py, keeps the same tables):
//   ragged_attention_short[_bias]_{bf16,f16}_d{D}_c{C}: W warps, one block per (sequence, head);
//   ragged_attention_short_pipe[_bias]_{bf16,f16}_d{D}_c{C}_h{HPB}: W warps, one block per
//   (sequence, group of HPB heads), for max_seqlen_q <= 16 W and max_seqlen_k <= C.
//   _bias: with the position bias (the others never read `bias`).
// MINB: at least that many blocks per multiprocessor (a register cap: these small tiles are
// latency bound, and more resident blocks hide more of it).
// NVRTC compiles each kernel on its own (ragged/kernels/cuda/launch.py): this file with the
// instantiation lines at the end blanked, plus the one RAGGED_ATTENTION_SHORT(...) /
// RAGGED_ATTENTION_SHORT_PIPELINED(...) invocation that defines it, read from those lines. So
// they stay top-level and unconditional, one macro invocation each, with plain arguments.

#define RAGGED_ATTENTION_PARAMS                                                                               \
    const u16 *q, const u16 *k, const u16 *v, u16 *out, float *lse, const void *cu_q, const void *cu_k,       \
        int offsets64, int heads, int group, i64 sq_t, i64 sq_h, i64 sk_t, i64 sk_h, i64 sv_t, i64 sv_h,      \
        float scale_log2, int causal, i64 total_q, i64 total_k, const float *bias, int bias_span, int bias_origin

#define RAGGED_ATTENTION_PROBLEM \
    const Problem p = {q, k, v, out, lse, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, heads, group, causal, scale_log2, \
                       total_q, total_k, bias, bias_span, bias_origin}

#define RAGGED_ATTENTION_SHORT(TYPE, TNAME, D, C, W, MINB)                                                   \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB)                                                \
        ragged_attention_short_##TNAME##_d##D##_c##C(RAGGED_ATTENTION_PARAMS) {                               \
        RAGGED_ATTENTION_PROBLEM;                                                                             \
        attention_short<TYPE, D, C, W, false>(p, cu_q, cu_k, offsets64);                                      \
    }

#define RAGGED_ATTENTION_SHORT_BIAS(TYPE, TNAME, D, C, W, MINB)                                              \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB)                                                \
        ragged_attention_short_bias_##TNAME##_d##D##_c##C(RAGGED_ATTENTION_PARAMS) {                          \
        RAGGED_ATTENTION_PROBLEM;                                                                             \
        attention_short<TYPE, D, C, W, true>(p, cu_q, cu_k, offsets64);                                       \
    }

#define RAGGED_ATTENTION_SHORT_PIPELINED(TYPE, TNAME, D, C, W, HPB, MINB)                                    \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB)                                                \
        ragged_attention_short_pipe_##TNAME##_d##D##_c##C##_h##HPB(RAGGED_ATTENTION_PARAMS) {                 \
        RAGGED_ATTENTION_PROBLEM;                                                                             \
        attention_short_pipelined<TYPE, D, C, W, HPB, false>(p, cu_q, cu_k, offsets64);                       \
    }

#define RAGGED_ATTENTION_SHORT_PIPELINED_BIAS(TYPE, TNAME, D, C, W, HPB, MINB)                               \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB)                                                \
        ragged_attention_short_pipe_bias_##TNAME##_d##D##_c##C##_h##HPB(RAGGED_ATTENTION_PARAMS) {            \
        RAGGED_ATTENTION_PROBLEM;                                                                             \
        attention_short_pipelined<TYPE, D, C, W, HPB, true>(p, cu_q, cu_k, offsets64);                        \
    }

#define RAGGED_ATTENTION_SHORT_TYPES(D, C, W, MINB)        \
    RAGGED_ATTENTION_SHORT(Bf16, bf16, D, C, W, MINB)      \
    RAGGED_ATTENTION_SHORT(F16, f16, D, C, W, MINB)        \
    RAGGED_ATTENTION_SHORT_BIAS(Bf16, bf16, D, C, W, MINB) \
    RAGGED_ATTENTION_SHORT_BIAS(F16, f16, D, C, W, MINB)

#define RAGGED_ATTENTION_SHORT_PIPELINED_TYPES(D, C, W, HPB, MINB)        \
    RAGGED_ATTENTION_SHORT_PIPELINED(Bf16, bf16, D, C, W, HPB, MINB)      \
    RAGGED_ATTENTION_SHORT_PIPELINED(F16, f16, D, C, W, HPB, MINB)        \
    RAGGED_ATTENTION_SHORT_PIPELINED_BIAS(Bf16, bf16, D, C, W, HPB, MINB) \
    RAGGED_ATTENTION_SHORT_PIPELINED_BIAS(F16, f16, D, C, W, HPB, MINB)

RAGGED_ATTENTION_SHORT_TYPES(32, 32, 2, 14)
RAGGED_ATTENTION_SHORT_TYPES(32, 64, 4, 4)
RAGGED_ATTENTION_SHORT_TYPES(32, 128, 4, 1)
RAGGED_ATTENTION_SHORT_TYPES(64, 32, 2, 10)
RAGGED_ATTENTION_SHORT_TYPES(64, 64, 4, 4)
RAGGED_ATTENTION_SHORT_TYPES(64, 128, 4, 1)
RAGGED_ATTENTION_SHORT_TYPES(128, 32, 2, 6)
RAGGED_ATTENTION_SHORT_TYPES(128, 64, 2, 1)

RAGGED_ATTENTION_SHORT_PIPELINED_TYPES(32, 32, 2, 4, 8)
RAGGED_ATTENTION_SHORT_PIPELINED_TYPES(64, 32, 2, 4, 8)
