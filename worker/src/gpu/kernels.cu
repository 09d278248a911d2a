// Preparation kernels, compiled at run time by NVRTC; gpu/kernels.rs passes the options
// (--ftz=false --prec-div=true --prec-sqrt=true --fmad=false) and the geometry (-D WS_*) and
// names the instantiations. Bit-identical to the CPU kernels in worker/src/prepare/: every
// conversion mirrors prepare/convert.rs step for step (the same integer tricks; IEEE
// round-to-nearest float ops written as __fadd_rn / __fmul_rn / __fdiv_rn so no contraction or
// fast-math can change a bit), and the fp8 recipe mirrors prepare/fp8.rs.

typedef unsigned int u32;
typedef int i32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#if !defined(WS_TILE) || !defined(WS_QUANT_THREADS) || !defined(WS_CAST_THREADS)
#error "compile through gpu/kernels.rs, which defines WS_TILE, WS_QUANT_THREADS, WS_CAST_THREADS"
#endif

// dtype codes: the template argument of every kernel (gpu/kernels.rs names the instances).
#define DT_BF16 0
#define DT_F16 1
#define DT_F32 2

// ---------------------------------------------------------------------------------------------
// Element conversions (prepare/convert.rs).

__device__ __forceinline__ float bf16_to_f32(u32 h) {
    u32 quiet = ((h & 0x7fff) > 0x7f80) ? 0x40u : 0u;
    return __uint_as_float((h | quiet) << 16);
}

__device__ __forceinline__ u32 f32_to_bf16(float x) {
    u32 b = __float_as_uint(x);
    u32 rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    u32 nan = (b >> 16) | 0x40u;
    bool is_nan = (i32)(b & 0x7fffffffu) > 0x7f800000;
    return (is_nan ? nan : rounded) & 0xffffu;
}

__device__ __forceinline__ float f16_to_f32(u32 hh) {
    i32 h = (i32)hh;
    i32 sign = (h & 0x8000) << 16;
    i32 em = h & 0x7fff;
    i32 normal = (em << 13) + ((127 - 15) << 23);
    i32 subnormal = (i32)__float_as_uint(__fmul_rn(__int2float_rn(em), __uint_as_float(0x33800000u)));
    i32 quiet = em > 0x7c00 ? 0x00400000 : 0;
    i32 special = (em << 13) | 0x7f800000 | quiet;
    i32 mag = em < 0x0400 ? subnormal : (em >= 0x7c00 ? special : normal);
    return __uint_as_float((u32)(sign | mag));
}

__device__ __forceinline__ u32 f32_to_f16(float x) {
    i32 b = (i32)__float_as_uint(x);
    i32 sign = (b >> 16) & 0x8000;
    i32 a = b & 0x7fffffff;
    i32 nan = 0x7e00 | ((a >> 13) & 0x03ff);
    i32 subnormal = (i32)(__float_as_uint(__fadd_rn(__uint_as_float((u32)a), 0.5f)) - 0x3f000000u);
    i32 normal = (i32)((((u32)a + 0x0fffu + (((u32)a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10));
    i32 mag = a > 0x7f800000 ? nan : (a >= 0x477ff000 ? 0x7c00 : (a < 0x38800000 ? subnormal : normal));
    return (u32)(sign | mag) & 0xffffu;
}

// The 7 magnitude bits of f32_to_e4m3_saturating(p) (convert.rs): saturating at 448 (0x7e),
// NaN -> 0x7f. The sign bit is added by the caller.
__device__ __forceinline__ u32 e4m3_mag(float p) {
    i32 abs = (i32)(__float_as_uint(p) & 0x7fffffffu);
    i32 a = min(abs, 0x43e00000);
    i32 subnormal = (i32)__float_as_uint(__fadd_rn(__uint_as_float((u32)a), 16384.0f)) - 0x46800000;
    i32 normal = ((a + 0x7ffff + ((a >> 20) & 1)) >> 20) - (120 << 3);
    i32 mag = a < 0x3c800000 ? subnormal : normal;
    return (u32)(mag | (abs > 0x7f800000 ? 1 : 0));
}

// Two magnitudes at once with the hardware conversion (sm_89 and later): byte 0 from `lo`,
// byte 1 from `hi`. Used only where ws_e4m3_hw_selftest found it equal to e4m3_mag for every
// f32 (gpu/device.rs runs it before choosing); elsewhere the emulation stands in.
__device__ __forceinline__ u32 e4m3x2_mag_hw(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (u32)r & 0x7f7fu;
#else
    return e4m3_mag(lo) | (e4m3_mag(hi) << 8);
#endif
}

// ---------------------------------------------------------------------------------------------
// Per-dtype element access. An element is carried as its raw bits in a u32 (16-bit dtypes in the
// low half).

template <int DT> __device__ __forceinline__ float to_f32(u32 e);
template <> __device__ __forceinline__ float to_f32<DT_BF16>(u32 e) { return bf16_to_f32(e); }
template <> __device__ __forceinline__ float to_f32<DT_F16>(u32 e) { return f16_to_f32(e); }
template <> __device__ __forceinline__ float to_f32<DT_F32>(u32 e) { return __uint_as_float(e); }

template <int DT> __device__ __forceinline__ u32 from_f32(float x);
template <> __device__ __forceinline__ u32 from_f32<DT_BF16>(float x) { return f32_to_bf16(x); }
template <> __device__ __forceinline__ u32 from_f32<DT_F16>(float x) { return f32_to_f16(x); }
template <> __device__ __forceinline__ u32 from_f32<DT_F32>(float x) { return __float_as_uint(x); }

// The fp8 path's f32 value of an element. For bf16 a plain widening shift, as prepare/fp8.rs
// does: it differs from bf16_to_f32 only in a NaN's quiet bit, and every NaN quantises alike.
template <int DT> __device__ __forceinline__ float quant_f32(u32 e) { return to_f32<DT>(e); }
template <> __device__ __forceinline__ float quant_f32<DT_BF16>(u32 e) { return __uint_as_float(e << 16); }

// The sign bit of an element, at bit 7.
template <int DT> __device__ __forceinline__ u32 sign_bit(u32 e) { return (e >> 8) & 0x80u; }
template <> __device__ __forceinline__ u32 sign_bit<DT_F32>(u32 e) { return (e >> 24) & 0x80u; }

// prepare/fp8.rs's ordering key: |x| as bits for finite x, 0 for inf and NaN. Its max is the
// block's amax; key_to_f32 turns it back into f32 exactly.
template <int DT> __device__ __forceinline__ u32 finite_key(u32 e);
template <> __device__ __forceinline__ u32 finite_key<DT_BF16>(u32 e) { u32 a = e & 0x7fffu; return a < 0x7f80u ? a : 0u; }
template <> __device__ __forceinline__ u32 finite_key<DT_F16>(u32 e) { u32 a = e & 0x7fffu; return a < 0x7c00u ? a : 0u; }
template <> __device__ __forceinline__ u32 finite_key<DT_F32>(u32 e) { u32 a = e & 0x7fffffffu; return a < 0x7f800000u ? a : 0u; }

template <int DT> __device__ __forceinline__ float key_to_f32(u32 k) { return to_f32<DT>(k); }

// Words (u32) per 8 elements.
template <int DT> struct Width { static const int WORDS = 4; static const int SIZE = 2; };
template <> struct Width<DT_F32> { static const int WORDS = 8; static const int SIZE = 4; };

// Element j (0..7) of 8 elements held in `WORDS` words.
template <int DT> __device__ __forceinline__ u32 elem(const u32* w, int j) {
    if (Width<DT>::SIZE == 4) return w[j];
    return (j & 1) ? (w[j >> 1] >> 16) : (w[j >> 1] & 0xffffu);
}

// Loads 8 consecutive elements starting at element `i` with 16-byte loads (`src` + i * SIZE
// must be 16-byte aligned).
template <int DT> __device__ __forceinline__ void load8_vec(const u8* __restrict__ src, u64 i, u32* w) {
    const uint4* p = (const uint4*)(src + i * Width<DT>::SIZE);
    uint4 a = p[0];
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    if (Width<DT>::WORDS == 8) {
        uint4 b = p[1];
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
}

template <int DT> __device__ __forceinline__ u32 load1(const u8* __restrict__ src, u64 i) {
    if (Width<DT>::SIZE == 4) return ((const u32*)src)[i];
    return ((const u16*)src)[i];
}

template <int DT> __device__ __forceinline__ void store1(u8* __restrict__ dst, u64 i, u32 v) {
    if (Width<DT>::SIZE == 4) ((u32*)dst)[i] = v;
    else ((u16*)dst)[i] = (u16)v;
}

// ---------------------------------------------------------------------------------------------
// Casts (prepare/cast.rs): n elements of FROM to TO. Each thread converts 8 elements per step
// with 16-byte loads and stores when both pointers are 16-byte aligned (a uniform branch), then
// the tail (or everything, when unaligned) one element at a time. Same-dtype casts are copies
// and never reach a kernel.

template <int FROM, int TO>
__device__ __forceinline__ void cast_body(const u8* __restrict__ src, u8* __restrict__ dst, u64 n) {
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const bool vec = ((((u64)src) | ((u64)dst)) & 15u) == 0;
    const u64 groups = vec ? n / 8 : 0;
    for (u64 g = tid; g < groups; g += stride) {
        u32 in[Width<FROM>::WORDS];
        load8_vec<FROM>(src, g * 8, in);
        u32 out[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) out[j] = from_f32<TO>(to_f32<FROM>(elem<FROM>(in, j)));
        uint4* q = (uint4*)(dst + g * 8 * Width<TO>::SIZE);
        if (Width<TO>::SIZE == 4) {
            q[0] = make_uint4(out[0], out[1], out[2], out[3]);
            q[1] = make_uint4(out[4], out[5], out[6], out[7]);
        } else {
            q[0] = make_uint4(out[0] | (out[1] << 16), out[2] | (out[3] << 16),
                              out[4] | (out[5] << 16), out[6] | (out[7] << 16));
        }
    }
    for (u64 i = groups * 8 + tid; i < n; i += stride) {
        store1<TO>(dst, i, from_f32<TO>(to_f32<FROM>(load1<FROM>(src, i))));
    }
}

#define WS_CAST(NAME, FROM, TO)                                                                    \
    extern "C" __global__ void __launch_bounds__(WS_CAST_THREADS)                                 \
    NAME(const u8* __restrict__ src, u8* __restrict__ dst, u64 n) {                               \
        cast_body<FROM, TO>(src, dst, n);                                                          \
    }
WS_CAST(ws_cast_bf16_f16, DT_BF16, DT_F16)
WS_CAST(ws_cast_bf16_f32, DT_BF16, DT_F32)
WS_CAST(ws_cast_f16_bf16, DT_F16, DT_BF16)
WS_CAST(ws_cast_f16_f32, DT_F16, DT_F32)
WS_CAST(ws_cast_f32_bf16, DT_F32, DT_BF16)
WS_CAST(ws_cast_f32_f16, DT_F32, DT_F16)

// ---------------------------------------------------------------------------------------------
// fp8 e4m3fn block quantisation (prepare/fp8.rs), one pass, register-resident.
//
// One block of WS_QUANT_THREADS threads per WS_TILE x WS_TILE tile (a 1-D grid over the tiles,
// row-major). The tile is cut into chunks of 8 elements of one row; a thread holds PASSES chunks
// (rows g, g + ROWS_PER_PASS, ...; chunk q of each), loaded at once (PASSES independent loads in
// flight), takes the max of their finite keys, and after the block-wide max quantises them from
// its registers: the input is read from memory once.
//
// `vec`: cols % 8 == 0 and src (16 B) and values (8 B) aligned, so chunk q is columns 8q..8q+7,
// read with 16-byte loads and written with one 8-byte store. Otherwise chunk q is columns
// q, q + 16, ..., q + 112 (still coalesced across the threads of a row), read and written one
// element at a time. Elements outside the tensor load as 0 (a key of 0 changes no max) and are
// never stored.

#define CHUNK 8
#define CHUNKS_PER_ROW (WS_TILE / CHUNK)
#define ROWS_PER_PASS (WS_QUANT_THREADS / CHUNKS_PER_ROW)
#define PASSES (WS_TILE / ROWS_PER_PASS)
#define WARPS (WS_QUANT_THREADS / 32)

static_assert(WS_TILE % CHUNK == 0, "a tile row is whole chunks");
static_assert(WS_QUANT_THREADS % CHUNKS_PER_ROW == 0, "threads cover whole rows");
static_assert(WS_TILE % ROWS_PER_PASS == 0, "passes cover the tile");
static_assert(WS_QUANT_THREADS % 32 == 0, "whole warps");

__device__ __forceinline__ u32 warp_max(u32 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffffu, v);
#else
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
#endif
}

template <int DT>
__device__ __forceinline__ void fp8_tile(const u8* __restrict__ src, u8* __restrict__ values,
                                         float* __restrict__ scales, u32 rows, u32 cols,
                                         u32 col_blocks, bool vec, bool hw, int recipe) {
    const int W = Width<DT>::WORDS;
    const u32 tile = blockIdx.x;
    const u32 rb = tile / col_blocks, cb = tile - rb * col_blocks;
    const u32 q = threadIdx.x % CHUNKS_PER_ROW;
    const u32 r0 = rb * WS_TILE + threadIdx.x / CHUNKS_PER_ROW;
    const u32 c0 = cb * WS_TILE + (vec ? q * CHUNK : q);
    const u32 cstep = vec ? 1 : CHUNKS_PER_ROW;   // column step between a chunk's elements

    u32 w[PASSES][W];
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        const u32 r = r0 + k * ROWS_PER_PASS;
        const u64 base = (u64)r * cols + c0;
        if (vec) {
            if (r < rows && c0 < cols) load8_vec<DT>(src, base, w[k]);
            else {
#pragma unroll
                for (int i = 0; i < W; ++i) w[k][i] = 0;
            }
        } else {
#pragma unroll
            for (int i = 0; i < W; ++i) w[k][i] = 0;
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                const u32 c = c0 + j * cstep;
                u32 e = (r < rows && c < cols) ? load1<DT>(src, base + j * cstep) : 0u;
                if (Width<DT>::SIZE == 4) w[k][j] = e;
                else w[k][j >> 1] |= e << ((j & 1) * 16);
            }
        }
    }

    u32 key = 0;
#pragma unroll
    for (int k = 0; k < PASSES; ++k)
#pragma unroll
        for (int j = 0; j < CHUNK; ++j) key = max(key, finite_key<DT>(elem<DT>(w[k], j)));

    // Block max of the keys' f32 bits (for non-negative floats the bit order is the value order).
    __shared__ u32 warp_keys[WARPS];
    u32 bits = warp_max(__float_as_uint(key_to_f32<DT>(key)));
    if ((threadIdx.x & 31) == 0) warp_keys[threadIdx.x >> 5] = bits;
    __syncthreads();
    bits = warp_keys[0];
#pragma unroll
    for (int i = 1; i < WARPS; ++i) bits = max(bits, warp_keys[i]);
    // The block's factor and stored scale as the recipe (Fp8Recipe::code) computes them, in
    // correctly rounded f32 operations like the CPU's (weightsync_common::fp8_recipe).
    const float raw = __uint_as_float(bits);
    const float amax = fmaxf(raw, 1e-4f);
    float inv, scale;
    if (recipe == 1) {          // transformers: fl(1 / amax) * 448, its reciprocal; 1 if zero
        inv = raw > 0.0f ? __fmul_rn(__frcp_rn(raw), 448.0f) : 1.0f;
        scale = raw > 0.0f ? __frcp_rn(inv) : 1.0f;
    } else if (recipe == 2) {   // DeepGEMM: sf = amax / 448, 1 / sf
        scale = __fdiv_rn(amax, 448.0f);
        inv = __frcp_rn(scale);
    } else {                    // vLLM: 448 / amax, amax / 448
        inv = __fdiv_rn(448.0f, amax);
        scale = __fdiv_rn(amax, 448.0f);
    }
    if (threadIdx.x == 0) scales[(u64)rb * col_blocks + cb] = scale;

#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        const u32 r = r0 + k * ROWS_PER_PASS;
        if (r >= rows) continue;
        // The CPU's product x * inv keeps the sign of x, NaN included (x86 returns a NaN
        // operand with its sign); the GPU's NaN result has none, so the sign is taken from x.
        u32 out[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < CHUNK; j += 2) {
            const u32 e0 = elem<DT>(w[k], j), e1 = elem<DT>(w[k], j + 1);
            const float p0 = __fmul_rn(quant_f32<DT>(e0), inv);
            const float p1 = __fmul_rn(quant_f32<DT>(e1), inv);
            u32 pair = hw ? e4m3x2_mag_hw(p0, p1) : (e4m3_mag(p0) | (e4m3_mag(p1) << 8));
            pair |= sign_bit<DT>(e0) | (sign_bit<DT>(e1) << 8);
            out[j >> 2] |= pair << ((j & 2) * 8);
        }
        const u64 base = (u64)r * cols + c0;
        if (vec) {
            if (c0 < cols) *(uint2*)(values + base) = make_uint2(out[0], out[1]);
        } else {
#pragma unroll
            for (int j = 0; j < CHUNK; ++j)
                if (c0 + j * cstep < cols) values[base + j * cstep] = (u8)(out[j >> 2] >> ((j & 3) * 8));
        }
    }
}

// values: [rows, cols] e4m3fn; scales: [ceil(rows/TILE), col_blocks] f32, row-major.
// Blocks per SM the register budget is set for: a bf16 tile takes half the registers of an f32
// one, so three blocks' loads can be in flight instead of two (f16's longer conversion would
// spill at three).
#define WS_FP8(NAME, DT, BLOCKS_PER_SM)                                                            \
    extern "C" __global__ void __launch_bounds__(WS_QUANT_THREADS, BLOCKS_PER_SM)                 \
    NAME(const u8* __restrict__ src, u8* __restrict__ values, float* __restrict__ scales,         \
         u32 rows, u32 cols, u32 col_blocks, int vec, int hw, int recipe) {                       \
        fp8_tile<DT>(src, values, scales, rows, cols, col_blocks, vec != 0, hw != 0, recipe);     \
    }
WS_FP8(ws_fp8_bf16, DT_BF16, 3)
WS_FP8(ws_fp8_f16, DT_F16, 2)
WS_FP8(ws_fp8_f32, DT_F32, 2)

// ---------------------------------------------------------------------------------------------
// Whether the hardware conversion gives the emulated magnitudes for every one of the 2^32 f32
// bit patterns. result[0] counts the differing patterns, result[1] holds the smallest one
// (0xffffffff when none). Launched once per device by gpu/device.rs before the hardware path is
// used; on an arch without the instruction both sides are the emulation.
extern "C" __global__ void __launch_bounds__(256) ws_e4m3_hw_selftest(u32* result) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u32 bad = 0, first = 0xffffffffu;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 31); i += stride) {
        const u32 b0 = (u32)(i * 2), b1 = b0 + 1;
        const float f0 = __uint_as_float(b0), f1 = __uint_as_float(b1);
        const u32 want = e4m3_mag(f0) | (e4m3_mag(f1) << 8);
        const u32 got = e4m3x2_mag_hw(f0, f1);
        if (got != want) {
            bad += ((got ^ want) & 0xffu) != 0;
            bad += ((got ^ want) & 0xff00u) != 0;
            first = min(first, ((got ^ want) & 0xffu) ? b0 : b1);
        }
    }
    if (bad) {
        atomicAdd(&result[0], bad);
        atomicMin(&result[1], first);
    }
}
