// lightning_zenflow's native CPU kernels: the engine's elementwise kernels, bit for bit equal to their eager torch
// definitions (engine/host_step.py's adam_step_ and adam_master_step_; engine/kernels.py's moves_fp32_, moves_bf16_,
// landing_add_, accumulate_bf16_; row_col_sums to float rounding; engine/device.py's gather_columns and write_columns),
// over raw pointers, loaded with ctypes (lightning_zenflow/native/__init__.py has the wrappers, build.py the build).
//
// How it is built. This one file is compiled once per instruction set, with -DZF_VARIANT=<n> and that set's -m flags
// (0: portable C++, 1: AVX2, 2: AVX-512 F/BW/VL/DQ, 3: the same with AVX512-BF16), as ATen compiles its CPU kernels
// once per capability, and the objects are linked into one library; the variant-0 object also holds the C API, the
// run-time choice of variant and the thread pool. Each variant's code has internal linkage (an anonymous namespace) and
// uses no inline function or template of a library: the linker keeps one copy of such a function across objects,
// and the one it keeps could carry AVX-512 instructions onto a machine without them.
//
// Why the bits are eager torch's. Every operation is one IEEE fp32 operation, in the eager function's order, on
// operands rounded as torch rounds them (a Python float scalar is rounded to fp32 first): no fused multiply-add
// (-ffp-contract=off, and no FMA intrinsic), no reassociation (no -ffast-math), no flush of subnormals (FTZ/DAZ are
// never set), sqrt and division correctly rounded (sqrtps, divps, and sqrtf compiled to sqrtss by -fno-math-errno).
// bf16 loads are exact (the high half of an fp32 pattern); bf16 stores round to nearest even in integer arithmetic, as
// c10::BFloat16 does, subnormals included (AVX512-BF16's vcvtneps2bf16 flushes subnormal inputs to zero: variant 3
// uses it only for vectors that hold no subnormal, checked with vfpclassps). The stochastic rounding is
// engine/rounding.py's: the random 16-bit r added to the fp32 pattern, the low half cut, NaN kept a NaN (any payload).
// Loop tails run the same template with the portable one-lane type: the same operations, so the same bits.
//
// Cost model (written before optimising; the benchmark measures against it: benchmarks/kernel_bench.py). Per element:
//
// - the host step, compact state (bf16 window, bf16 moments, no master): reads g, m, v (2 + 2 + 2 B), writes m, v,
//   step (2 + 2 + 2 B): 12 B, against fused AdamW's 28 B over fp32 state. The lattice's column table is 4 B per
//   column, read once per row from L1. Vector operations per 16 elements (AVX-512): widen 3 x 2; arithmetic 11
//   (mean; m: sub, mul, add; v: mul, square, mul, add; denominator: mul, add; numerator: mul) + sqrt + div; round to
//   nearest for m and step 2 x (6 + 2 to narrow); the stochastic v 9 (lattice 3, cut 2, NaN 2, narrow 2): about 44,
//   2.75 per element. Zen 4 issues about two 512-bit operations a cycle and its divider takes a 16-lane sqrt and a
//   division in about 15 cycles (about 1 cycle per element, beside the rest): about 1.4 cycles per element, about
//   2.5 G elements/s on one core at 3.5 GHz, against the memory's 3.6 G/s at 12 B (this machine's add_ stream, 43 GB/s
//   one thread) and fused AdamW's 1.56 G/s: the step is bound by its arithmetic on one core and by memory on two.
//   Measured against it (this machine, 16 M elements in four [1024, 4096] matrices, one thread, thread CPU time so that
//   the machine's other users do not count, AVX512-BF16 variant): the divider alone (a loop of sqrt and division) takes
//   0.27 ns per element, 3.7 G/s; the step with its data in L2 3.0 G/s; from memory, the first version (16 lanes a
//   step, round to nearest in integers) 1.66 G/s, this one 2.6-2.8 G/s (fused AdamW 1.4-1.65 G/s in the same runs).
//   What closed the gap: 64 elements a step (a pair of pairs of registers: more independent work beside the divider's
//   latency), bf16 narrowed with one two-source word permute per 32 lanes, AVX512-BF16's vcvtne2ps2bf16 for round to
//   nearest, NaN and subnormal lanes checked with vfpclassps and handled out of line, the lattice's 16-bit sum in one
//   masked vpaddw, and every line prefetched 1 KiB ahead (6-12 %).
// - fp32 state: 24 B, the same arithmetic without the narrowing: bound by memory (measured 1.6-1.7 G/s, 40 GB/s: about
//   fused AdamW's parameters per second, whose 28 B it nearly moves).
// - the moves (moves_fp32_, moves_bf16_): read g and w, write w: 12 B (fp32) or 6 B (bf16); arithmetic 8 + a division
//   (7 without a loss scaler's keep: x * 1 is x); the bf16 hash 9 integer operations (two 32-bit multiplies; the
//   column's term is carried from step to step by an addition). landing_add_: 12 or 6 B, 2 operations (+ the hash).
//   accumulate_bf16_: 4 + (2 or 4) B, 1 addition + the lattice's rounding. row_col_sums: reads g once (2 or 4 B), two
//   multiplies and two additions; its column partial sums are 4 B per column per block of at least 64 rows (< 2 %).
//   Measured (one core, thread CPU time, the offload benchmark's 25 M fp32 elements as backward leaves them): the fp32
//   move pass 2.4-2.7 G elements/s, within 10-25 % of a plain add_ of the same streams; the 16-lane division (about one
//   every 10 cycles on Zen 4) fills the out-of-order window, and prefetching lines into L2 ahead, 6 KiB or more, sped
//   up a C loop over one matrix by 25 % but slowed the pass over torch's tensors by 5-10 %: not kept. bf16 moves are
//   bound by their arithmetic: 3.1 -> 3.7 G/s with the two changes above. The window sum runs at the memory's speed.
// - the selected columns (gather_columns, write_columns): k of the row's columns, read (4 or 2 B) into a packed fp32
//   row, or written back (rounded to the weight's dtype); each touches every line holding a selected column, 81 % of
//   them at rho = 0.1: as much memory as reading the gradient (gather), and reading and writing the weights (write).
//
// Threads. A call is split into tiles fixed by the data (rows, or column spans of one row for a wide matrix), run by
// the calling thread and up to threads - 1 workers of one persistent pool that take tiles from an atomic counter; an
// elementwise tile's bits do not depend on which thread runs it. row_col_sums' blocks are fixed by the shape too, and
// their partial sums are added in block order: its sums do not depend on the thread count either. A small call runs on
// the calling thread alone (no wake-up); a call that finds the pool busy (another thread's call) runs alone too. The
// workers follow the caller's CPU affinity, and a forked child starts a pool of its own. Measured per call: about 6 us
// of Python and ctypes for a small matrix (ctypes' 18 arguments 2.4 us of it); below 128 K elements no wake-up.

#include <cstdint>
#include <cstring>

#if ZF_VARIANT >= 1
#include <immintrin.h>  // a third of a variant's build time: the portable object does without it
#endif

#ifndef ZF_VARIANT
#error "compile with -DZF_VARIANT=0 (portable, with the API), 1 (AVX2), 2 (AVX-512) or 3 (AVX-512 with BF16)"
#endif

// ------------------------------------------------------------------------------------------ shared declarations
// Plain structs of arguments, the same in every object. Strides are in elements, between the starts of two rows.
struct AdamArgs {
    float* master;  // fp32 [rows, cols] or null
    int64_t master_stride;
    void* grad;  // the window's sum (fp32 or bf16); the step is written over it when there is no master
    int64_t grad_stride;
    void* exp_avg;
    int64_t exp_avg_stride;
    void* exp_avg_sq;
    int64_t exp_avg_sq_stride;
    const int32_t* row_r;  // the lattice's tables (engine/rounding.py): [rows] and [cols]
    const int32_t* col_r;
    float scalars[11];  // engine/host_step.py's SCALARS
    uint32_t offset;    // the lattice offset, scalars[8] as int32
};

struct MovesArgs {
    const void* grad;
    int64_t grad_stride;
    void* weight;
    int64_t weight_stride;
    const float* row_scale;  // [rows]
    const float* col_scale;  // [cols]
    const float* mask;       // [cols]
    float eps, coefficient, keep;
    uint32_t row_offset, seed;  // the hash's global row offset and seed (engine/kernels.py's _random_low_bits)
};

struct LandingArgs {
    void* weight;
    int64_t weight_stride;
    const void* step;
    int64_t step_stride;
    float scale;
    uint32_t row_offset, seed;
};

struct AccumulateArgs {
    void* acc;
    int64_t acc_stride;
    const void* grad;
    int64_t grad_stride;
    const int32_t* row_r;
    const int32_t* col_r;
    uint32_t offset;
};

struct SumsArgs {
    const void* grad;
    int64_t grad_stride;
    const float* mask;
    int64_t rows, cols;
    int64_t block_rows;   // rows of one block (fixed by the shape)
    int64_t span_cols;    // columns of one span (fixed)
    int64_t spans;        // spans per row
    float* row_partial;   // [rows, spans] (spans > 1) or the output [rows]
    float* col_partial;   // [blocks, cols]
};

// The selected columns (engine/device.py's gather_columns, write_columns): column index[c] of the matrix is column c of
// the packed fp32 [rows, k] buffer (the gathered gradient, or the masters written back).
struct ColumnsArgs {
    void* matrix;  // the gradient (read) or the weights (written), [rows, cols]
    int64_t matrix_stride;
    float* packed;  // fp32 [rows, k]: the gathered columns (written) or the masters (read)
    int64_t packed_stride;
    const int64_t* index;  // [k], each in [0, cols) (checked before any tile runs)
};

typedef void (*AdamSpan)(const AdamArgs*, int64_t, int64_t, int64_t, int64_t);
typedef void (*MovesSpan)(const MovesArgs*, int64_t, int64_t, int64_t, int64_t);
typedef void (*LandingSpan)(const LandingArgs*, int64_t, int64_t, int64_t, int64_t);
typedef void (*AccumulateSpan)(const AccumulateArgs*, int64_t, int64_t, int64_t, int64_t);
typedef void (*ColumnsSpan)(const ColumnsArgs*, int64_t, int64_t, int64_t, int64_t);
typedef void (*SumsTile)(const SumsArgs*, int64_t block, int64_t span);
typedef void (*SumsCombine)(const float* partial, int64_t blocks, int64_t cols, int64_t j0, int64_t j1, float* out);

// One variant's kernels. A span function runs rows [i0, i1) over columns [j0, j1). Indices: 1 for bf16, 0 for fp32.
struct KernelTable {
    AdamSpan adam[2][2][2][2];              // [grad bf16][state bf16][master][stochastic]
    MovesSpan moves[2][2][2];               // [grad bf16][weight bf16][stochastic]
    LandingSpan landing[2][2];              // [weight bf16][step bf16] (stochastic exactly when the weight is bf16)
    AccumulateSpan accumulate[2][2][2];     // [acc bf16][grad bf16][first]
    ColumnsSpan gather[2];                  // [grad bf16]
    ColumnsSpan write[2];                   // [weight bf16]
    SumsTile sums[2];                       // [grad bf16]
    SumsCombine combine;
};

#define ZF_ROW_MULTIPLIER 0x2C1B3C6Du
#define ZF_COL_MULTIPLIER 0x297A2D39u
#define ZF_MIX_MULTIPLIER 0x5BD1E995u
#define ZF_QUIET 0x00400000u  // or-ed into a NaN's pattern: its high half stays a NaN

#if ZF_VARIANT == 0
#define ZF_NAMESPACE zf_portable
#elif ZF_VARIANT == 1
#define ZF_NAMESPACE zf_avx2
#elif ZF_VARIANT == 2
#define ZF_NAMESPACE zf_avx512
#elif ZF_VARIANT == 3
#define ZF_NAMESPACE zf_avx512bf16
#endif

namespace zf_portable { const KernelTable* table(); }
namespace zf_avx2 { const KernelTable* table(); }
namespace zf_avx512 { const KernelTable* table(); }
namespace zf_avx512bf16 { const KernelTable* table(); }

// ------------------------------------------------------------------------------------------ the vector types
namespace ZF_NAMESPACE {
namespace {

typedef uint16_t bf16;
template <class T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<bf16> { static constexpr bool value = true; };

inline uint32_t bits_of(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
inline float float_of(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }

template <class V>
inline typename V::I nearest_bf16(typename V::F x);
template <class V>
inline typename V::I stochastic_bf16(typename V::F x, typename V::I r);

// One lane: the portable code, and every variant's loop tails.
struct One {
    static constexpr int N = 1;
    typedef float F;
    typedef uint32_t I;
    typedef bool M;
    static F load(const float* p) { return *p; }
    static F load(const bf16* p) { return float_of(uint32_t(*p) << 16); }
    static I load_i(const int32_t* p) { return uint32_t(*p); }
    static void store(float* p, F x) { *p = x; }
    static void store_bits(float* p, I b) { *p = float_of(b); }
    static void store_high(bf16* p, I b) { *p = bf16(b >> 16); }
    static void store_nearest(bf16* p, F x) { store_high(p, nearest_bf16<One>(x)); }
    static void store_stochastic(bf16* p, F x, I r) { store_high(p, stochastic_bf16<One>(x, r)); }
    static I low16_add(I a, I b) { return (a + b) & 0xFFFFu; }
    static F set(float x) { return x; }
    static I seti(uint32_t x) { return x; }
    static I iota() { return 0; }
    static F add(F a, F b) { return a + b; }
    static F sub(F a, F b) { return a - b; }
    static F mul(F a, F b) { return a * b; }
    static F div(F a, F b) { return a / b; }
    static F sqrt(F x) { return __builtin_sqrtf(x); }
    static F neg(F x) { return float_of(bits_of(x) ^ 0x80000000u); }
    // clamp(x, -1, 1) with torch's NaN propagation
    static F clamp_unit(F x) { return x != x ? x : (x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x)); }
    static I bits(F x) { return bits_of(x); }
    static F floats(I b) { return float_of(b); }
    static I iadd(I a, I b) { return a + b; }
    static I iand(I a, I b) { return a & b; }
    static I ior(I a, I b) { return a | b; }
    static I ixor(I a, I b) { return a ^ b; }
    static I imul(I a, I b) { return a * b; }
    template <int k> static I srl(I a) { return a >> k; }
    static M nan(F x) { return x != x; }
    static I select(M m, I t, I f) { return m ? t : f; }
};

// round to nearest even, as c10::BFloat16: the pattern + 0x7FFF + its bit 16 (the high half is the bf16); a NaN
// stays a NaN
template <class V>
inline typename V::I nearest_bf16(typename V::F x) {
    typename V::I b = V::bits(x);
    typename V::I lsb = V::iand(V::template srl<16>(b), V::seti(1));
    typename V::I rounded = V::iadd(V::iadd(b, V::seti(0x7FFF)), lsb);
    return V::select(V::nan(x), V::ior(b, V::seti(ZF_QUIET)), rounded);
}

// engine/rounding.py's round_bf16: the pattern + r (16 random bits), whose high half is the bf16 (put_stochastic cuts
// the low half for an fp32 store); a NaN stays a NaN
template <class V>
inline typename V::I stochastic_bf16(typename V::F x, typename V::I r) {
    typename V::I b = V::bits(x);
    return V::select(V::nan(x), V::ior(b, V::seti(ZF_QUIET)), V::iadd(b, r));
}

#if ZF_VARIANT == 1
struct Vec {
    static constexpr int N = 8;
    typedef __m256 F;
    typedef __m256i I;
    typedef __m256 M;
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static F load(const bf16* p) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    static I load_i(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
    static void store_bits(float* p, I b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }
    // the high halves of 16 lanes: packus gives [lo0..3 hi0..3 | lo4..7 hi4..7], quadwords 0 2 1 3 put them in order
    static void store_high2(bf16* p, I lo, I hi) {
        __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
    }
    static void store_nearest2(bf16* p, F lo, F hi) { store_high2(p, nearest_bf16<Vec>(lo), nearest_bf16<Vec>(hi)); }
    static void store_stochastic2(bf16* p, F lo, F hi, I r_lo, I r_hi) {
        store_high2(p, stochastic_bf16<Vec>(lo, r_lo), stochastic_bf16<Vec>(hi, r_hi));
    }
    static void load2(const bf16* p, F& lo, F& hi) { lo = load(p); hi = load(p + N); }
    static I low16_add(I a, I b) { return _mm256_and_si256(_mm256_add_epi32(a, b), seti(0xFFFF)); }
    static F set(float x) { return _mm256_set1_ps(x); }
    static I seti(uint32_t x) { return _mm256_set1_epi32(int32_t(x)); }
    static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F div(F a, F b) { return _mm256_div_ps(a, b); }
    static F sqrt(F x) { return _mm256_sqrt_ps(x); }
    static F neg(F x) { return _mm256_xor_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u)))); }
    // maxps and minps return their second operand when either is NaN: a NaN x comes through both
    static F clamp_unit(F x) { return _mm256_min_ps(set(1.0f), _mm256_max_ps(set(-1.0f), x)); }
    static I bits(F x) { return _mm256_castps_si256(x); }
    static F floats(I b) { return _mm256_castsi256_ps(b); }
    static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
    static I iand(I a, I b) { return _mm256_and_si256(a, b); }
    static I ior(I a, I b) { return _mm256_or_si256(a, b); }
    static I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
    static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
    template <int k> static I srl(I a) { return _mm256_srli_epi32(a, k); }
    static M nan(F x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }
    static I select(M m, I t, I f) {
        return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(f), _mm256_castsi256_ps(t), m));
    }
};
#elif ZF_VARIANT >= 2
// word 2k + 1 of two registers (vpermt2w's second table from index 32): the high halves of 32 lanes, in order
alignas(64) const uint16_t HIGH_HALVES[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                             33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
constexpr int SUBNORMAL = 0x20;   // vfpclassps categories
constexpr int NAN_CLASS = 0x81;   // quiet or signalling NaN

struct Vec {
    static constexpr int N = 16;
    typedef __m512 F;
    typedef __m512i I;
    typedef __mmask16 M;
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static F load(const bf16* p) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    static I load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
    static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
    static void store_bits(float* p, I b) { _mm512_storeu_si512(p, b); }
    static void store_high2(bf16* p, I lo, I hi) {
        _mm512_storeu_si512(p, _mm512_permutex2var_epi16(lo, _mm512_load_si512(HIGH_HALVES), hi));
    }
    // The stores check for the rare lanes that need care (a NaN, whose payload the rounding could turn into an
    // infinity; a subnormal, which vcvtne2ps2bf16 would flush) with one vfpclassps per register instead of handling
    // them in every lane.
    static void store_nearest2(bf16* p, F lo, F hi) {
#if ZF_VARIANT == 3
        // vcvtne2ps2bf16 rounds to nearest even (a NaN to a NaN) but flushes subnormal inputs to zero
        if ((_mm512_fpclass_ps_mask(lo, SUBNORMAL) | _mm512_fpclass_ps_mask(hi, SUBNORMAL)) == 0) {
            _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            return;
        }
#else
        if ((_mm512_fpclass_ps_mask(lo, NAN_CLASS) | _mm512_fpclass_ps_mask(hi, NAN_CLASS)) == 0) {
            store_high2(p, rounded_to_nearest(lo), rounded_to_nearest(hi));
            return;
        }
#endif
        store_high2(p, nearest_bf16<Vec>(lo), nearest_bf16<Vec>(hi));
    }
    static void store_stochastic2(bf16* p, F lo, F hi, I r_lo, I r_hi) {
        if ((_mm512_fpclass_ps_mask(lo, NAN_CLASS) | _mm512_fpclass_ps_mask(hi, NAN_CLASS)) == 0) {
            store_high2(p, _mm512_add_epi32(bits(lo), r_lo), _mm512_add_epi32(bits(hi), r_hi));
            return;
        }
        store_high2(p, stochastic_bf16<Vec>(lo, r_lo), stochastic_bf16<Vec>(hi, r_hi));
    }
    // nearest_bf16 without its NaN lanes
    static I rounded_to_nearest(F x) {
        I b = bits(x);
        return iadd(iadd(b, seti(0x7FFF)), iand(srl<16>(b), seti(1)));
    }
    static void load2(const bf16* p, F& lo, F& hi) {
        lo = load(p);
        hi = load(p + N);
    }
    // (a + b) mod 2**16 in the low half of each lane, zero above: one 16-bit add
    static I low16_add(I a, I b) { return _mm512_maskz_add_epi16(0x55555555u, a, b); }
    static F set(float x) { return _mm512_set1_ps(x); }
    static I seti(uint32_t x) { return _mm512_set1_epi32(int32_t(x)); }
    static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F div(F a, F b) { return _mm512_div_ps(a, b); }
    static F sqrt(F x) { return _mm512_sqrt_ps(x); }
    static F neg(F x) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), seti(0x80000000u))); }
    static F clamp_unit(F x) { return _mm512_min_ps(set(1.0f), _mm512_max_ps(set(-1.0f), x)); }
    static I bits(F x) { return _mm512_castps_si512(x); }
    static F floats(I b) { return _mm512_castsi512_ps(b); }
    static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
    static I iand(I a, I b) { return _mm512_and_si512(a, b); }
    static I ior(I a, I b) { return _mm512_or_si512(a, b); }
    static I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
    static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
    template <int k> static I srl(I a) { return _mm512_srli_epi32(a, k); }
    static M nan(F x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
    static I select(M m, I t, I f) { return _mm512_mask_blend_epi32(m, f, t); }
};
#endif

#if ZF_VARIANT >= 1
// Two registers side by side: a bf16 store narrows 32 (AVX-512) or 16 (AVX2) lanes at once. Wide, what the loops
// step by, is a pair of pairs: four independent registers of work keep the divider (sqrt and division, the step's
// bound on one core) busy while the rest waits for it.
template <class B>
struct Pair {
    static constexpr int N = 2 * B::N;
    struct F { typename B::F lo, hi; };
    struct I { typename B::I lo, hi; };
    struct M { typename B::M lo, hi; };
    static F load(const float* p) { return {B::load(p), B::load(p + B::N)}; }
    static F load(const bf16* p) {
        F x;
        B::load2(p, x.lo, x.hi);
        return x;
    }
    static I load_i(const int32_t* p) { return {B::load_i(p), B::load_i(p + B::N)}; }
    static void store(float* p, F x) { B::store(p, x.lo); B::store(p + B::N, x.hi); }
    static void store_bits(float* p, I b) { B::store_bits(p, b.lo); B::store_bits(p + B::N, b.hi); }
    static void store_high(bf16* p, I b) { B::store_high2(p, b.lo, b.hi); }
    static void store_nearest(bf16* p, F x) { B::store_nearest2(p, x.lo, x.hi); }
    static void store_stochastic(bf16* p, F x, I r) { B::store_stochastic2(p, x.lo, x.hi, r.lo, r.hi); }
    // a Pair of Pairs (what Wide is) forwards to its halves
    static void load2(const bf16* p, F& lo, F& hi) {
        lo = load(p);
        hi = load(p + N);
    }
    static void store_high2(bf16* p, I lo, I hi) {
        store_high(p, lo);
        store_high(p + N, hi);
    }
    static void store_nearest2(bf16* p, F lo, F hi) {
        store_nearest(p, lo);
        store_nearest(p + N, hi);
    }
    static void store_stochastic2(bf16* p, F lo, F hi, I r_lo, I r_hi) {
        store_stochastic(p, lo, r_lo);
        store_stochastic(p + N, hi, r_hi);
    }
    static I low16_add(I a, I b) { return {B::low16_add(a.lo, b.lo), B::low16_add(a.hi, b.hi)}; }
    static F set(float x) { return {B::set(x), B::set(x)}; }
    static I seti(uint32_t x) { return {B::seti(x), B::seti(x)}; }
    static I iota() { return {B::iota(), B::iadd(B::iota(), B::seti(B::N))}; }
    static F add(F a, F b) { return {B::add(a.lo, b.lo), B::add(a.hi, b.hi)}; }
    static F sub(F a, F b) { return {B::sub(a.lo, b.lo), B::sub(a.hi, b.hi)}; }
    static F mul(F a, F b) { return {B::mul(a.lo, b.lo), B::mul(a.hi, b.hi)}; }
    static F div(F a, F b) { return {B::div(a.lo, b.lo), B::div(a.hi, b.hi)}; }
    static F sqrt(F x) { return {B::sqrt(x.lo), B::sqrt(x.hi)}; }
    static F neg(F x) { return {B::neg(x.lo), B::neg(x.hi)}; }
    static F clamp_unit(F x) { return {B::clamp_unit(x.lo), B::clamp_unit(x.hi)}; }
    static I bits(F x) { return {B::bits(x.lo), B::bits(x.hi)}; }
    static F floats(I b) { return {B::floats(b.lo), B::floats(b.hi)}; }
    static I iadd(I a, I b) { return {B::iadd(a.lo, b.lo), B::iadd(a.hi, b.hi)}; }
    static I iand(I a, I b) { return {B::iand(a.lo, b.lo), B::iand(a.hi, b.hi)}; }
    static I ior(I a, I b) { return {B::ior(a.lo, b.lo), B::ior(a.hi, b.hi)}; }
    static I ixor(I a, I b) { return {B::ixor(a.lo, b.lo), B::ixor(a.hi, b.hi)}; }
    static I imul(I a, I b) { return {B::imul(a.lo, b.lo), B::imul(a.hi, b.hi)}; }
    template <int k> static I srl(I a) { return {B::template srl<k>(a.lo), B::template srl<k>(a.hi)}; }
    static M nan(F x) { return {B::nan(x.lo), B::nan(x.hi)}; }
    static I select(M m, I t, I f) { return {B::select(m.lo, t.lo, f.lo), B::select(m.hi, t.hi, f.hi)}; }
};
typedef Pair<Pair<Vec>> Wide;
#else
typedef One Vec;
typedef One Wide;
#endif

// ------------------------------------------------------------------------------------------ stores
// x stored as its tensor's dtype by copy_: fp32 as is, bf16 rounded to nearest even
template <class V>
inline void put_nearest(float* p, typename V::F x) { V::store(p, x); }
template <class V>
inline void put_nearest(bf16* p, typename V::F x) { V::store_nearest(p, x); }

// x rounded stochastically with the random 16 bits r (engine/rounding.py's round_bf16), stored as its tensor's dtype:
// bf16, or the bf16 value in fp32 (the pattern cut: copy_ of a bf16 tensor into an fp32 one)
template <class V>
inline void put_stochastic(float* p, typename V::F x, typename V::I r) {
    V::store_bits(p, V::iand(stochastic_bf16<V>(x, r), V::seti(0xFFFF0000u)));
}
template <class V>
inline void put_stochastic(bf16* p, typename V::F x, typename V::I r) { V::store_stochastic(p, x, r); }

// engine/kernels.py's _random_low_bits from x = row * ROW_MULTIPLIER + col * COL_MULTIPLIER + seed (uint32, wrapping)
template <class V>
inline typename V::I hash_bits(typename V::I x) {
    x = V::imul(V::ixor(x, V::template srl<15>(x)), V::seti(ZF_MIX_MULTIPLIER));
    x = V::imul(V::ixor(x, V::template srl<13>(x)), V::seti(ZF_COL_MULTIPLIER));
    return V::iand(V::ixor(x, V::template srl<16>(x)), V::seti(0xFFFF));
}

// The lines of one step of Wide, PREFETCH_BYTES ahead. The host step's divider keeps the out-of-order window full, so
// the hardware alone does not run far enough ahead of the compact state's streams (measured here on one core: 6-12 %
// faster with every line prefetched 1 KiB ahead; half the lines, or 4 KiB ahead into L2, was slower). A prefetch past
// the end of a buffer does not fault.
constexpr int PREFETCH_BYTES = 1024;
template <class T>
inline void prefetch_ahead(const T* p) {
#if ZF_VARIANT >= 1
    for (unsigned offset = 0; offset < Wide::N * sizeof(T); offset += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES + offset, _MM_HINT_T0);
    }
#else
    (void)p;  // one lane a step: a prefetch per element would cost more than it saves
#endif
}

template <class T>
inline T* row_of(void* base, int64_t stride, int64_t i) { return static_cast<T*>(base) + i * stride; }
template <class T>
inline const T* row_of(const void* base, int64_t stride, int64_t i) {
    return static_cast<const T*>(base) + i * stride;
}

// ------------------------------------------------------------------------------------------ the host step
// engine/host_step.py's _mean, _moments and _store_moments, and adam_master_step_'s decay
template <class V>
struct AdamConstants {
    typename V::F mean, one_minus_beta1, beta2, one_minus_beta2, neg_lr, inv_sqrt_bc2, eps, l2, decay;
    explicit AdamConstants(const float* s)
        : mean(V::set(s[0])), one_minus_beta1(V::set(s[2])), beta2(V::set(s[3])), one_minus_beta2(V::set(s[4])),
          neg_lr(V::set(-s[5])), inv_sqrt_bc2(V::set(s[6])), eps(V::set(s[7])), l2(V::set(s[9])),
          decay(V::set(s[10])) {}
};

template <class V, class G, class S, bool MASTER, bool STOCHASTIC>
inline void adam_at(G* g, S* m, S* v, float* w, const int32_t* col_r, int64_t j, typename V::I row_base,
                    const AdamConstants<V>& c) {
    typedef typename V::F F;
    F grad = V::mul(V::load(g + j), c.mean);
    F weight = c.mean;  // read only with a master
    if (MASTER) {
        weight = V::load(w + j);
        grad = V::add(grad, V::mul(weight, c.l2));  // Adam's L2 decay (0 for AdamW)
    }
    F m0 = V::load(m + j);
    F m1 = V::add(m0, V::mul(V::sub(grad, m0), c.one_minus_beta1));
    F v1 = V::add(V::mul(V::load(v + j), c.beta2), V::mul(V::mul(grad, grad), c.one_minus_beta2));
    F step = V::div(V::mul(c.neg_lr, m1), V::add(V::mul(V::sqrt(v1), c.inv_sqrt_bc2), c.eps));
    put_nearest<V>(m + j, m1);
    if (STOCHASTIC) {
        put_stochastic<V>(v + j, v1, V::low16_add(V::load_i(col_r + j), row_base));
    } else {
        put_nearest<V>(v + j, v1);
    }
    if (MASTER) {
        put_nearest<V>(w + j, V::add(V::mul(weight, c.decay), step));
    } else {
        put_nearest<V>(g + j, step);
    }
}

template <class G, class S, bool MASTER, bool STOCHASTIC>
void adam_span(const AdamArgs* a, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    // the compact state (bf16 window and moments, 12 B per element) is prefetched; wider streams were as fast or
    // slower with it (measured: fp32 state the same, an fp32 window over bf16 moments 12 % slower)
    constexpr bool PREFETCH = IsBf16<G>::value && IsBf16<S>::value && !MASTER;
    const AdamConstants<Wide> wide(a->scalars);
    const AdamConstants<One> one(a->scalars);
    for (int64_t i = i0; i < i1; ++i) {
        G* g = row_of<G>(a->grad, a->grad_stride, i);
        S* m = row_of<S>(a->exp_avg, a->exp_avg_stride, i);
        S* v = row_of<S>(a->exp_avg_sq, a->exp_avg_sq_stride, i);
        float* w = MASTER ? a->master + i * a->master_stride : nullptr;
        uint32_t base = STOCHASTIC ? uint32_t(a->row_r[i]) + a->offset : 0u;
        typename Wide::I wide_base = Wide::seti(base);
        int64_t j = j0;
        for (; j + Wide::N <= j1; j += Wide::N) {
            if (PREFETCH) {
                prefetch_ahead(g + j);
                prefetch_ahead(m + j);
                prefetch_ahead(v + j);
            }
            adam_at<Wide, G, S, MASTER, STOCHASTIC>(g, m, v, w, a->col_r, j, wide_base, wide);
        }
        for (; j < j1; ++j) adam_at<One, G, S, MASTER, STOCHASTIC>(g, m, v, w, a->col_r, j, base, one);
    }
}

// ------------------------------------------------------------------------------------------ the interim moves
// engine/kernels.py's _bounded_move, added to the weight (moves_fp32_: rounded to nearest; moves_bf16_: stochastic)
template <class V>
struct MovesConstants {
    typename V::F eps, coefficient, keep;
    typename V::I column_step;  // N columns of the hash's column term: the next step's x is this step's plus this
    explicit MovesConstants(const MovesArgs* a)
        : eps(V::set(a->eps)), coefficient(V::set(a->coefficient)), keep(V::set(a->keep)),
          column_step(V::seti(uint32_t(V::N) * ZF_COL_MULTIPLIER)) {}
};

// hash_x: row * ROW_MULTIPLIER + seed + column * COL_MULTIPLIER of each lane's column (uint32, wrapping), advanced by
// the caller one step at a time (an addition instead of a multiplication per step). KEEP: multiply by keep (without
// it keep is 1, and x * 1 is x bit for bit).
template <class V, class G, class W, bool STOCHASTIC, bool KEEP>
inline void moves_at(const G* g, W* w, const MovesArgs* a, int64_t j, typename V::F row_scale,
                     typename V::I hash_x, const MovesConstants<V>& c) {
    typedef typename V::F F;
    F ratio = V::div(V::load(g + j), V::add(V::mul(row_scale, V::load(a->col_scale + j)), c.eps));
    F factor = V::neg(V::mul(V::load(a->mask + j), c.coefficient));
    F move = V::mul(V::clamp_unit(ratio), factor);
    if (KEEP) move = V::mul(move, c.keep);
    F moved = V::add(V::load(w + j), move);
    if (STOCHASTIC) {
        put_stochastic<V>(w + j, moved, hash_bits<V>(hash_x));
    } else {
        put_nearest<V>(w + j, moved);
    }
}

template <class G, class W, bool STOCHASTIC, bool KEEP>
void moves_rows(const MovesArgs* a, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const MovesConstants<Wide> wide(a);
    const MovesConstants<One> one(a);
    const typename Wide::I first_columns =
        Wide::imul(Wide::iadd(Wide::seti(uint32_t(j0)), Wide::iota()), Wide::seti(ZF_COL_MULTIPLIER));
    for (int64_t i = i0; i < i1; ++i) {
        const G* g = row_of<G>(a->grad, a->grad_stride, i);
        W* w = row_of<W>(a->weight, a->weight_stride, i);
        uint32_t hash_row = (a->row_offset + uint32_t(i)) * ZF_ROW_MULTIPLIER + a->seed;
        float row_scale = a->row_scale[i];
        typename Wide::F wide_scale = Wide::set(row_scale);
        typename Wide::I hash_x = Wide::iadd(Wide::seti(hash_row), first_columns);
        int64_t j = j0;
        for (; j + Wide::N <= j1; j += Wide::N) {
            moves_at<Wide, G, W, STOCHASTIC, KEEP>(g, w, a, j, wide_scale, hash_x, wide);
            if (STOCHASTIC) hash_x = Wide::iadd(hash_x, wide.column_step);
        }
        for (; j < j1; ++j) {
            uint32_t x = hash_row + uint32_t(j) * ZF_COL_MULTIPLIER;
            moves_at<One, G, W, STOCHASTIC, KEEP>(g, w, a, j, row_scale, x, one);
        }
    }
}

template <class G, class W, bool STOCHASTIC>
void moves_span(const MovesArgs* a, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    if (a->keep == 1.0f) {
        moves_rows<G, W, STOCHASTIC, false>(a, i0, i1, j0, j1);  // no loss scaler, or a step that kept its gradients
    } else {
        moves_rows<G, W, STOCHASTIC, true>(a, i0, i1, j0, j1);
    }
}

// ------------------------------------------------------------------------------------------ the landing
template <class V, class W, class P>
inline void landing_at(W* w, const P* step, int64_t j, typename V::F scale, typename V::I hash_row,
                       typename V::I iota) {
    typename V::F landed = V::add(V::mul(V::load(w + j), scale), V::load(step + j));
    if (IsBf16<W>::value) {
        typename V::I column = V::iadd(V::seti(uint32_t(j)), iota);
        typename V::I x = V::iadd(hash_row, V::imul(column, V::seti(ZF_COL_MULTIPLIER)));
        put_stochastic<V>(w + j, landed, hash_bits<V>(x));
    } else {
        put_nearest<V>(w + j, landed);
    }
}

template <class W, class P>
void landing_span(const LandingArgs* a, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    typename Wide::F wide_scale = Wide::set(a->scale);
    typename Wide::I wide_iota = Wide::iota();
    for (int64_t i = i0; i < i1; ++i) {
        W* w = row_of<W>(a->weight, a->weight_stride, i);
        const P* step = row_of<P>(a->step, a->step_stride, i);
        uint32_t hash_row = (a->row_offset + uint32_t(i)) * ZF_ROW_MULTIPLIER + a->seed;
        typename Wide::I wide_hash = Wide::seti(hash_row);
        int64_t j = j0;
        for (; j + Wide::N <= j1; j += Wide::N) landing_at<Wide, W, P>(w, step, j, wide_scale, wide_hash, wide_iota);
        for (; j < j1; ++j) landing_at<One, W, P>(w, step, j, a->scale, hash_row, 0u);
    }
}

// ------------------------------------------------------------------------------------------ the window's sum
template <class V, class A, class G, bool FIRST>
inline void accumulate_at(A* acc, const G* g, const int32_t* col_r, int64_t j, typename V::I row_base) {
    typename V::F total = FIRST ? V::load(g + j) : V::add(V::load(acc + j), V::load(g + j));
    put_stochastic<V>(acc + j, total, V::low16_add(V::load_i(col_r + j), row_base));
}

template <class A, class G, bool FIRST>
void accumulate_span(const AccumulateArgs* a, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    for (int64_t i = i0; i < i1; ++i) {
        A* acc = row_of<A>(a->acc, a->acc_stride, i);
        const G* g = row_of<G>(a->grad, a->grad_stride, i);
        uint32_t base = uint32_t(a->row_r[i]) + a->offset;
        typename Wide::I wide_base = Wide::seti(base);
        int64_t j = j0;
        for (; j + Wide::N <= j1; j += Wide::N) accumulate_at<Wide, A, G, FIRST>(acc, g, a->col_r, j, wide_base);
        for (; j < j1; ++j) accumulate_at<One, A, G, FIRST>(acc, g, a->col_r, j, base);
    }
}

// ------------------------------------------------------------------------------------------ the selected columns
// A span runs packed columns [j0, j1) of rows [i0, i1). Bits: a gathered bf16 widens exactly, an fp32 is copied; a
// master written into bf16 weights is rounded to nearest even in integers (as .to(torch.bfloat16): subnormals kept, a
// NaN stays a NaN). Both are bound by the matrix's memory: every line that holds a selected column is read (and for the
// write, written back), at rho = 0.1 spread over the row 1 - 0.9**16 = 81 % of them, so one element at a time does as
// well as vectors (measured: as fast as ATen's index_select and index_copy_ in fp32, about 2x and 1.3x faster in bf16;
// software prefetches a few rows ahead did not help).
template <class G>
void gather_span(const ColumnsArgs* a, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const int64_t* index = a->index;
    for (int64_t i = i0; i < i1; ++i) {
        const G* g = row_of<G>(a->matrix, a->matrix_stride, i);
        float* out = a->packed + i * a->packed_stride;
        for (int64_t j = j0; j < j1; ++j) out[j] = One::load(g + index[j]);
    }
}

template <class W>
void write_span(const ColumnsArgs* a, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const int64_t* index = a->index;
    for (int64_t i = i0; i < i1; ++i) {
        W* w = row_of<W>(a->matrix, a->matrix_stride, i);
        const float* master = a->packed + i * a->packed_stride;
        for (int64_t j = j0; j < j1; ++j) put_nearest<One>(w + index[j], master[j]);
    }
}

// ------------------------------------------------------------------------------------------ row and column sums
// Sixteen lanes per row whatever the vector width (element j of a span adds into lane (j - j0) % 16), reduced in one
// fixed tree: every variant gives the same bits, and the column sums add the rows of a block in order.
template <class G>
void sums_tile(const SumsArgs* a, int64_t block, int64_t span) {
    constexpr int K = 16 / Vec::N;
    int64_t i0 = block * a->block_rows, i1 = i0 + a->block_rows < a->rows ? i0 + a->block_rows : a->rows;
    int64_t j0 = span * a->span_cols, j1 = j0 + a->span_cols < a->cols ? j0 + a->span_cols : a->cols;
    float* part = a->col_partial + block * a->cols;
    for (int64_t j = j0; j < j1; ++j) part[j] = 0.0f;
    for (int64_t i = i0; i < i1; ++i) {
        const G* g = row_of<G>(a->grad, a->grad_stride, i);
        typename Vec::F lanes[K];
        for (int k = 0; k < K; ++k) lanes[k] = Vec::set(0.0f);
        int64_t j = j0;
        for (; j + 16 <= j1; j += 16) {
            for (int k = 0; k < K; ++k) {
                int64_t at = j + k * Vec::N;
                typename Vec::F x = Vec::load(g + at);
                typename Vec::F squared = Vec::mul(Vec::mul(x, x), Vec::load(a->mask + at));
                lanes[k] = Vec::add(lanes[k], squared);
                Vec::store(part + at, Vec::add(Vec::load(part + at), squared));
            }
        }
        float lane[16];
        for (int k = 0; k < K; ++k) Vec::store(lane + k * Vec::N, lanes[k]);
        for (int l = 0; j < j1; ++j, ++l) {
            float x = One::load(g + j);
            float squared = x * x * a->mask[j];
            lane[l] = lane[l] + squared;
            part[j] = part[j] + squared;
        }
        for (int width = 8; width >= 1; width /= 2) {
            for (int l = 0; l < width; ++l) lane[l] = lane[l] + lane[l + width];
        }
        a->row_partial[a->spans == 1 ? i : i * a->spans + span] = lane[0];
    }
}

// out[j] = partial[0][j] + partial[1][j] + ..., in block order
void sums_combine(const float* partial, int64_t blocks, int64_t cols, int64_t j0, int64_t j1, float* out) {
    int64_t j = j0;
    for (; j + Wide::N <= j1; j += Wide::N) {
        typename Wide::F total = Wide::load(partial + j);
        for (int64_t b = 1; b < blocks; ++b) total = Wide::add(total, Wide::load(partial + b * cols + j));
        Wide::store(out + j, total);
    }
    for (; j < j1; ++j) {
        float total = partial[j];
        for (int64_t b = 1; b < blocks; ++b) total = total + partial[b * cols + j];
        out[j] = total;
    }
}

// ------------------------------------------------------------------------------------------ the table
template <class G, class S>
void fill_adam(KernelTable& t) {
    AdamSpan(&row)[2][2] = t.adam[IsBf16<G>::value][IsBf16<S>::value];
    row[0][0] = adam_span<G, S, false, false>;
    row[0][1] = adam_span<G, S, false, true>;
    row[1][0] = adam_span<G, S, true, false>;
    row[1][1] = adam_span<G, S, true, true>;
}

template <class G, class W>
void fill_moves(KernelTable& t) {
    t.moves[IsBf16<G>::value][IsBf16<W>::value][0] = moves_span<G, W, false>;
    t.moves[IsBf16<G>::value][IsBf16<W>::value][1] = moves_span<G, W, true>;
    t.landing[IsBf16<W>::value][IsBf16<G>::value] = landing_span<W, G>;
    t.accumulate[IsBf16<W>::value][IsBf16<G>::value][0] = accumulate_span<W, G, false>;
    t.accumulate[IsBf16<W>::value][IsBf16<G>::value][1] = accumulate_span<W, G, true>;
}

KernelTable make_table() {
    KernelTable t;
    std::memset(&t, 0, sizeof(t));
    fill_adam<float, float>(t);
    fill_adam<float, bf16>(t);
    fill_adam<bf16, float>(t);
    fill_adam<bf16, bf16>(t);
    fill_moves<float, float>(t);
    fill_moves<float, bf16>(t);
    fill_moves<bf16, float>(t);
    fill_moves<bf16, bf16>(t);
    t.gather[0] = gather_span<float>;
    t.gather[1] = gather_span<bf16>;
    t.write[0] = write_span<float>;
    t.write[1] = write_span<bf16>;
    t.sums[0] = sums_tile<float>;
    t.sums[1] = sums_tile<bf16>;
    t.combine = sums_combine;
    return t;
}

}  // namespace

// Filled at the first call, which comes after the check that this machine runs the variant: a static initializer
// would run this object's instructions when the library loads, on any machine.
const KernelTable* table() {
    static const KernelTable filled = make_table();
    return &filled;
}

}  // namespace ZF_NAMESPACE

// ------------------------------------------------------------------------------------------ API, pool, dispatch
#if ZF_VARIANT == 0
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <unistd.h>
#if defined(__linux__)
#include <sched.h>
#endif

namespace {

enum Variant { PORTABLE = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3 };

bool variant_supported(int variant) {
    switch (variant) {
        case PORTABLE:
            return true;
#if defined(ZF_WITH_X86_VARIANTS)
        case AVX2:
            return __builtin_cpu_supports("avx2");
        case AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        case AVX512_BF16:
            return variant_supported(AVX512) && __builtin_cpu_supports("avx512bf16");
#endif
        default:
            return false;
    }
}

const KernelTable* table_of(int variant) {
    if (!variant_supported(variant)) return nullptr;
    switch (variant) {
#if defined(ZF_WITH_X86_VARIANTS)
        case AVX2:
            return zf_avx2::table();
        case AVX512:
            return zf_avx512::table();
        case AVX512_BF16:
            return zf_avx512bf16::table();
#endif
        default:
            return zf_portable::table();
    }
}

// Tunables (tests make them small to run the pool on small matrices; no bits depend on the first two).
std::atomic<int64_t> tile_elements{1 << 16};
std::atomic<int64_t> parallel_min_elements{1 << 17};
std::atomic<int64_t> sum_block_elements{1 << 16};
std::atomic<int64_t> sum_span_cols{4096};
constexpr int MAX_THREADS = 256;
constexpr int SPIN_ROUNDS = 4000;  // a worker's wait for the next call before it sleeps: ~20 us

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
}

struct Job {
    void (*run)(const void* context, int64_t tile);
    const void* context;
    int64_t tiles;
    std::atomic<int64_t> next{0};
};

void drain(Job* job) {
    for (int64_t tile; (tile = job->next.fetch_add(1, std::memory_order_relaxed)) < job->tiles;) {
        job->run(job->context, tile);
    }
}

// A persistent pool. A call runs tiles on the calling thread and opens `helpers` seats that sleeping or spinning
// workers take; when the caller has no tile left it closes the seats not yet taken and waits only for the workers
// that took one (a worker slow to wake costs nothing). One call at a time: a second thread's call runs alone.
class Pool {
  public:
    void run(Job* job, int helpers) {
        std::unique_lock<std::mutex> region(region_, std::try_to_lock);
        if (!region.owns_lock()) {
            drain(job);  // another thread's call has the pool: the same tiles, on this thread
            return;
        }
        while (workers_ < helpers) {
            try {
                std::thread(&Pool::work, this).detach();  // lives as long as the process; the pool is never freed
            } catch (...) {
                break;  // no thread to be had (a limit on threads): fewer helpers
            }
            ++workers_;
        }
        if (helpers > workers_) helpers = workers_;
        follow_affinity();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            job_ = job;
            seats_ = helpers;
            ++generation_;
            published_.store(generation_, std::memory_order_release);
        }
        wake_.notify_all();
        drain(job);
        std::unique_lock<std::mutex> lock(mutex_);
        seats_ = 0;  // close the seats nobody took
        done_.wait(lock, [this] { return seated_ == 0; });  // wait for the workers still running a tile of this job
    }

  private:
    void work() {
        uint64_t seen = published_.load(std::memory_order_acquire);
        uint64_t affinity_seen = 0;
        for (;;) {
            for (int round = 0; round < SPIN_ROUNDS && published_.load(std::memory_order_acquire) == seen; ++round) {
                relax();  // the engine calls one kernel per matrix, back to back: stay awake a moment
            }
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return generation_ != seen; });  // sleep until the next call
            seen = generation_;
            if (seats_ == 0) continue;
            --seats_;
            ++seated_;
            Job* job = job_;
#if defined(__linux__)
            bool move = affinity_generation_ != affinity_seen;
            cpu_set_t cores = affinity_;
            affinity_seen = affinity_generation_;
#endif
            lock.unlock();
#if defined(__linux__)
            if (move) sched_setaffinity(0, sizeof(cores), &cores);
#endif
            drain(job);
            lock.lock();
            if (--seated_ == 0) done_.notify_one();
        }
    }

    // Workers run on the caller's cores: the host worker pins itself to its share after the library may have
    // started its pool (a thread keeps the affinity it was created with).
    void follow_affinity() {
#if defined(__linux__)
        cpu_set_t mine;
        CPU_ZERO(&mine);
        if (sched_getaffinity(0, sizeof(mine), &mine) != 0) return;
        std::lock_guard<std::mutex> lock(mutex_);
        if (affinity_generation_ != 0 && CPU_EQUAL(&mine, &affinity_)) return;
        affinity_ = mine;
        ++affinity_generation_;
#endif
    }

    std::mutex region_;
    std::mutex mutex_;
    std::condition_variable wake_, done_;
    int workers_ = 0;
    Job* job_ = nullptr;
    int seats_ = 0;
    int seated_ = 0;
    uint64_t generation_ = 0;
    std::atomic<uint64_t> published_{0};
#if defined(__linux__)
    cpu_set_t affinity_;
    uint64_t affinity_generation_ = 0;
#endif
};

std::mutex pool_creation;
Pool* the_pool = nullptr;
pid_t pool_pid = 0;

// After a fork the child has none of the parent's workers: it starts a pool of its own (the old one is abandoned).
Pool* pool() {
    std::lock_guard<std::mutex> lock(pool_creation);
    if (the_pool == nullptr || pool_pid != getpid()) {
        the_pool = new Pool();
        pool_pid = getpid();
    }
    return the_pool;
}

void run_tiles(void (*run)(const void*, int64_t), const void* context, int64_t tiles, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int helpers = int((tiles < threads ? tiles : threads) - 1);
    Job job;
    job.run = run;
    job.context = context;
    job.tiles = tiles;
    if (helpers <= 0) {
        drain(&job);
    } else {
        pool()->run(&job, helpers);
    }
}

// Elementwise tiles: whole rows, or for a wide matrix column spans of one row (no bit depends on the tiling).
template <class Args, class Span>
struct Elementwise {
    const Args* args;
    Span span;
    int64_t rows, cols, rows_per_tile, span_cols, spans_per_row;

    static void tile(const void* context, int64_t t) {
        const Elementwise* e = static_cast<const Elementwise*>(context);
        if (e->spans_per_row == 1) {
            int64_t i0 = t * e->rows_per_tile, i1 = i0 + e->rows_per_tile < e->rows ? i0 + e->rows_per_tile : e->rows;
            e->span(e->args, i0, i1, 0, e->cols);
        } else {
            int64_t i = t / e->spans_per_row, j0 = (t % e->spans_per_row) * e->span_cols;
            e->span(e->args, i, i + 1, j0, j0 + e->span_cols < e->cols ? j0 + e->span_cols : e->cols);
        }
    }
};

template <class Args, class Span>
void run_elementwise(const Args* args, Span span, int64_t rows, int64_t cols, int threads) {
    if (threads <= 1 || rows * cols < parallel_min_elements.load(std::memory_order_relaxed)) {
        span(args, 0, rows, 0, cols);  // small: no wake-up, the calling thread only
        return;
    }
    int64_t tile = tile_elements.load(std::memory_order_relaxed);
    Elementwise<Args, Span> e{args, span, rows, cols, 1, cols, 1};
    int64_t tiles;
    if (cols >= 2 * tile) {
        e.span_cols = (tile + 63) / 64 * 64;
        e.spans_per_row = (cols + e.span_cols - 1) / e.span_cols;
        tiles = rows * e.spans_per_row;
    } else {
        e.rows_per_tile = tile / cols > 0 ? tile / cols : 1;
        tiles = (rows + e.rows_per_tile - 1) / e.rows_per_tile;
    }
    run_tiles(&Elementwise<Args, Span>::tile, &e, tiles, threads);
}

struct Sums {
    const SumsArgs* args;
    SumsTile tile_fn;
    static void tile(const void* context, int64_t t) {
        const Sums* s = static_cast<const Sums*>(context);
        s->tile_fn(s->args, t / s->args->spans, t % s->args->spans);
    }
};

}  // namespace

#define ZF_EXPORT __attribute__((visibility("default")))

extern "C" {

// Error codes of every call: 0 done, -1 the variant does not run on this machine, -2 out of memory, -3 a column
// index out of range (nothing written).
ZF_EXPORT int zf_variant_supported(int variant) { return variant_supported(variant) ? 1 : 0; }

// Tests: the tiling and the threshold of a parallel call, and row_col_sums' blocks and spans.
ZF_EXPORT void zf_set_limits(int64_t tile, int64_t parallel_min, int64_t sum_block, int64_t sum_span) {
    tile_elements.store(tile > 0 ? tile : 1);
    parallel_min_elements.store(parallel_min);
    sum_block_elements.store(sum_block > 0 ? sum_block : 1);
    sum_span_cols.store(sum_span > 0 ? sum_span : 1);
}

ZF_EXPORT int zf_adam_step(int variant, int threads, int64_t rows, int64_t cols, float* master, int64_t master_stride,
                           void* grad, int grad_bf16, int64_t grad_stride, void* exp_avg, int64_t exp_avg_stride,
                           void* exp_avg_sq, int64_t exp_avg_sq_stride, int state_bf16, const int32_t* row_r,
                           const int32_t* col_r, const float* scalars, int stochastic) {
    const KernelTable* t = table_of(variant);
    if (t == nullptr) return -1;
    AdamArgs a;
    a.master = master;
    a.master_stride = master_stride;
    a.grad = grad;
    a.grad_stride = grad_stride;
    a.exp_avg = exp_avg;
    a.exp_avg_stride = exp_avg_stride;
    a.exp_avg_sq = exp_avg_sq;
    a.exp_avg_sq_stride = exp_avg_sq_stride;
    a.row_r = row_r;
    a.col_r = col_r;
    std::memcpy(a.scalars, scalars, sizeof(a.scalars));
    a.offset = uint32_t(int32_t(a.scalars[8]));  // torch's .to(torch.int32): truncation
    AdamSpan span = t->adam[grad_bf16 != 0][state_bf16 != 0][master != nullptr][stochastic != 0];
    run_elementwise(&a, span, rows, cols, threads);
    return 0;
}

ZF_EXPORT int zf_moves(int variant, int threads, int64_t rows, int64_t cols, const void* grad, int grad_bf16,
                       int64_t grad_stride, void* weight, int weight_bf16, int64_t weight_stride,
                       const float* row_scale, const float* col_scale, const float* mask, float eps,
                       float coefficient, const float* keep, int stochastic, int64_t row_offset, int64_t seed) {
    const KernelTable* t = table_of(variant);
    if (t == nullptr) return -1;
    MovesArgs a;
    a.grad = grad;
    a.grad_stride = grad_stride;
    a.weight = weight;
    a.weight_stride = weight_stride;
    a.row_scale = row_scale;
    a.col_scale = col_scale;
    a.mask = mask;
    a.eps = eps;
    a.coefficient = coefficient;
    a.keep = keep != nullptr ? *keep : 1.0f;
    a.row_offset = uint32_t(row_offset);
    a.seed = uint32_t(seed);
    run_elementwise(&a, t->moves[grad_bf16 != 0][weight_bf16 != 0][stochastic != 0], rows, cols, threads);
    return 0;
}

ZF_EXPORT int zf_landing(int variant, int threads, int64_t rows, int64_t cols, void* weight, int weight_bf16,
                         int64_t weight_stride, const void* step, int step_bf16, int64_t step_stride, float scale,
                         int64_t row_offset, int64_t seed) {
    const KernelTable* t = table_of(variant);
    if (t == nullptr) return -1;
    LandingArgs a;
    a.weight = weight;
    a.weight_stride = weight_stride;
    a.step = step;
    a.step_stride = step_stride;
    a.scale = scale;
    a.row_offset = uint32_t(row_offset);
    a.seed = uint32_t(seed);
    run_elementwise(&a, t->landing[weight_bf16 != 0][step_bf16 != 0], rows, cols, threads);
    return 0;
}

ZF_EXPORT int zf_accumulate(int variant, int threads, int64_t rows, int64_t cols, void* acc, int acc_bf16,
                            int64_t acc_stride, const void* grad, int grad_bf16, int64_t grad_stride,
                            const int32_t* row_r, const int32_t* col_r, int64_t offset, int first) {
    const KernelTable* t = table_of(variant);
    if (t == nullptr) return -1;
    AccumulateArgs a;
    a.acc = acc;
    a.acc_stride = acc_stride;
    a.grad = grad;
    a.grad_stride = grad_stride;
    a.row_r = row_r;
    a.col_r = col_r;
    a.offset = uint32_t(offset);
    run_elementwise(&a, t->accumulate[acc_bf16 != 0][grad_bf16 != 0][first != 0], rows, cols, threads);
    return 0;
}

// The selected columns: gather (the gradient's columns index[c] into fp32 packed[:, c]) or write (packed[:, c] into the
// weights' columns index[c], rounded to their dtype).
ZF_EXPORT int zf_columns(int variant, int threads, int write, int64_t rows, int64_t cols, void* matrix, int matrix_bf16,
                         int64_t matrix_stride, const int64_t* index, int64_t k, float* packed, int64_t packed_stride) {
    const KernelTable* t = table_of(variant);
    if (t == nullptr) return -1;
    for (int64_t c = 0; c < k; ++c) {
        if (index[c] < 0 || index[c] >= cols) return -3;
    }
    ColumnsArgs a;
    a.matrix = matrix;
    a.matrix_stride = matrix_stride;
    a.packed = packed;
    a.packed_stride = packed_stride;
    a.index = index;
    run_elementwise(&a, write ? t->write[matrix_bf16 != 0] : t->gather[matrix_bf16 != 0], rows, k, threads);
    return 0;
}

ZF_EXPORT int zf_row_col_sums(int variant, int threads, int64_t rows, int64_t cols, const void* grad, int grad_bf16,
                              int64_t grad_stride, const float* mask, float* row_out, float* col_out) {
    const KernelTable* t = table_of(variant);
    if (t == nullptr) return -1;
    SumsArgs a;
    a.grad = grad;
    a.grad_stride = grad_stride;
    a.mask = mask;
    a.rows = rows;
    a.cols = cols;
    // blocks and spans fixed by the shape, never by the thread count: the sums' bits depend on them
    a.span_cols = sum_span_cols.load();
    a.spans = (cols + a.span_cols - 1) / a.span_cols;
    int64_t width = cols < a.span_cols ? cols : a.span_cols;
    int64_t by_size = sum_block_elements.load() / width;
    a.block_rows = by_size > 64 ? by_size : 64;
    int64_t blocks = (rows + a.block_rows - 1) / a.block_rows;
    float* col_partial = blocks == 1 ? col_out : static_cast<float*>(std::malloc(sizeof(float) * blocks * cols));
    float* row_partial = a.spans == 1 ? row_out : static_cast<float*>(std::malloc(sizeof(float) * rows * a.spans));
    if (col_partial == nullptr || row_partial == nullptr) {
        if (col_partial != col_out) std::free(col_partial);
        if (row_partial != row_out) std::free(row_partial);
        return -2;
    }
    a.col_partial = col_partial;
    a.row_partial = row_partial;
    Sums sums{&a, t->sums[grad_bf16 != 0]};
    int64_t tiles = blocks * a.spans;
    bool alone = threads <= 1 || rows * cols < parallel_min_elements.load(std::memory_order_relaxed);
    run_tiles(&Sums::tile, &sums, tiles, alone ? 1 : threads);
    if (blocks > 1) {
        t->combine(col_partial, blocks, cols, 0, cols, col_out);
        std::free(col_partial);
    }
    if (a.spans > 1) {
        for (int64_t i = 0; i < rows; ++i) {
            float total = row_partial[i * a.spans];
            for (int64_t s = 1; s < a.spans; ++s) total = total + row_partial[i * a.spans + s];
            row_out[i] = total;
        }
        std::free(row_partial);
    }
    return 0;
}

}  // extern "C"
#endif  // ZF_VARIANT == 0
