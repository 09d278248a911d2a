// Runs gpu/kernels.cu on the CPU: the CUDA built-ins are defined here, each CUDA thread of a block
// is a std::thread, and the blocks of a grid run one after another, with __syncthreads and the
// warp shuffles as barriers over the block. It exists so the kernels' indexing, tiling, packing,
// partial tiles, vector and scalar paths and reductions can be compared with the CPU kernels on
// a machine without a GPU (check/host.rs). What it cannot show: the GPU's own float behaviour
// (the host's IEEE arithmetic stands in for __fadd_rn / __fmul_rn / __fdiv_rn, which is what
// they are) and the hardware e4m3 conversion (__CUDA_ARCH__ is unset, so the emulation is
// compiled in its place; the device's self-test covers that one).
//
//   host_emulation fp8  DTYPE ROWS COLS VEC IN VALUES_OUT SCALES_OUT
//   host_emulation cast FROM TO N OFFSET IN OUT        (dtype codes 0 bf16, 1 f16, 2 f32;
//                                                        OFFSET in elements, both buffers)
// Compile: c++ -std=c++20 -O2 -ffp-contract=off -pthread -DWS_TILE=128 -DWS_QUANT_THREADS=256
//          -DWS_CAST_THREADS=256 host_emulation.cpp

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 0, y = 0, z = 0;
};
thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
dim3 blockDim, gridDim;

struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }

#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

static std::barrier<>* block_barrier = nullptr;
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }

static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __int2float_rn(int i) { return (float)i; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

// A shuffle is a block-wide exchange: every thread of the block calls it together (the kernels'
// reductions are reached by all threads).
static unsigned shuffle_lanes[1024];
static inline unsigned __shfl_xor_sync(unsigned, unsigned v, int off) {
    shuffle_lanes[threadIdx.x] = v;
    block_barrier->arrive_and_wait();
    unsigned lane = threadIdx.x & 31u;
    unsigned r = shuffle_lanes[(threadIdx.x - lane) + (lane ^ (unsigned)off)];
    block_barrier->arrive_and_wait();
    return r;
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
static inline unsigned atomicMin(unsigned* p, unsigned v) {
    std::atomic_ref<unsigned> a(*p);
    unsigned old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {}
    return old;
}

#include "../kernels.cu"

// Runs `kernel` over `blocks` blocks of `threads` threads.
static void launch(unsigned blocks, unsigned threads, const std::function<void()>& kernel) {
    blockDim = {threads, 1, 1};
    gridDim = {blocks, 1, 1};
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            for (unsigned b = 0; b < blocks; ++b) {
                blockIdx = {b, 0, 0};
                kernel();
                barrier.arrive_and_wait();
            }
        });
    }
    for (auto& th : pool) th.join();
}

static std::vector<u8> read_file(const char* path) {
    std::vector<u8> v;
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::perror(path); std::exit(2); }
    u8 buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + n);
    std::fclose(f);
    return v;
}

static void write_file(const char* path, const u8* p, size_t n) {
    FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(p, 1, n, f) != n) { std::perror(path); std::exit(2); }
    std::fclose(f);
}

static int size_of(int dt) { return dt == DT_F32 ? 4 : 2; }

// 16-byte aligned storage for `n` bytes at `offset` bytes in.
struct Buffer {
    std::vector<uint4> storage;
    u8* at;
    Buffer(size_t n, size_t offset, u8 fill) : storage((n + offset) / 16 + 2) {
        std::memset(storage.data(), fill, storage.size() * 16);
        at = (u8*)storage.data() + offset;
    }
};

int main(int argc, char** argv) {
    if ((argc == 9 || argc == 10) && !std::strcmp(argv[1], "fp8")) {
        int dt = std::atoi(argv[2]);
        int recipe = argc == 10 ? std::atoi(argv[9]) : 0;  // Fp8Recipe::code, vLLM's by default
        u32 rows = (u32)std::atol(argv[3]), cols = (u32)std::atol(argv[4]);
        int vec = std::atoi(argv[5]);
        std::vector<u8> in = read_file(argv[6]);
        u32 rb = (rows + WS_TILE - 1) / WS_TILE, cb = (cols + WS_TILE - 1) / WS_TILE;
        // Offset by one element unless the vector path is asked for (which needs alignment).
        size_t off = vec ? 0 : size_of(dt);
        Buffer src(in.size(), off, 0);
        std::memcpy(src.at, in.data(), in.size());
        Buffer values((size_t)rows * cols, vec ? 0 : 1, 0x5a), scales((size_t)rb * cb * 4, 0, 0x5a);
        auto f = dt == DT_BF16 ? ws_fp8_bf16 : dt == DT_F16 ? ws_fp8_f16 : ws_fp8_f32;
        launch(rb * cb, WS_QUANT_THREADS, [&] {
            f(src.at, values.at, (float*)scales.at, rows, cols, cb, vec, 0, recipe);
        });
        write_file(argv[7], values.at, (size_t)rows * cols);
        write_file(argv[8], scales.at, (size_t)rb * cb * 4);
        return 0;
    }
    if (argc == 8 && !std::strcmp(argv[1], "cast")) {
        int from = std::atoi(argv[2]), to = std::atoi(argv[3]);
        u64 n = (u64)std::atoll(argv[4]);
        size_t off = (size_t)std::atol(argv[5]);
        std::vector<u8> in = read_file(argv[6]);
        Buffer src(in.size(), off * size_of(from), 0);
        std::memcpy(src.at, in.data(), in.size());
        Buffer dst(n * size_of(to), off * size_of(to), 0x5a);
        void (*f)(const u8*, u8*, u64) = nullptr;
        if (from == DT_BF16 && to == DT_F16) f = ws_cast_bf16_f16;
        if (from == DT_BF16 && to == DT_F32) f = ws_cast_bf16_f32;
        if (from == DT_F16 && to == DT_BF16) f = ws_cast_f16_bf16;
        if (from == DT_F16 && to == DT_F32) f = ws_cast_f16_f32;
        if (from == DT_F32 && to == DT_BF16) f = ws_cast_f32_bf16;
        if (from == DT_F32 && to == DT_F16) f = ws_cast_f32_f16;
        if (!f) { std::fprintf(stderr, "no cast kernel %d -> %d\n", from, to); return 2; }
        // Three blocks: the grid-stride loops wrap around several times.
        launch(3, WS_CAST_THREADS, [&] { f(src.at, dst.at, n); });
        write_file(argv[7], dst.at, n * size_of(to));
        return 0;
    }
    std::fprintf(stderr, "usage: see the header of host_emulation.cpp\n");
    return 2;
}
