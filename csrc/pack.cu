// pack / unpack: padded [B, M, *F] <-> packed values [T, *F].
//
// The generalisation of the "compress BERT input" kernel: any feature size, any dtype.
// The kernels never look at element values: a row of R bytes is moved as R / sizeof(Vec)
// vectors of Vec (16, 8, 4, 2 or 1 bytes, the widest that divides the row size, the
// strides and the base addresses; chosen by the launcher). So fp32/fp16/bf16 (and every
// other dtype) share one instantiation per vector width, and results are bit-exact.
//
// Coordinates: packed row t in [0, T) belongs to sequence b with
// offsets[b] <= t < offsets[b+1] and sits at position j = t - offsets[b]; its padded row
// is (b, j) with right padding, (b, j + M - L_b) with left padding.
//
// Thread layout: blockDim = (LANES, ROWS), one block per ROWS consecutive rows. A group of
// LANES threads moves one row, each thread UNROLL vectors per trip with all loads issued
// before the stores, so that a 2 KiB row (bf16, F=1024) is one trip of 32 lanes x 4 x 16 B.
//
// Index arithmetic is 64-bit (long long): B * M * row passes 2**31 at realistic sizes.
// Compiles with nvcc (csrc compile check) and NVRTC (CuPy, at first use): no std headers.

#define RAGGED_UNROLL 4

typedef long long i64;

template <typename Vec>
struct Loader {
    static __device__ __forceinline__ Vec load(const Vec* p) { return __ldg(p); }
};
// __ldg has no overload for the 2-byte and 1-byte integer types everywhere; plain loads.
template <>
struct Loader<unsigned short> {
    static __device__ __forceinline__ unsigned short load(const unsigned short* p) { return *p; }
};
template <>
struct Loader<unsigned char> {
    static __device__ __forceinline__ unsigned char load(const unsigned char* p) { return *p; }
};

// Copy one row of n vectors with the threads of one lane group.
template <typename Vec>
__device__ __forceinline__ void copy_row(const Vec* __restrict__ src, Vec* __restrict__ dst, i64 n) {
    const int lanes = blockDim.x;
    for (i64 v = threadIdx.x; v < n; v += (i64)RAGGED_UNROLL * lanes) {
        Vec r[RAGGED_UNROLL];
#pragma unroll
        for (int u = 0; u < RAGGED_UNROLL; ++u) {
            const i64 k = v + (i64)u * lanes;
            if (k < n) r[u] = Loader<Vec>::load(src + k);
        }
#pragma unroll
        for (int u = 0; u < RAGGED_UNROLL; ++u) {
            const i64 k = v + (i64)u * lanes;
            if (k < n) dst[k] = r[u];
        }
    }
}

template <typename Vec>
__device__ __forceinline__ void fill_row(Vec* __restrict__ dst, i64 n, Vec value) {
    for (i64 v = threadIdx.x; v < n; v += blockDim.x) dst[v] = value;
}

// The fill value arrives as a 16-byte pattern (the element repeated); any Vec of width
// >= the element size is a prefix of it.
template <typename Vec>
__device__ __forceinline__ Vec fill_vector(unsigned int w0, unsigned int w1, unsigned int w2, unsigned int w3) {
    union {
        unsigned int words[4];
        Vec vec;
    } u;
    u.words[0] = w0;
    u.words[1] = w1;
    u.words[2] = w2;
    u.words[3] = w3;
    return u.vec;
}

// Largest b in [lo, hi] with offsets[b] <= t (the caller guarantees offsets[lo] <= t).
template <typename Off>
__device__ __forceinline__ i64 find_sequence(const Off* __restrict__ offsets, i64 lo, i64 hi, i64 t) {
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) >> 1;
        if ((i64)__ldg(offsets + mid) <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// pack: one block per ROWS consecutive packed rows (grid over the T real rows only).
//   src: padded base; row (b, j) starts at src + b * stride_b + j * stride_m (bytes).
//   dst: values, contiguous rows of row_vecs vectors.
// Two threads first find the sequences of the block's first and last rows over all B;
// every row then searches only between those two (usually 0 to 2 steps), which matters
// when rows are short and the search, not the copy, is the cost.
template <typename Vec, typename Off>
__device__ __forceinline__ void pack_rows(const char* __restrict__ src, Vec* __restrict__ dst,
                                          const Off* __restrict__ offsets, i64 batch, i64 total, i64 width,
                                          i64 stride_b, i64 stride_m, i64 row_vecs, int left) {
    __shared__ i64 range[2];
    const i64 first = (i64)blockIdx.x * blockDim.y;
    const i64 last = min(first + (i64)blockDim.y, total) - 1;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    if (tid < 2) range[tid] = find_sequence(offsets, 0, batch - 1, tid == 0 ? first : last);
    __syncthreads();
    const i64 t = first + threadIdx.y;
    if (t > last) return;
    const i64 b = find_sequence(offsets, range[0], range[1], t);
    const i64 start = __ldg(offsets + b);
    i64 j = t - start;
    if (left) j += width - ((i64)__ldg(offsets + b + 1) - start);
    if (j < 0 || j >= width) {
        // A length past the width (offsets unchecked on the GPU) would read outside the
        // padded tensor: the row is written as zeros instead.
        fill_row(dst + t * row_vecs, row_vecs, fill_vector<Vec>(0u, 0u, 0u, 0u));
        return;
    }
    const Vec* row = reinterpret_cast<const Vec*>(src + b * stride_b + j * stride_m);
    copy_row(row, dst + t * row_vecs, row_vecs);
}

// unpack: one block per ROWS consecutive padded rows; rows past a sequence get the fill.
// The block's first row is divided by the width once; rows step from there (no 64-bit
// division per row).
template <typename Vec, typename Off>
__device__ __forceinline__ void unpack_rows(const Vec* __restrict__ src, Vec* __restrict__ dst,
                                            const Off* __restrict__ offsets, i64 n_rows, i64 width, i64 row_vecs,
                                            int left, Vec fill) {
    __shared__ i64 base[2];
    const i64 first = (i64)blockIdx.x * blockDim.y;
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        base[0] = first / width;
        base[1] = first - base[0] * width;
    }
    __syncthreads();
    const i64 r = first + threadIdx.y;
    if (r >= n_rows) return;
    i64 b = base[0], j = base[1] + threadIdx.y;
    while (j >= width) {
        j -= width;
        ++b;
    }
    const i64 start = __ldg(offsets + b);
    const i64 length = (i64)__ldg(offsets + b + 1) - start;
    if (left) j -= width - length;
    if (j >= 0 && j < length) copy_row(src + (start + j) * row_vecs, dst + r * row_vecs, row_vecs);
    else fill_row(dst + r * row_vecs, row_vecs, fill);
}

// extern "C" entry points, one per (vector width, offsets dtype): ragged_{pack,unpack}_v{bytes}_{i32,i64}.
// One kernel per macro: the launcher (ragged/kernels/cuda/launch.py) compiles each kernel on its
// own, as this file with the instantiation lines below blanked plus the one RAGGED_PACK_KERNEL /
// RAGGED_UNPACK_KERNEL invocation that defines it. Instantiation lines stay top-level and
// unconditional, with plain arguments.
#define RAGGED_PACK_KERNEL(VEC, VNAME, OFF, ONAME)                                                           \
    extern "C" __global__ void __launch_bounds__(256) ragged_pack_##VNAME##_##ONAME(                          \
        const char* src, VEC* dst, const OFF* offsets, i64 batch, i64 total, i64 width, i64 stride_b,         \
        i64 stride_m, i64 row_vecs, int left) {                                                               \
        pack_rows<VEC, OFF>(src, dst, offsets, batch, total, width, stride_b, stride_m, row_vecs, left);      \
    }

#define RAGGED_UNPACK_KERNEL(VEC, VNAME, OFF, ONAME)                                                         \
    extern "C" __global__ void __launch_bounds__(256) ragged_unpack_##VNAME##_##ONAME(                        \
        const VEC* src, VEC* dst, const OFF* offsets, i64 n_rows, i64 width, i64 row_vecs, int left,          \
        unsigned int w0, unsigned int w1, unsigned int w2, unsigned int w3) {                                 \
        unpack_rows<VEC, OFF>(src, dst, offsets, n_rows, width, row_vecs, left,                               \
                              fill_vector<VEC>(w0, w1, w2, w3));                                              \
    }

#define RAGGED_PACK_KERNELS(VEC, VNAME, OFF, ONAME) \
    RAGGED_PACK_KERNEL(VEC, VNAME, OFF, ONAME)      \
    RAGGED_UNPACK_KERNEL(VEC, VNAME, OFF, ONAME)

#define RAGGED_PACK_FOR_OFFSETS(VEC, VNAME)           \
    RAGGED_PACK_KERNELS(VEC, VNAME, int, i32)         \
    RAGGED_PACK_KERNELS(VEC, VNAME, long long, i64)

RAGGED_PACK_FOR_OFFSETS(uint4, v16)
RAGGED_PACK_FOR_OFFSETS(uint2, v8)
RAGGED_PACK_FOR_OFFSETS(unsigned int, v4)
RAGGED_PACK_FOR_OFFSETS(unsigned short, v2)
RAGGED_PACK_FOR_OFFSETS(unsigned char, v1)
