// W4A4 GEMM for M <= 1536 on Hopper (sm_90a), CUDA C++ compiled at run time (NVRTC): small M (this
// section), mid M, wide M (warp-specialized), small M streamed and wide M with register A
// (sections below).
//
// Same numbers as the Triton decode GEMM (kernels/w4a4_gemm.py, contract v2): Y^T = W @ A^T with
// the weight decoded in registers straight into wgmma's A fragments (m64nBMk16, BF16, FP32
// accumulator) and the activation decoded from its codes once per CTA into shared memory as
// wgmma's B operand. K order: per 128-element chunk the 8 nibble streams (step p of a chunk:
// element 8j + p at k-position j); per 512-element fold chunk one wgmma chain from zero; fold
// chunks added in order to a zero FP32 accumulator. Split K: the CTAs of a tile form a cluster,
// each keeps its fold chunks' partials in shared memory, and the first folds them all in order.
//
// No headers (NVRTC finds none): integer types spelled out, conversions in PTX.

typedef unsigned int u32;
typedef unsigned long long u64;

#define FOLD_CHUNKS 4  // 128-element chunks per 512-element fold chunk
#define ROWS 64        // weight rows per CTA (one warpgroup, 16 per warp)

// The E4M3 scale byte as a BF16x2 of scale * 2^119 in both halves (exact).
__device__ __forceinline__ u32 scale_bf16x2(u32 scale_byte) {
  u32 s;
  asm("{\n"
      ".reg .b16 lo, hi;\n"
      ".reg .b32 h2;\n"
      ".reg .f16 h;\n"
      ".reg .f32 f;\n"
      "mov.b32 {lo, hi}, %1;\n"
      "cvt.rn.f16x2.e4m3x2 h2, lo;\n"
      "mov.b32 {h, hi}, h2;\n"
      "cvt.f32.f16 f, h;\n"
      "mul.rn.f32 f, f, 0f7B000000;\n"
      "cvt.rn.bf16x2.f32 %0, f, f;\n"
      "}\n"
      : "=r"(s)
      : "r"(scale_byte * 0x0101u));
  return s;
}

// The four E4M3 scale bytes packed in `bytes` (byte j: scale j) as scale_bf16x2 of each, with one
// E4M3x2 conversion per two scales (the same operations on the same values: the same bits).
__device__ __forceinline__ void scales_bf16x2(u32 bytes, u32 (&s)[4]) {
  asm("{\n"
      ".reg .b16 lo, hi, h0, h1, h2, h3;\n"
      ".reg .b32 p01, p23;\n"
      ".reg .f32 f0, f1, f2, f3;\n"
      "mov.b32 {lo, hi}, %4;\n"
      "cvt.rn.f16x2.e4m3x2 p01, lo;\n"
      "cvt.rn.f16x2.e4m3x2 p23, hi;\n"
      "mov.b32 {h0, h1}, p01;\n"
      "mov.b32 {h2, h3}, p23;\n"
      "cvt.f32.f16 f0, h0;\n"
      "cvt.f32.f16 f1, h1;\n"
      "cvt.f32.f16 f2, h2;\n"
      "cvt.f32.f16 f3, h3;\n"
      "mul.rn.f32 f0, f0, 0f7B000000;\n"
      "mul.rn.f32 f1, f1, 0f7B000000;\n"
      "mul.rn.f32 f2, f2, 0f7B000000;\n"
      "mul.rn.f32 f3, f3, 0f7B000000;\n"
      "cvt.rn.bf16x2.f32 %0, f0, f0;\n"
      "cvt.rn.bf16x2.f32 %1, f1, f1;\n"
      "cvt.rn.bf16x2.f32 %2, f2, f2;\n"
      "cvt.rn.bf16x2.f32 %3, f3, f3;\n"
      "}\n"
      : "=r"(s[0]), "=r"(s[1]), "=r"(s[2]), "=r"(s[3])
      : "r"(bytes));
}

// Two code words (element pairs at k-positions 2t, 2t+1 of each stream) and their E4M3 scale
// byte -> eight BF16x2 registers, o[p] = (nibble p of w0, nibble p of w1) * scale * 2^-7.
// A nibble n becomes the BF16 bits ((n&7)<<6 | (n&8)<<12) = code * 2^-126, and the scale is
// pre-multiplied by 2^119 (exact): one BF16x2 multiply gives code * scale * 2^-7, exactly.
__device__ __forceinline__ void decode_pair(u32 w0, u32 w1, u32 scale_byte, u32 (&o)[8]) {
  const u32 s = scale_bf16x2(scale_byte);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 t;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(w0), "r"(w1), "r"(0x4400u + 0x1111u * i));
    u32 lo = ((t & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;
    u32 hi = ((t & 0x00F000F0u) * 0x104u) & 0x81C081C0u;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o[2 * i]) : "r"(lo), "r"(s));
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o[2 * i + 1]) : "r"(hi), "r"(s));
  }
}

// decode_pair of a word pair as the unit layout stores it (w4a4_gemm_cuda.UNIT_CODE_BITS: word h
// holds streams 4h .. 4h + 3, each code's bits placed so that w, w << 6, w rotated left by 10 and
// a mix of w rotated left by 12 and w << 4 put them, under the BF16 pair mask, on the BF16 bits
// 6, 7, 8 and 15 of its half): the same eight BF16x2 in 13 instructions per word (2 funnel
// shifts, 5 masks on the integer pipe; 2 shifts as multiplies and 4 multiplies on the FMA pipe)
// instead of 18 (10 on the integer pipe). s: the scale as scale_bf16x2 makes it.
__device__ __forceinline__ void decode_pair_unit(u32 wa, u32 wb, u32 s, u32 (&o)[8]) {
  constexpr u32 PAIR = 0x81C081C0u, ROT12 = 0x00400040u;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const u32 w = h ? wb : wa;
    const u32 t[4] = {w & PAIR, (w * 64u) & PAIR, __funnelshift_l(w, w, 10) & PAIR,
                      (__funnelshift_l(w, w, 12) & ROT12) | ((w * 16u) & (PAIR & ~ROT12))};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o[4 * h + i]) : "r"(t[i]), "r"(s));
  }
}

// The eight BF16x2 of decode_pair (activation row r, code-word pair tp of a 128-element chunk)
// into the chunk's wgmma B block at `chunk`: stream q's step block at q * BM * 32 bytes, core
// matrix (r / 8, tp / 4) at (r / 8) * sbo + (tp / 4) * lbo, row r % 8, k-positions 2tp, 2tp + 1.
template <int BM>
__device__ __forceinline__ void store_b_pair(unsigned char* chunk, int r, int tp, u32 lbo, u32 sbo,
                                             const u32 (&o)[8]) {
  unsigned char* dst = chunk + (r / 8) * sbo + (tp / 4) * lbo + (r % 8) * 16 + (tp % 4) * 4;
#pragma unroll
  for (int q = 0; q < 8; ++q) *(u32*)(dst + q * (BM * 32)) = o[q];
}

__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int BM>
struct Acc {
  float d[BM / 2];
};

template <int BM>
__device__ __forceinline__ void fence_acc(Acc<BM>& acc) {
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) asm volatile("" : "+f"(acc.d[i])::"memory");
}

#define WGMMA_HEAD(N) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" #N ", 0;\nwgmma.mma_async.sync.aligned.m64n"

__device__ __forceinline__ void wgmma(Acc<8>& c, const u32 (&a)[4], u64 desc, int accumulate) {
  asm volatile(WGMMA_HEAD(9) "8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
               : "+f"(c.d[0]), "+f"(c.d[1]), "+f"(c.d[2]), "+f"(c.d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

__device__ __forceinline__ void wgmma(Acc<16>& c, const u32 (&a)[4], u64 desc, int accumulate) {
  asm volatile(WGMMA_HEAD(13) "16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, "
                              "%12, p, 1, 1, 0;\n}\n"
               : "+f"(c.d[0]), "+f"(c.d[1]), "+f"(c.d[2]), "+f"(c.d[3]), "+f"(c.d[4]),
                 "+f"(c.d[5]), "+f"(c.d[6]), "+f"(c.d[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

__device__ __forceinline__ void wgmma(Acc<32>& c, const u32 (&a)[4], u64 desc, int accumulate) {
  asm volatile(WGMMA_HEAD(21) "32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,"
                              "%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
               : "+f"(c.d[0]), "+f"(c.d[1]), "+f"(c.d[2]), "+f"(c.d[3]), "+f"(c.d[4]),
                 "+f"(c.d[5]), "+f"(c.d[6]), "+f"(c.d[7]), "+f"(c.d[8]), "+f"(c.d[9]),
                 "+f"(c.d[10]), "+f"(c.d[11]), "+f"(c.d[12]), "+f"(c.d[13]), "+f"(c.d[14]),
                 "+f"(c.d[15])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

__device__ __forceinline__ void wgmma(Acc<64>& c, const u32 (&a)[4], u64 desc, int accumulate) {
  asm volatile(WGMMA_HEAD(37) "64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,"
                              "%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
                              "%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
               : "+f"(c.d[0]), "+f"(c.d[1]), "+f"(c.d[2]), "+f"(c.d[3]), "+f"(c.d[4]),
                 "+f"(c.d[5]), "+f"(c.d[6]), "+f"(c.d[7]), "+f"(c.d[8]), "+f"(c.d[9]),
                 "+f"(c.d[10]), "+f"(c.d[11]), "+f"(c.d[12]), "+f"(c.d[13]), "+f"(c.d[14]),
                 "+f"(c.d[15]), "+f"(c.d[16]), "+f"(c.d[17]), "+f"(c.d[18]), "+f"(c.d[19]),
                 "+f"(c.d[20]), "+f"(c.d[21]), "+f"(c.d[22]), "+f"(c.d[23]), "+f"(c.d[24]),
                 "+f"(c.d[25]), "+f"(c.d[26]), "+f"(c.d[27]), "+f"(c.d[28]), "+f"(c.d[29]),
                 "+f"(c.d[30]), "+f"(c.d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

// The raw weight data of one thread for one 128-element chunk: rows r0 and r0+8, words
// {2t, 2t+1} and {2t+8, 2t+9}, and the scale bytes of blocks t and t+4 of both rows (one per
// s[j]; from the unit layout, unit_raw, all four packed in s[0]).
struct Raw {
  u32 w[8];
  u32 s[4];
};

#ifdef MINITE_PHASE_TIMING
#define PHASE_TIME(i)                                                                     \
  if (threadIdx.x == 0 && p.phase_times) {                                                \
    u64 now;                                                                              \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));                              \
    p.phase_times[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * 4 + \
                  (i)] = now;                                                             \
  }
#else
#define PHASE_TIME(i)
#endif

struct Params {
  const u32* w_words;
  const unsigned char* w_scales;
  const float* w_dec;
  const u32* a_words;
  const unsigned char* a_scales;
  const float* a_dec;
  const float* bias;
  void* y;
  u64* phase_times;  // [CTAs, 4] global-timer stamps (builds with MINITE_PHASE_TIMING only)
  long long stride_ww, stride_ws, stride_aw, stride_as, stride_ym, stride_yn;
  int w_dec_stride, a_dec_stride;
  int M, N, K, chunks_per_split, out_kind;  // out_kind: 0 bf16, 1 f16, 2 f32
  u32 lbo, sbo;  // byte offsets of the B core matrices along K and along the rows
  const unsigned char* a_image;  // mid M: the decoded activation, [M tiles][chunks][BM * 256 B]
  int a_chunks;                  // chunks per row of a_image (K padded to 128)
  float* partials;               // streamed: [units][64 x BM] fold-chunk partials (live_columns)
  int* counters;                 // streamed: [N tiles] arrivals, zero before and after a launch
  // the activation passes' CTAs from pass_ctas on write w_scales ([N][stride_ws], rows of whole
  // 128-element chunks, zeros past K) from the weight's scales w_scales_src (register-A wide
  // kernels at K % 128 != 0; pass_ctas = the grid otherwise)
  const unsigned char* w_scales_src;
  long long stride_ws_src;
  int pass_ctas;
};

// Row pointers of one thread: rows r0 and r0+8 (clamped), words from 2t, scale bytes from t.
struct Rows {
  const uint2* w0;
  const uint2* w1;
  const unsigned char* s0;
  const unsigned char* s1;
};

// This thread's weight rows n_base + g and n_base + g + 8 (clamped to N), from word 2t / scale t.
__device__ __forceinline__ Rows weight_rows(const Params& p, int n_base, int g, int t) {
  const long long row0 = min(n_base + g, p.N - 1);
  const long long row1 = min(n_base + g + 8, p.N - 1);
  Rows rows;
  rows.w0 = (const uint2*)(p.w_words + row0 * p.stride_ww + 2 * t);
  rows.w1 = (const uint2*)(p.w_words + row1 * p.stride_ww + 2 * t);
  rows.s0 = p.w_scales + row0 * p.stride_ws + t;
  rows.s1 = p.w_scales + row1 * p.stride_ws + t;
  return rows;
}

template <bool EVEN_K>
__device__ __forceinline__ void load_raw(const Rows& rows, int ch, int t, int K, Raw& r,
                                         bool in_k = true) {
  // Words 2t, 2t+1 hold elements 16t..16t+15 of the chunk, words 2t+8, 2t+9 elements
  // 16t+64..16t+79: a pair is one scale block, valid iff inside K (else zeros). `in_k`: false
  // for a padding chunk past K (zeros, without a branch).
  const bool lo_ok = in_k && (EVEN_K || ch * 128 + 16 * t + 16 <= K);
  const bool hi_ok = in_k && (EVEN_K || ch * 128 + 16 * t + 80 <= K);
  const uint2* w0 = rows.w0 + ch * 8;
  const uint2* w1 = rows.w1 + ch * 8;
  const unsigned char* s0 = rows.s0 + ch * 8;
  const unsigned char* s1 = rows.s1 + ch * 8;
  uint2 z;
  z.x = 0;
  z.y = 0;
  const uint2 a = lo_ok ? __ldg(w0) : z;
  const uint2 b = lo_ok ? __ldg(w1) : z;
  const uint2 c = hi_ok ? __ldg(w0 + 4) : z;
  const uint2 d = hi_ok ? __ldg(w1 + 4) : z;
  r.w[0] = a.x; r.w[1] = a.y; r.w[2] = b.x; r.w[3] = b.y;
  r.w[4] = c.x; r.w[5] = c.y; r.w[6] = d.x; r.w[7] = d.y;
  r.s[0] = lo_ok ? __ldg(s0) : 0u;
  r.s[1] = lo_ok ? __ldg(s1) : 0u;
  r.s[2] = hi_ok ? __ldg(s0 + 4) : 0u;
  r.s[3] = hi_ok ? __ldg(s1 + 4) : 0u;
}

// Before griddepcontrol.wait (programmatic dependent launch: the previous kernel may still run),
// pull the weight of chunks [ch, ch_end) into L2: L2 is where global memory is coherent, so this
// cannot make a later load stale, whatever the previous kernel writes.
__device__ __forceinline__ void prefetch_weight(const Rows& rows, int ch, int ch_end) {
  for (; ch < ch_end; ++ch) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.w0 + ch * 8));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.w1 + ch * 8));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.s0 + ch * 8));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.s1 + ch * 8));
  }
}

// Wait for the previous kernel on the stream (its writes visible); a no-op without PDL.
__device__ __forceinline__ void wait_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// A fragments of the 8 steps of a chunk: a[p] = {(r0, 2t..), (r1, 2t..), (r0, 2t+8..), (r1, 2t+8..)}.
// UNIT: the words as the unit layout stores them (decode_pair_unit) and the four scale bytes
// packed in r.s[0] (unit_raw).
template <bool UNIT = false>
__device__ __forceinline__ void decode_raw(const Raw& r, u32 (&a)[8][4]) {
  u32 s[4];
  if constexpr (UNIT) scales_bf16x2(r.s[0], s);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 o[8];
    if constexpr (UNIT)
      decode_pair_unit(r.w[2 * j], r.w[2 * j + 1], s[j], o);
    else
      decode_pair(r.w[2 * j], r.w[2 * j + 1], r.s[j], o);
#pragma unroll
    for (int q = 0; q < 8; ++q) a[q][j] = o[q];
  }
}

__device__ __forceinline__ float bits_f32(u32 v) { return __int_as_float((int)v); }

// The contract's epilogue for one output: the accumulator * 2^14, * the activation and weight
// decode scales, + the bias (where there is one), one IEEE operation at a time.
__device__ __forceinline__ float out_value(const Params& p, float d, float ad, float wd, float b) {
  float v = __fmul_rn(d, 16384.0f);
  v = __fmul_rn(v, ad);
  v = __fmul_rn(v, wd);
  return p.bias ? __fadd_rn(v, b) : v;
}

// The epilogue's factors for one thread's outputs (weight rows n_base + g and n_base + g + 8,
// batch rows m0 + 8 j + 2 t + {0, 1}; clamped), loaded before any store: loads after a store
// of the output could not be moved above it by the compiler, and each would wait for memory.
template <int BM>
struct OutScales {
  float wa, wb, ba, bb, ad[BM / 4];
  // a_dec: the activation's decode scales where not p.a_dec (one per row, contiguous: the
  // streamed kernel's own, in shared memory, where it quantizes the rows itself)
  __device__ __forceinline__ OutScales(const Params& p, int n_base, int m0, int g, int t,
                                       const float* a_dec = nullptr) {
    const int na = min(n_base + g, p.N - 1), nb = min(n_base + g + 8, p.N - 1);
    wa = p.w_dec[(long long)na * p.w_dec_stride];
    wb = p.w_dec[(long long)nb * p.w_dec_stride];
    ba = p.bias ? p.bias[na] : 0.f;
    bb = p.bias ? p.bias[nb] : 0.f;
    const float* src = a_dec ? a_dec : p.a_dec;
    const long long stride = a_dec ? 1 : p.a_dec_stride;
#pragma unroll
    for (int h = 0; h < BM / 4; ++h)
      ad[h] = src[(long long)min(m0 + 8 * (h / 2) + 2 * t + (h & 1), p.M - 1) * stride];
  }
  // Accumulator element i as an output (out_value).
  __device__ __forceinline__ float apply(const Params& p, float d, int i) const {
    const int j = i / 4, e = i % 4;
    return out_value(p, d, ad[2 * j + (e & 1)], (e & 2) ? wb : wa, (e & 2) ? bb : ba);
  }
};

// v in the 16-bit output type (out_kind 0: BF16, 1: FP16), round to nearest even.
__device__ __forceinline__ unsigned short out16(const Params& p, float v) {
  unsigned short h;
  if (p.out_kind == 0)
    asm("{\n.reg .b32 x;\ncvt.rn.bf16x2.f32 x, %1, %1;\nmov.b32 {%0, _}, x;\n}\n" : "=h"(h) : "f"(v));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// The outputs from the accumulator's layout; RANGE: only those of batch rows m0 + [r_lo, r_hi).
// a_dec: as OutScales.
template <int BM, bool RANGE = false>
__device__ __forceinline__ void store_out(const Params& p, const Acc<BM>& acc, int n_base, int m0,
                                          int g, int t, int r_lo = 0, int r_hi = BM,
                                          const float* a_dec = nullptr) {
  const OutScales<BM> sc(p, n_base, m0, g, t, a_dec);
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    const int j = i / 4, e = i % 4;
    const int n = n_base + g + ((e & 2) ? 8 : 0);
    const int r = 8 * j + 2 * t + (e & 1), m = m0 + r;
    if (n >= p.N || m >= p.M || (RANGE && (r < r_lo || r >= r_hi))) continue;
    const float v = sc.apply(p, acc.d[i], i);
    char* out = (char*)p.y;
    const long long off = (long long)m * p.stride_ym + (long long)n * p.stride_yn;
    if (p.out_kind == 2)
      ((float*)out)[off] = v;
    else
      ((unsigned short*)out)[off] = out16(p, v);
  }
}

// One 128-element chunk's wgmma chain (8 k16 steps of BM columns), asynchronous: the first step
// of a fold chunk starts from zero.
template <int BM>
__device__ __forceinline__ void issue_chunk(Acc<BM>& part, const u32 (&a)[8][4], u64 desc,
                                            int first_in_fold) {
  wgmma_fence();
  fence_acc(part);
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    wgmma(part, a[q], desc + (u64)(q * BM * 2), (q == 0 && first_in_fold) ? 0 : 1);
  }
  wgmma_commit();
}

template <int BM, int P, bool EVEN_K>
__device__ __forceinline__ void chunk_step(const Params& p, const Rows& rows, Raw (&raw)[2],
                                           u32 (&a)[2][8][4], Acc<BM>& part, Acc<BM>& acc,
                                           u64 desc0, unsigned char* smem, int ch, int ch_first,
                                           int ch_end, int t, bool split) {
  decode_raw(raw[P], a[P]);
  if (ch + 2 < ch_end) load_raw<EVEN_K>(rows, ch + 2, t, p.K, raw[P]);
  // Descriptor start addresses advance in 16-byte units: one step block is BM * 32 bytes.
  const u64 desc = desc0 + (u64)((ch - ch_first) * 8 * BM * 2);
  const int first_in_fold = (ch % FOLD_CHUNKS) == 0;
  issue_chunk<BM>(part, a[P], desc, first_in_fold);
  const bool fold_here = ((ch + 1) % FOLD_CHUNKS == 0) || (ch + 1 == ch_end);
  if (fold_here) {
    wgmma_wait<0>();
    fence_acc(part);
    if (split) {
      // This fold chunk's partial replaces its (consumed) activation block in shared memory,
      // where the cluster's first CTA reads it.
      float* dst = (float*)(smem + (ch / FOLD_CHUNKS - ch_first / FOLD_CHUNKS) * (BM * 1024) +
                            threadIdx.x * (BM * 2));
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) dst[i] = part.d[i];
    } else {
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) acc.d[i] = __fadd_rn(acc.d[i], part.d[i]);
    }
  } else {
    wgmma_wait<1>();
  }
}

template <int BM, bool EVEN_K, int SPLITS>
__device__ __forceinline__ void gemm_small_m(const Params& p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int K = p.K;
  const int k_pad = (K + 127) / 128 * 128;
  const int n_folds = (K + 511) / 512;
  const int fold_first = blockIdx.y * p.chunks_per_split;
  const int fold_last = min(fold_first + p.chunks_per_split, n_folds);
  const int ch_first = fold_first * FOLD_CHUNKS;
  const int ch_end = min(fold_last * FOLD_CHUNKS, k_pad / 128);
  PHASE_TIME(0);
  const bool split = SPLITS > 1;
  const int m0 = blockIdx.z * BM;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.x * ROWS + 16 * warp;
  const Rows rows = weight_rows(p, n_base, g, t);


  prefetch_weight(rows, ch_first, min(ch_first + 4, ch_end));
  wait_previous_kernel();

  // Stage the activation slice: step block (chunk c, stream q) = BM rows x 16 k-positions,
  // core matrices of 8 rows x 8 k (128 bytes) at rowgroup * sbo + khalf * lbo.
  const u32 smem_base = (u32)__cvta_generic_to_shared(smem);
  Raw raw[2];
  if (ch_first < ch_end) load_raw<EVEN_K>(rows, ch_first, t, K, raw[0]);
  if (ch_first + 1 < ch_end) load_raw<EVEN_K>(rows, ch_first + 1, t, K, raw[1]);
  {
    // The activation's valid rows decoded from their codes into wgmma's B step blocks: one word
    // pair (16 elements, one scale) per thread at a time, a BF16x2 per stream. Rows past M are
    // left unwritten: they only feed output columns that are never stored.
    const int valid_rows = min(BM, p.M - m0);
    const int pairs = valid_rows * (ch_end - ch_first) * 8;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
      const int tp = i & 7, rc = i >> 3;
      const int r = rc % valid_rows, c = rc / valid_rows, ch = ch_first + c;
      u32 w0 = 0, w1 = 0, sb = 0;
      if (EVEN_K || ch * 128 + 16 * tp + 16 <= K) {
        const uint2 w = __ldg((const uint2*)(p.a_words + (long long)(m0 + r) * p.stride_aw +
                                             ch * 16 + 2 * tp));
        w0 = w.x;
        w1 = w.y;
        sb = __ldg(p.a_scales + (long long)(m0 + r) * p.stride_as + ch * 8 + tp);
      }
      u32 o[8];
      decode_pair(w0, w1, sb, o);
      store_b_pair<BM>(smem + c * 8 * (BM * 32), r, tp, p.lbo, p.sbo, o);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
  }
  PHASE_TIME(1);

  u32 a[2][8][4];
  Acc<BM> part, acc;
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    part.d[i] = 0.f;
    acc.d[i] = 0.f;
  }
  const u64 desc0 = smem_desc(smem_base, p.lbo, p.sbo);
  int ch = ch_first;
  for (; ch + 1 < ch_end; ch += 2) {
    chunk_step<BM, 0, EVEN_K>(p, rows, raw, a, part, acc, desc0, smem, ch, ch_first, ch_end, t,
                              split);
    chunk_step<BM, 1, EVEN_K>(p, rows, raw, a, part, acc, desc0, smem, ch + 1, ch_first, ch_end,
                              t, split);
  }
  if (ch < ch_end)
    chunk_step<BM, 0, EVEN_K>(p, rows, raw, a, part, acc, desc0, smem, ch, ch_first, ch_end, t,
                              split);

  PHASE_TIME(2);
  if (!split) {
    store_out<BM>(p, acc, n_base, m0, g, t);
    PHASE_TIME(3);
    return;
  }
  // The split CTAs of a tile form a cluster; each holds its fold chunks' partials in shared
  // memory. The first CTA reads them all (distributed shared memory), in fold order.
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
  u32 rank;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (rank == 0) {
    const int per_split = p.chunks_per_split;
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc.d[i] = 0.f;
    const u32 mine = smem_base + threadIdx.x * (BM * 2);
#pragma unroll 1
    for (int r = 0; r < SPLITS; ++r) {
      const int count = max(0, min(per_split, n_folds - r * per_split));
      u32 remote;
      asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(mine), "r"(r));
      // all of this CTA's fold chunks in flight together (at most 64 / BM), then added in order
      constexpr int MAXF = 64 / BM;
      float v[MAXF][BM / 2];
#pragma unroll
      for (int f = 0; f < MAXF; ++f) {
        if (f < count) {
#pragma unroll
          for (int i = 0; i < BM / 2; i += 4)
            asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(v[f][i]), "=f"(v[f][i + 1]), "=f"(v[f][i + 2]), "=f"(v[f][i + 3])
                         : "r"(remote + f * (BM * 1024) + i * 4)
                         : "memory");
        }
      }
#pragma unroll
      for (int f = 0; f < MAXF; ++f) {
        if (f < count) {
#pragma unroll
          for (int i = 0; i < BM / 2; ++i) acc.d[i] = __fadd_rn(acc.d[i], v[f][i]);
        }
      }
    }
    store_out<BM>(p, acc, n_base, m0, g, t);
  }
  // Keep every CTA's shared memory alive until the first one has read it.
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
  PHASE_TIME(3);
}

#define SMALL_M_KERNEL(BM, S)                                                              \
  extern "C" __global__ void __cluster_dims__(1, S, 1) __launch_bounds__(128, 4)              \
      w4a4_small_m##BM##_s##S(const Params p) {                                               \
    gemm_small_m<BM, false, S>(p);                                                            \
  }                                                                                           \
  extern "C" __global__ void __cluster_dims__(1, S, 1) __launch_bounds__(128, 4)              \
      w4a4_small_m##BM##_s##S##_even_k(const Params p) {                                      \
    gemm_small_m<BM, true, S>(p);                                                             \
  }
SMALL_M_KERNEL(8, 1)
SMALL_M_KERNEL(8, 2)
SMALL_M_KERNEL(8, 4)
SMALL_M_KERNEL(8, 8)
SMALL_M_KERNEL(16, 1)
SMALL_M_KERNEL(16, 2)
SMALL_M_KERNEL(16, 4)
SMALL_M_KERNEL(16, 8)

// ---- Mid M (up to 64 batch rows per CTA): the activation decoded once, streamed by cp.async ----
//
// Same K order and fold as above. `w4a4_decode_act` decodes the activation once into its
// shared-memory image (per M tile and 128-element chunk, the BM x 128 B operand exactly as wgmma
// reads it, rows past M zero), so the GEMM CTAs copy it with cp.async into a RING-chunk ring
// instead of each decoding it again; the weight is decoded in registers as above. WGS = 2 (for
// grids of at most one CTA per SM): two warpgroups per CTA share its 64 weight rows and take
// turns by fold chunk (even / odd), each with its own ring (one barrier per chunk: after it, the
// warpgroup is past the wgmma of its chunk j - 2, whose slot is refilled), so two warps per
// scheduler hide each other's latency; the second hands each fold chunk's partial to the first
// through shared memory, which folds them in order. WGS = 1 (larger grids): two CTAs per SM.
// No split K (clusters measured slower at every mid-M shape). Grid: (M tiles, N tiles), so the
// CTAs sharing a weight slice run together and read it from L2 once.

#define RING 4  // activation chunks in flight per CTA (prefetch distance RING - 2)

// An activation pass's CTA c past p.pass_ctas: 256 (weight row, 128-element chunk) items of the
// padded weight scales (Params::w_scales_src), one per thread: its 8 bytes (zeros past K) loaded
// at once, stored as one word.
__device__ __forceinline__ void pad_weight_scales(const Params& p, int c) {
  const int chunks = (int)(p.stride_ws / 8), have = p.K / 16;
  const long long item = (long long)c * 256 + threadIdx.x;
  if (item >= (long long)p.N * chunks) return;
  const int row = (int)(item / chunks), b0 = (int)(item - (long long)row * chunks) * 8;
  const unsigned char* src = p.w_scales_src + (long long)row * p.stride_ws_src + b0;
  unsigned long long word = 0;
#pragma unroll
  for (int b = 0; b < 8; ++b)
    if (b0 + b < have) word |= (unsigned long long)__ldg(src + b) << (8 * b);
  ((unsigned long long*)p.w_scales)[item] = word;
}

template <int BM>
__device__ __forceinline__ void decode_act_image(const Params& p) {
  // one thread per (row, chunk, code-word pair); rows past M decode zeros
  wait_previous_kernel();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the GEMM may start
  if ((int)blockIdx.x >= p.pass_ctas) {
    pad_weight_scales(p, blockIdx.x - p.pass_ctas);
    return;
  }
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int m_tiles = (p.M + BM - 1) / BM;
  if (i >= (long long)m_tiles * BM * p.a_chunks * 8) return;
  const int tp = (int)(i & 7);
  const long long rc = i >> 3;
  const int row = (int)(rc % (m_tiles * BM)), ch = (int)(rc / (m_tiles * BM));
  u32 w0 = 0, w1 = 0, sb = 0;
  if (row < p.M && ch * 128 + 16 * tp + 16 <= p.K) {
    const uint2 w = __ldg((const uint2*)(p.a_words + (long long)row * p.stride_aw + ch * 16 + 2 * tp));
    w0 = w.x;
    w1 = w.y;
    sb = __ldg(p.a_scales + (long long)row * p.stride_as + ch * 8 + tp);
  }
  u32 o[8];
  decode_pair(w0, w1, sb, o);
  const int r = row % BM;
  unsigned char* chunk = (unsigned char*)p.a_image +
                         ((long long)(row / BM) * p.a_chunks + ch) * (BM * 256);
  store_b_pair<BM>(chunk, r, tp, p.lbo, p.sbo, o);
}

extern "C" __global__ void __launch_bounds__(256) w4a4_decode_act_m32(const Params p) {
  decode_act_image<32>(p);
}
extern "C" __global__ void __launch_bounds__(256) w4a4_decode_act_m64(const Params p) {
  decode_act_image<64>(p);
}

// Copy chunk ch of this CTA's M tile into ring slot `slot` at `ring` (BM * 256 bytes, 16 per
// cp.async, by the 128 threads `tid` of one warpgroup).
template <int BM>
__device__ __forceinline__ void copy_act(const Params& p, u32 ring, int ch, int slot, int tid) {
  const unsigned char* src = p.a_image + ((long long)blockIdx.x * p.a_chunks + ch) * (BM * 256);
  const u32 dst = ring + slot * (BM * 256);
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    const int off = (j * 128 + tid) * 16;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + off), "l"(src + off)
                 : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int ID, int THREADS>
__device__ __forceinline__ void named_barrier() {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS) : "memory");
}

// The j-th chunk of warpgroup wg of WGS: fold chunks go round the warpgroups.
template <int WGS>
__device__ __forceinline__ int wg_chunk(int j, int wg) {
  return (WGS * (j >> 2) + wg) * FOLD_CHUNKS + (j & 3);
}

// Step j of a warpgroup (its chunk wg_chunk(j, wg)); n_j steps in all, the same for every
// warpgroup, so that every branch around the wgmma is uniform across the CTA (a warpgroup-
// dependent path there makes the compiler serialize every wgmma of the kernel).
template <int BM, int WGS, int P, bool EVEN_K>
__device__ __forceinline__ void mid_step(const Params& p, const Rows& rows, Raw (&raw)[2],
                                         u32 (&a)[2][8][4], Acc<BM>& part, Acc<BM>& acc,
                                         u32 ring, float* xbuf, int j, int n_j, int k_chunks,
                                         int wg, int tid, int t) {
  asm volatile("cp.async.wait_group %0;" ::"n"(RING - 3) : "memory");  // step j's chunk landed
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  // ... for the warpgroup (barrier 1 + wg, no branch); all its warps are past step j - 2
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
  if (j + RING - 2 < n_j)
    copy_act<BM>(p, ring, wg_chunk<WGS>(j + RING - 2, wg), (j + RING - 2) % RING, tid);
  cp_async_commit();
  decode_raw(raw[P], a[P]);
  if (j + 2 < n_j)
    load_raw<EVEN_K>(rows, wg_chunk<WGS>(j + 2, wg), t, p.K, raw[P],
                     wg_chunk<WGS>(j + 2, wg) < k_chunks);
  const u64 desc = smem_desc(ring + (j % RING) * (BM * 256), p.lbo, p.sbo);
  const int first_in_fold = (j & 3) == 0;
  issue_chunk<BM>(part, a[P], desc, first_in_fold);
  if ((j & 3) != 3 && j + 1 != n_j) {
    wgmma_wait<1>();
    return;
  }
  // End of this warpgroup's fold chunk. One warpgroup: fold it. Two (fold chunks 2i and 2i + 1):
  // both write their partial to the exchange buffer and, after the barrier, add their own and
  // then the second's; the first warpgroup's sum is the result (the second's is never stored),
  // all without a warpgroup-dependent branch.
  wgmma_wait<0>();
  fence_acc(part);
  if (WGS == 1) {
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc.d[i] = __fadd_rn(acc.d[i], part.d[i]);
    return;
  }
  float* pair = xbuf + ((j >> 2) & 1) * BM * 128 + tid;  // [2 warpgroups][BM / 2][128 threads]
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) pair[(wg * (BM / 2) + i) * 128] = part.d[i];
  named_barrier<3, 256>();
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    acc.d[i] = __fadd_rn(acc.d[i], part.d[i]);
    acc.d[i] = __fadd_rn(acc.d[i], pair[((BM / 2) + i) * 128]);
  }
}

// p.a_chunks: chunks per row of the activation image; with two warpgroups a multiple of 8 (whole
// fold-chunk pairs; the padding chunks are zeros in the image and in the weight loads, and a
// zero fold chunk leaves the fold's sum bitwise unchanged: it is never -0).
template <int BM, int WGS, bool EVEN_K>
__device__ __forceinline__ void gemm_mid_m(const Params& p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int n_j = p.a_chunks / WGS, k_chunks = (p.K + 127) / 128;
  const int m0 = blockIdx.x * BM;
  const int wg = WGS == 1 ? 0 : threadIdx.x >> 7, tid = threadIdx.x & 127;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.y * ROWS + 16 * warp;
  const Rows rows = weight_rows(p, n_base, g, t);

  for (int j = 0; j < 4 && j < n_j; ++j) {
    const int ch = wg_chunk<WGS>(j, wg);
    if (ch < k_chunks) prefetch_weight(rows, ch, ch + 1);
  }
  wait_previous_kernel();
  const u32 ring = (u32)__cvta_generic_to_shared(smem) + wg * (RING * BM * 256);
  float* xbuf = (float*)(smem + WGS * (RING * BM * 256));
#pragma unroll
  for (int s = 0; s < RING - 2; ++s) {
    if (s < n_j) copy_act<BM>(p, ring, wg_chunk<WGS>(s, wg), s, tid);
    cp_async_commit();
  }
  Raw raw[2];
  load_raw<EVEN_K>(rows, wg_chunk<WGS>(0, wg), t, p.K, raw[0], wg_chunk<WGS>(0, wg) < k_chunks);
  if (1 < n_j)
    load_raw<EVEN_K>(rows, wg_chunk<WGS>(1, wg), t, p.K, raw[1], wg_chunk<WGS>(1, wg) < k_chunks);

  u32 a[2][8][4];
  Acc<BM> part, acc;
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    part.d[i] = 0.f;
    acc.d[i] = 0.f;
  }
  int j = 0;
  for (; j + 1 < n_j; j += 2) {
    mid_step<BM, WGS, 0, EVEN_K>(p, rows, raw, a, part, acc, ring, xbuf, j, n_j, k_chunks, wg,
                                 tid, t);
    mid_step<BM, WGS, 1, EVEN_K>(p, rows, raw, a, part, acc, ring, xbuf, j + 1, n_j, k_chunks,
                                 wg, tid, t);
  }
  if (j < n_j)
    mid_step<BM, WGS, 0, EVEN_K>(p, rows, raw, a, part, acc, ring, xbuf, j, n_j, k_chunks, wg,
                                 tid, t);
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (wg == 0) store_out<BM>(p, acc, n_base, m0, g, t);
}

#define MID_M_KERNEL(BM, WGS)                                                                 \
  extern "C" __global__ void __launch_bounds__(128 * WGS, 2 / WGS)                              \
      w4a4_mid_m##BM##_w##WGS(const Params p) {                                                 \
    gemm_mid_m<BM, WGS, false>(p);                                                              \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(128 * WGS, 2 / WGS)                              \
      w4a4_mid_m##BM##_w##WGS##_even_k(const Params p) {                                        \
    gemm_mid_m<BM, WGS, true>(p);                                                               \
  }
MID_M_KERNEL(32, 1)
MID_M_KERNEL(32, 2)
MID_M_KERNEL(64, 1)
MID_M_KERNEL(64, 2)

// ---- Wide M (warp-specialized): producer warpgroups decode the weight into shared memory ----
//
// Same K order and fold as above. A CTA computes WS_ROWS = 64 weight rows x BN batch rows over the
// whole K. PROD producer warpgroups fill a STAGES-deep ring, one 128-element chunk per stage: the
// chunk's activation block (BN x 256 B of the image `w4a4_decode_act` wrote, one bulk copy) and the
// weight chunk decoded from its codes into wgmma's shared-memory A layout (64 x 256 B); producer
// warpgroup i fills chunks i, i + PROD, ... CONS consumer warpgroups issue the wgmma chains with
// both operands in shared memory (m64 n(BN / CONS) k16; consumer c takes batch rows c * BN / CONS
// onward), each folding its own accumulator. Full / empty barriers per stage (mbarrier), so the
// decode of chunk j + STAGES - 1 overlaps the tensor-core work of chunk j. Grid: (M tiles, N tiles).

#define WS_ROWS 64

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
// One arrival that also announces `bytes` of asynchronous copies completing on the barrier.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
          bar),
      "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Bulk copy of `bytes` (a multiple of 16) from global to this CTA's shared memory, completing on
// barrier `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The same with the source's L2 lines marked first to evict: data read once per launch (the
// streamed kernel's weight), which then leaves L2 to the partials and the activation.
__device__ __forceinline__ void bulk_copy_once(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], "
      "%2, [%3], pol;\n}\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void wgmma_ss(Acc<32>& c, u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(WGMMA_HEAD(18) "32k16.f32.bf16.bf16 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
               "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(c.d[0]), "+f"(c.d[1]), "+f"(c.d[2]), "+f"(c.d[3]), "+f"(c.d[4]), "+f"(c.d[5]),
                 "+f"(c.d[6]), "+f"(c.d[7]), "+f"(c.d[8]), "+f"(c.d[9]), "+f"(c.d[10]), "+f"(c.d[11]),
                 "+f"(c.d[12]), "+f"(c.d[13]), "+f"(c.d[14]), "+f"(c.d[15])
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_ss(Acc<64>& c, u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(WGMMA_HEAD(34) "64k16.f32.bf16.bf16 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,"
               "%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
               "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : "+f"(c.d[0]), "+f"(c.d[1]), "+f"(c.d[2]), "+f"(c.d[3]), "+f"(c.d[4]), "+f"(c.d[5]),
                 "+f"(c.d[6]), "+f"(c.d[7]), "+f"(c.d[8]), "+f"(c.d[9]), "+f"(c.d[10]), "+f"(c.d[11]),
                 "+f"(c.d[12]), "+f"(c.d[13]), "+f"(c.d[14]), "+f"(c.d[15]), "+f"(c.d[16]), "+f"(c.d[17]),
                 "+f"(c.d[18]), "+f"(c.d[19]), "+f"(c.d[20]), "+f"(c.d[21]), "+f"(c.d[22]), "+f"(c.d[23]),
                 "+f"(c.d[24]), "+f"(c.d[25]), "+f"(c.d[26]), "+f"(c.d[27]), "+f"(c.d[28]), "+f"(c.d[29]),
                 "+f"(c.d[30]), "+f"(c.d[31])
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The 64 accumulator registers of an m64n128 wgmma: their placeholders and their operands.
#define ACC128_REGS                                                                            \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"   \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45," \
  "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define ACC8_OUT(c, i)                                                                         \
  "+f"(c.d[i]), "+f"(c.d[i + 1]), "+f"(c.d[i + 2]), "+f"(c.d[i + 3]), "+f"(c.d[i + 4]),         \
      "+f"(c.d[i + 5]), "+f"(c.d[i + 6]), "+f"(c.d[i + 7])
#define ACC128_OUT(c)                                                                          \
  ACC8_OUT(c, 0), ACC8_OUT(c, 8), ACC8_OUT(c, 16), ACC8_OUT(c, 24), ACC8_OUT(c, 32),            \
      ACC8_OUT(c, 40), ACC8_OUT(c, 48), ACC8_OUT(c, 56)

__device__ __forceinline__ void wgmma_ss(Acc<128>& c, u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(WGMMA_HEAD(66) "128k16.f32.bf16.bf16 {"
               ACC128_REGS
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : ACC128_OUT(c)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <int BN>
struct WsShape {
  static constexpr int W_BYTES = WS_ROWS * 256;  // one decoded weight chunk
  static constexpr int A_BYTES = BN * 256;       // one activation chunk of the image
  static constexpr int STAGE = W_BYTES + A_BYTES;
  static constexpr int STAGES = 204800 / STAGE < 8 ? 204800 / STAGE : 8;  // w4a4_gemm_cuda.py
};

// The codes of one producer thread for one chunk: rows r and r + 32, each 16 bytes (code words
// 4u..4u+3, scale blocks 2u, 2u + 1 of the chunk; u = the thread's quarter of the row), zeros past
// K. Four threads read a row's 64 bytes side by side: coalesced.
struct WsRaw {
  uint4 w[2];
  u32 s[2];
};

// A producer thread's two weight rows (clamped to N: rows past it are never stored).
struct WsRows {
  const u32* w[2];
  const unsigned char* s[2];
};

template <bool EVEN_K>
__device__ __forceinline__ void ws_load(const WsRows& rows, int ch, int u, int K, WsRaw& r) {
  const bool ok = EVEN_K || ch * 128 + 32 * u + 32 <= K;  // K % 32 == 0 (the host checks)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint4 v = make_uint4(0, 0, 0, 0);
    u32 sc = 0;
    if (ok) {
      v = __ldg((const uint4*)(rows.w[i] + ch * 16 + 4 * u));
      sc = __ldg((const unsigned short*)(rows.s[i] + ch * 8 + 2 * u));
    }
    r.w[i] = v;
    r.s[i] = sc;
  }
}

// Decode into the stage's weight block: step q, core matrix (row / 8, u / 2), row % 8, bytes
// 8 (u % 2) onward: the k-positions 4u..4u+3 of stream q.
__device__ __forceinline__ void ws_decode_store(const Params& p, const WsRaw& r,
                                                unsigned char* wstage, int row, int u) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    u32 lo[8], hi[8];
    decode_pair(r.w[i].x, r.w[i].y, r.s[i] & 0xFFu, lo);
    decode_pair(r.w[i].z, r.w[i].w, r.s[i] >> 8, hi);
    const int rr = row + 32 * i;
    unsigned char* dst = wstage + (rr / 8) * p.sbo + (u / 2) * p.lbo + (rr % 8) * 16 + (u % 2) * 8;
#pragma unroll
    for (int q = 0; q < 8; ++q) *(uint2*)(dst + q * (WS_ROWS * 32)) = make_uint2(lo[q], hi[q]);
  }
}

// Codes of the producer's next RAW_DEPTH chunks are in registers, and its chunks up to
// L2_AHEAD ahead are prefetched into L2: one CTA per SM needs that many bytes in flight to stream
// the weight at DRAM speed.
#define RAW_DEPTH 4
#define L2_AHEAD 16

template <int BN, int PROD, int B, bool EVEN_K>
__device__ __forceinline__ void ws_produce(const Params& p, unsigned char* smem, u32 base,
                                           const WsRows& rows, WsRaw (&raw)[RAW_DEPTH], int j,
                                           int row, int u, int tid) {
  using S = WsShape<BN>;
  const int s = j % S::STAGES, round = j / S::STAGES;
  const u32 full = base + S::STAGES * S::STAGE + 8 * s, empty = full + 8 * S::STAGES;
  if (j + L2_AHEAD < p.a_chunks) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.w[0] + (j + L2_AHEAD) * 16 + 4 * u));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.w[1] + (j + L2_AHEAD) * 16 + 4 * u));
  }
  if (round > 0) mbar_wait(empty, (round - 1) & 1);
  if (tid == 0) {
    mbar_expect_tx(full, S::A_BYTES);
    const unsigned char* src = p.a_image + ((long long)blockIdx.x * p.a_chunks + j) * S::A_BYTES;
    bulk_copy(base + s * S::STAGE + S::W_BYTES, src, S::A_BYTES, full);
  }
  ws_decode_store(p, raw[B], smem + s * S::STAGE, row, u);
  if (j + RAW_DEPTH * PROD < p.a_chunks)
    ws_load<EVEN_K>(rows, j + RAW_DEPTH * PROD, u, p.K, raw[B]);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // for the consumers' wgmma
  mbar_arrive(full);
}

template <int BN, int CONS, int PROD, bool EVEN_K>
__device__ __forceinline__ void gemm_ws(const Params& p) {
  using S = WsShape<BN>;
  constexpr int NW = BN / CONS;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const u32 bars = base + S::STAGES * S::STAGE;  // full[STAGES], then empty[STAGES]
  const int n_j = p.a_chunks;
  // the warpgroup index through a shuffle: warp-uniform for the compiler, so the role branch below
  // does not count as divergent around the wgmma
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0), tid = threadIdx.x & 127;
  const int n0 = blockIdx.y * WS_ROWS;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::STAGES; ++s) {
      mbar_init(bars + 8 * s, 128 + 1);                  // a producer warpgroup + the bulk copy
      mbar_init(bars + 8 * (S::STAGES + s), 128 * CONS);  // every consumer thread
    }
  }
  __syncthreads();
  if (wg < PROD) {
    const int row = tid >> 2, u = tid & 3;  // rows row and row + 32, quarter u of each
    WsRows rows;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const long long r = min(n0 + row + 32 * i, p.N - 1);
      rows.w[i] = p.w_words + r * p.stride_ww;
      rows.s[i] = p.w_scales + r * p.stride_ws;
    }
    // the weight is no previous kernel's output: fetch it before waiting for that kernel
    for (int j = wg; j < n_j && j < L2_AHEAD; j += PROD) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.w[0] + j * 16 + 4 * u));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(rows.w[1] + j * 16 + 4 * u));
    }
    WsRaw raw[RAW_DEPTH];
#pragma unroll
    for (int i = 0; i < RAW_DEPTH; ++i)
      if (wg + i * PROD < n_j) ws_load<EVEN_K>(rows, wg + i * PROD, u, p.K, raw[i]);
    wait_previous_kernel();
    int j = wg;
    for (; j + 3 * PROD < n_j; j += 4 * PROD) {
      ws_produce<BN, PROD, 0, EVEN_K>(p, smem, base, rows, raw, j, row, u, tid);
      ws_produce<BN, PROD, 1, EVEN_K>(p, smem, base, rows, raw, j + PROD, row, u, tid);
      ws_produce<BN, PROD, 2, EVEN_K>(p, smem, base, rows, raw, j + 2 * PROD, row, u, tid);
      ws_produce<BN, PROD, 3, EVEN_K>(p, smem, base, rows, raw, j + 3 * PROD, row, u, tid);
    }
    if (j < n_j) ws_produce<BN, PROD, 0, EVEN_K>(p, smem, base, rows, raw, j, row, u, tid);
    j += PROD;
    if (j < n_j) ws_produce<BN, PROD, 1, EVEN_K>(p, smem, base, rows, raw, j, row, u, tid);
    j += PROD;
    if (j < n_j) ws_produce<BN, PROD, 2, EVEN_K>(p, smem, base, rows, raw, j, row, u, tid);
    return;
  }
  wait_previous_kernel();
  const int c = wg - PROD;
  const int lane = tid & 31, warp = tid >> 5;
  Acc<NW> part, acc;
#pragma unroll
  for (int i = 0; i < NW / 2; ++i) {
    part.d[i] = 0.f;
    acc.d[i] = 0.f;
  }
  // Per fold chunk: its chunks' chains into `part` (the first from zero), each chunk's stage
  // released once the next chain is issued and the previous one has completed; then the fold.
  for (int j = 0; j < n_j;) {
    const int j_end = min(j + FOLD_CHUNKS, n_j);
    int pending = -1;  // the stage whose chain may still be in flight
    for (int first = 1; j < j_end; ++j, first = 0) {
      const int s = j % S::STAGES;
      mbar_wait(bars + 8 * s, (j / S::STAGES) & 1);
      const u64 desc_a = smem_desc(base + s * S::STAGE, p.lbo, p.sbo);
      const u64 desc_b =
          smem_desc(base + s * S::STAGE + S::W_BYTES + c * (NW / 8) * p.sbo, p.lbo, p.sbo);
      wgmma_fence();  // no fence_acc here: touching `part` would make ptxas wait for the chain
#pragma unroll
      for (int q = 0; q < 8; ++q)
        wgmma_ss(part, desc_a + (u64)(q * WS_ROWS * 2), desc_b + (u64)(q * BN * 2),
                 (q == 0 && first) ? 0 : 1);
      wgmma_commit();
      wgmma_wait<1>();
      if (pending >= 0) mbar_arrive(bars + 8 * (S::STAGES + pending));
      pending = s;
    }
    wgmma_wait<0>();
    fence_acc(part);
    mbar_arrive(bars + 8 * (S::STAGES + pending));
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) acc.d[i] = __fadd_rn(acc.d[i], part.d[i]);
  }
  store_out<NW>(p, acc, n0 + 16 * warp, blockIdx.x * BN + c * NW, lane >> 2, lane & 3);
}

#define WS_KERNEL(BN, CONS, PROD)                                                            \
  extern "C" __global__ void __launch_bounds__(128 * (CONS + PROD), 1)                       \
      w4a4_ws_n##BN##_c##CONS##_p##PROD(const Params p) {                                    \
    gemm_ws<BN, CONS, PROD, false>(p);                                                       \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(128 * (CONS + PROD), 1)                       \
      w4a4_ws_n##BN##_c##CONS##_p##PROD##_even_k(const Params p) {                           \
    gemm_ws<BN, CONS, PROD, true>(p);                                                        \
  }
// (Measured on the H200 against (64, 1, 1), (64, 2, 1), (64, 2, 2), (128, 2, 1): these were the
// fastest per batch tile; benchmarks/NOTES_kernels.md.)
WS_KERNEL(64, 1, 2)
WS_KERNEL(128, 2, 2)
WS_KERNEL(256, 2, 1)

extern "C" __global__ void __launch_bounds__(256) w4a4_decode_act_m128(const Params p) {
  decode_act_image<128>(p);
}
extern "C" __global__ void __launch_bounds__(256) w4a4_decode_act_m256(const Params p) {
  decode_act_image<256>(p);
}

// ---- BF16 activation rows quantized and decoded into the image in one pass (w4a4_linear) ----
//
// The contract's activation quantizer (per-row amax over the finite elements, 1 x 16 blocks; the
// float32 steps and roundings of kernels/nvfp4_quantize.py, IEEE divisions, no contraction) on
// BF16 rows x (p.a_words: element pairs as words, p.stride_aw words per row, 16-byte aligned);
// each block's two code words and scale byte go straight into decode_pair and the image, as
// decode_act_image would decode them, and each row's decode scale (NaN if the row holds NaN or
// Inf) to p.a_dec. One CTA per image row; rows past M and blocks past K are zeros in the image.

#define QUANT_THREADS 256

// Nonnegative finite float32 in [0, 448] -> E4M3 code, round to nearest even (f32_to_e4m3_rne).
__device__ __forceinline__ u32 e4m3_code(float v) {
  if (v < 0.015625f)  // step 2^-9: v * 2^9 exact, + 2^23 rounds it to an integer, ties to even
    return (u32)(__float_as_int(__fadd_rn(__fmul_rn(v, 512.f), 8388608.f)) - 0x4B000000);
  const int bits = __float_as_int(v);
  return (u32)(((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3));
}

// E4M3 code 0..0x7E -> its float32 value (e4m3_to_f32).
__device__ __forceinline__ float e4m3_value(u32 c) {
  const u32 e = c >> 3, m = c & 7;
  return e == 0 ? __fmul_rn((float)m, 0.001953125f) : __int_as_float((int)(((e + 120) << 23) | (m << 20)));
}

// E2M1 magnitude code of a in [0, 6], nearest, ties to the even code (e2m1_code_rne).
__device__ __forceinline__ u32 e2m1_code(float a) {
  const int magic = (__float_as_int(fmaxf(a, 1.f)) & 0x7F800000) + 0x0B000000;
  const int rounded = __float_as_int(__fadd_rn(a, __int_as_float(magic)));
  return (u32)(rounded - magic + ((magic >> 22) - 298));
}

// Magnitude bits of a BF16 element (low or high half of a word), 0 for NaN / Inf; `bad` set then.
__device__ __forceinline__ u32 finite_mag(u32 half, u32& bad) {
  const u32 m = half & 0x7FFFu;
  bad |= m >= 0x7F80u;
  return m < 0x7F80u ? m : 0u;
}

// The largest finite magnitude of a 16-element block (v: its eight words of BF16 pairs) into
// `big` (BF16 bits: integer order is magnitude order); `bad` set where one is NaN or Inf.
__device__ __forceinline__ void block_max(const uint4 (&v)[2], u32& big, u32& bad) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const u32 w[4] = {v[h].x, v[h].y, v[h].z, v[h].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) big = max(big, max(finite_mag(w[j], bad), finite_mag(w[j] >> 16, bad)));
  }
}

// The largest finite magnitude and the NaN / Inf flag of a row's blocks first, first + step, ...
// (x: the row's BF16 pairs, `blocks` 16-element blocks; none where not `live`), reduced over the
// warp.
__device__ __forceinline__ void warp_row_max(const uint4* x, int blocks, int first, int step,
                                             bool live, u32& big, u32& bad) {
  big = bad = 0;
  for (int b = first; live && b < blocks; b += step) {
    const uint4 v[2] = {x[2 * b], x[2 * b + 1]};
    block_max(v, big, bad);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    big = max(big, __shfl_xor_sync(0xffffffffu, big, o));
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
  }
}

// A row's global scales from its largest finite magnitude `big` (global_scales): S_enc =
// min(2688 / amax, FLT_MAX), 1 where amax or it is 0; returns S_dec = 1 / S_enc and sets
// enc6 = S_enc * float32(1/6), the block scales' factor.
__device__ __forceinline__ float row_scales(u32 big, float& enc6) {
  const float amax = __int_as_float((int)(big << 16));
  float s_enc = fminf(__fdiv_rn(2688.f, amax), 3.4028234663852886e38f);
  if (amax == 0.f || s_enc == 0.f) s_enc = 1.f;
  enc6 = __fmul_rn(s_enc, 0.1666666716337204f);
  return __fdiv_rn(1.f, s_enc);
}

// A 16-element block of BF16 elements (v: its eight words of pairs) quantized with its row's
// scales (row_scales): its two code words (element e at nibble e % 8 of word e / 8) and its E4M3
// scale byte (returned). NaN and Inf elements become 0.
__device__ __forceinline__ u32 quantize_block(const uint4 (&v)[2], float s_dec, float enc6,
                                              u32 (&cw)[2]) {
  const u32 w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  float f[16];
  u32 bbig = 0, unused = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const u32 lo = finite_mag(w[j], unused), hi = finite_mag(w[j] >> 16, unused);
    bbig = max(bbig, max(lo, hi));
    f[2 * j] = lo ? __int_as_float((int)(w[j] << 16)) : 0.f;  // NaN / Inf -> 0
    f[2 * j + 1] = hi ? __int_as_float((int)(w[j] & 0xFFFF0000u)) : 0.f;
  }
  // block scale (_block_scales): E4M3(min(bamax * (S_enc / 6), 448)), its encode factor
  const u32 sb = e4m3_code(fminf(__fmul_rn(__int_as_float((int)(bbig << 16)), enc6), 448.f));
  const float enc = fminf(__fdiv_rn(1.f, __fmul_rn(e4m3_value(sb), s_dec)), 3.4028234663852886e38f);
  cw[0] = cw[1] = 0;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const float x = __fmul_rn(f[e], enc);
    cw[e >> 3] |= (e2m1_code(fminf(fabsf(x), 6.f)) | (x < 0.f ? 8u : 0u)) << (4 * (e & 7));
  }
  return sb;
}

template <int BM>
__device__ __forceinline__ void quantize_act_image(const Params& p) {
  wait_previous_kernel();                                          // x is the previous kernel's
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the GEMM may start
  if ((int)blockIdx.x >= p.pass_ctas) {
    pad_weight_scales(p, blockIdx.x - p.pass_ctas);
    return;
  }
  __shared__ u32 red_big[QUANT_THREADS / 32], red_bad[QUANT_THREADS / 32];
  const int row = blockIdx.x, tid = threadIdx.x, blocks = p.K / 16;
  const bool live = row < p.M;
  const uint4* x = (const uint4*)(p.a_words + (long long)(live ? row : 0) * p.stride_aw);
  // pass 1: the largest finite magnitude (BF16 bits: integer order is magnitude order)
  u32 big, bad;
  warp_row_max(x, blocks, tid, QUANT_THREADS, live, big, bad);
  if ((tid & 31) == 0) {
    red_big[tid >> 5] = big;
    red_bad[tid >> 5] = bad;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < QUANT_THREADS / 32; ++i) {
    big = max(big, red_big[i]);
    bad |= red_bad[i];
  }
  float enc6;
  const float s_dec = row_scales(big, enc6);
  if (live && tid == 0)  // the GEMM's a_dec, written here
    ((float*)p.a_dec)[(long long)row * p.a_dec_stride] = bad ? __int_as_float(0x7FC00000) : s_dec;
  unsigned char* tile = (unsigned char*)p.a_image + (long long)(row / BM) * p.a_chunks * (BM * 256);
  // pass 2: per 16-element block (chunk i / 8, code-word pair i % 8) its scale and codes
  for (int i = tid; i < p.a_chunks * 8; i += QUANT_THREADS) {
    u32 cw[2] = {0, 0}, sb = 0;
    if (live && i < blocks) {
      const uint4 v[2] = {x[2 * i], x[2 * i + 1]};
      sb = quantize_block(v, s_dec, enc6, cw);
    }
    u32 o[8];
    decode_pair(cw[0], cw[1], sb, o);
    store_b_pair<BM>(tile + (long long)(i >> 3) * (BM * 256), row % BM, i & 7, p.lbo, p.sbo, o);
  }
}

#define QUANTIZE_ACT_KERNEL(BM)                                                                 \
  extern "C" __global__ void __launch_bounds__(QUANT_THREADS)                                  \
      w4a4_quantize_act_m##BM(const Params p) {                                                 \
    quantize_act_image<BM>(p);                                                                  \
  }
QUANTIZE_ACT_KERNEL(16)
QUANTIZE_ACT_KERNEL(32)
QUANTIZE_ACT_KERNEL(64)
QUANTIZE_ACT_KERNEL(128)
QUANTIZE_ACT_KERNEL(256)
// ---- Small M, streamed: a persistent grid over (weight tile, fold chunk) units ----
//
// Same K order and fold as above. The work is U = N tiles x fold chunks units of 64 weight rows x
// 512 K; CTA b takes the contiguous units [b U / G, (b + 1) U / G), tile-major, so a tile's fold
// chunks sit in one or two CTAs. A producer warpgroup fills a STAGES-deep ring, one unit per stage:
// the weight codes and scales (16-byte cp.async: per-row bulk copies measured 3x slower, the copy
// engine being slow per request, and TMA boxes no faster) and the activation's K slice decoded
// into wgmma's B layout. NWG
// consumer warpgroups take the CTA's units in turn and run each fold chunk's chain with the weight
// decoded from the stage into register A fragments. Partials go to a global workspace; when a
// warpgroup leaves a tile it adds its units to the tile's arrival counter, and the one that
// completes the count folds the tile's partials in chunk order, stores the output and zeroes the
// counter for the next launch. Tiles of a single fold chunk store directly. The host requires
// K % 256 == 0 and 16-byte aligned rows. w4a4_stream_image_*: the unit layout, and the activation
// as the decoded image of one M tile (w4a4_quantize_act_m##BM, the launch before), each unit's
// block bulk-copied beside its weight instead of decoded by the producer (w4a4_linear, 8 < M <= 16).

#define LBO_BYTES 128  // B core matrices: along K (LBO) and along the rows (SBO)
#define SBO_BYTES 256

template <int BM, bool UNIT = false>
struct StreamShape {
  // canonical rows: 256 bytes of codes per row and fold chunk, padded to 288; unit layout: the
  // unit's 18 KB as stored (codes 16 KB, then scales 2 KB)
  static constexpr int W_STRIDE = 288;
  static constexpr int W_CODES = UNIT ? 16384 : ROWS * W_STRIDE;
  static constexpr int W_SCALES = ROWS * 32;
  static constexpr int B_BYTES = BM * 1024;  // the fold chunk's activation, decoded (wgmma B)
  static constexpr int STAGE = W_CODES + W_SCALES + B_BYTES;
  // Unit i goes into stage i % STAGES and to consumer warpgroup i % NWG. STAGES is a multiple of
  // every NWG (2, 3), so each stage has one consumer warpgroup, which takes its rounds in order:
  // when it waits on a stage's full barrier for round r, it has itself consumed round r - 1. With
  // stages shared round-robin (the earlier 5 or 7), a warpgroup could wait on round r while round
  // r - 1's copies, another warpgroup's unit, were still landing; the parity wait then read that
  // barrier's phase r - 2 as complete, took the stage early and unbalanced its empty barrier: a
  // rare hang (and stale data). 6 stages of the largest stage (BM = 16, canonical rows: 36 KB)
  // plus the barriers, flags and the rows area fit the 227 KB of shared memory.
  // w4a4_gemm_cuda.py: Plan.smem.
  static constexpr int STAGES = 6;
};

// This thread's weight data of chunk c of a stage: rows r0 = 16 warp + g and r0 + 8, words
// {2t, 2t+1} and {2t+8, 2t+9}, scale bytes t and t + 4 (the layout load_raw reads from global).
// Rows are 288 bytes apart, so the warp's eight rows hit distinct banks.
__device__ __forceinline__ void stream_raw(const unsigned char* stage, int r0, int c, int t,
                                           Raw& r) {
  const unsigned char* w0 = stage + r0 * 288 + c * 64 + 8 * t;
  const unsigned char* w1 = w0 + 8 * 288;
  const uint2 a = *(const uint2*)w0, b = *(const uint2*)w1;
  const uint2 cc = *(const uint2*)(w0 + 32), d = *(const uint2*)(w1 + 32);
  r.w[0] = a.x; r.w[1] = a.y; r.w[2] = b.x; r.w[3] = b.y;
  r.w[4] = cc.x; r.w[5] = cc.y; r.w[6] = d.x; r.w[7] = d.y;
  const unsigned char* s0 = stage + ROWS * 288 + r0 * 32 + c * 8 + t;
  r.s[0] = s0[0];
  r.s[1] = s0[8 * 32];
  r.s[2] = s0[4];
  r.s[3] = s0[8 * 32 + 4];
}

// The same data from a stage in the unit layout: chunk c, warp w: two 512-byte blocks of 16 bytes
// per lane (words 2t, 2t+1 of rows r0, r0 + 8, then words 2t + 8, 2t + 9), then the scales at
// 16384 + (4 c + w) * 128, 4 bytes per lane (blocks t, t + 4 of rows r0, r0 + 8, in Raw's order),
// kept packed in r.s[0] for decode_raw<true>.
__device__ __forceinline__ void unit_raw(const unsigned char* stage, int c, int warp, int lane,
                                         Raw& r) {
  const unsigned char* blk = stage + (c * 4 + warp) * 1024 + lane * 16;
  const uint4 a = *(const uint4*)blk, b = *(const uint4*)(blk + 512);
  r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
  r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
  const u32 sc = *(const u32*)(stage + 16384 + (c * 4 + warp) * 128 + lane * 4);
  r.s[0] = sc;
}

// 16 bytes from global to shared memory (cp.async, L2 only).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// BYTES (8 or 16) from global to shared memory, the last BYTES - valid of them zeros (cp.async's
// zero fill; `valid` 0 reads nothing).
template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(u32 dst, const void* src, int valid) {
  if constexpr (BYTES == 16)  // L2 only
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(BYTES),
                 "r"(valid)
                 : "memory");
}

// The rows variant (QUANT, M <= 8 with M x K <= STREAM_QROWS_MAX): the CTA quantizes the BF16
// rows itself, its consumers before their first unit, into an area after the ring's barriers:
// the codes (K / 8 words per row), the scale bytes (K / 16 per row), the consumers' per-warp row
// maxima and bad flags, the rows' S_dec and S_enc / 6, their decode scales (NaN for a row holding
// NaN or Inf) for the epilogue, and the barrier on which the consumers announce the codes to the
// producer. Same bits as the contract's quantizer (quantize_block, row_scales) and then the
// streamed kernel on its codes.
#define STREAM_QROWS_MAX 4096
#define QROWS_SCALES 2048
#define QROWS_RED 2304   // u32 [8 rows][16 warps] maxima, then the same of bad flags
#define QROWS_SDEC 3328  // float [8] S_dec, then [8] S_enc / 6, then [8] decode scales
#define QROWS_BAR 3424   // the mbarrier
#define STREAM_QROWS_BYTES 3440  // w4a4_gemm_cuda.py
// The streamed kernel on weights of at least STREAM_MANY_UNITS units per CTA (`many_units`): its
// arrivals by CTA part, counted in a ring of STREAM_PART_SLOTS shared-memory counters
// (w4a4_gemm_cuda.py), and at M <= STREAM_LIVE_M its live-column partials.
#define STREAM_MANY_UNITS 8
#define STREAM_PART_SLOTS 32
static_assert(QROWS_SCALES == STREAM_QROWS_MAX / 2 &&
                  QROWS_RED == QROWS_SCALES + STREAM_QROWS_MAX / 16,
              "codes and scale bytes of STREAM_QROWS_MAX elements");
static_assert(QROWS_BAR % 8 == 0 && QROWS_BAR + 8 <= STREAM_QROWS_BYTES, "the area's barrier");

// A producer thread's share of one unit's activation slice: (row, chunk, code-word pair) items
// tid + 128 j, their words and scale bytes (zeros past M and K).
template <int BM>
struct StreamAct {
  static constexpr int PER = BM * FOLD_CHUNKS * 8 / 128;
  uint2 w[PER];
  u32 s[PER];
};

template <int BM>
__device__ __forceinline__ void stream_load_act(const Params& p, int u, int n_folds, int k_chunks,
                                                int tid, StreamAct<BM>& act) {
  const int f = u % n_folds, n_ch = min(FOLD_CHUNKS, k_chunks - f * FOLD_CHUNKS);
#pragma unroll
  for (int j = 0; j < StreamAct<BM>::PER; ++j) {
    const int id = tid + 128 * j, tp = id & 7, rc = id >> 3, r = rc % BM, c = rc / BM;
    act.w[j] = make_uint2(0, 0);
    act.s[j] = 0;
    if (r < p.M && c < n_ch) {
      act.w[j] = __ldg((const uint2*)(p.a_words + r * p.stride_aw + (f * 4 + c) * 16 + 2 * tp));
      act.s[j] = __ldg(p.a_scales + r * p.stride_as + (f * 4 + c) * 8 + tp);
    }
  }
}

// stream_load_act's items from the rows variant's codes in shared memory (`area`; the same
// loop as stream_load_act's, written twice: one function for both spaces compiled the streamed
// kernels' loops into other schedules).
template <int BM>
__device__ __forceinline__ void stream_rows_act(const Params& p, const unsigned char* area, int u,
                                                int n_folds, int k_chunks, int tid,
                                                StreamAct<BM>& act) {
  const u32* codes = (const u32*)area;
  const unsigned char* scl = area + QROWS_SCALES;
  const int f = u % n_folds, n_ch = min(FOLD_CHUNKS, k_chunks - f * FOLD_CHUNKS);
#pragma unroll
  for (int j = 0; j < StreamAct<BM>::PER; ++j) {
    const int id = tid + 128 * j, tp = id & 7, rc = id >> 3, r = rc % BM, c = rc / BM;
    act.w[j] = make_uint2(0, 0);
    act.s[j] = 0;
    if (r < p.M && c < n_ch) {
      act.w[j] = *(const uint2*)(codes + r * (p.K / 8) + (f * 4 + c) * 16 + 2 * tp);
      act.s[j] = scl[r * (p.K / 16) + (f * 4 + c) * 8 + tp];
    }
  }
}

// The weight of unit u into the stage at `stage` by 16-byte cp.async copies from the canonical
// rows (sixteen threads per 256-byte row of codes: coalesced), completing on barrier `full` (one
// arrival per thread). Rows past N and chunks past K are not copied.
template <int BM>
__device__ __forceinline__ void stream_copy_canonical(const Params& p, int u, int n_folds,
                                                      int k_chunks, u32 stage, u32 full, int tid) {
  using S = StreamShape<BM, false>;
  const unsigned char* w_codes = (const unsigned char*)p.w_words;
  const long long w_row = p.stride_ww * 4;
  const int n0 = (u / n_folds) * ROWS, f = u % n_folds;
  const int n_ch = min(FOLD_CHUNKS, k_chunks - f * FOLD_CHUNKS);
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // weight codes: 64 rows x 16 granules
    const int id = tid + 128 * j, r = id >> 4, col = (id & 15) * 16;
    if (n0 + r < p.N && col < n_ch * 64)
      cp_async16(stage + r * S::W_STRIDE + col, w_codes + (n0 + r) * w_row + f * 256 + col);
  }
  {  // weight scales: 64 rows x 2 granules
    const int r = tid >> 1, col = (tid & 1) * 16;
    if (n0 + r < p.N && col < n_ch * 8)
      cp_async16(stage + S::W_CODES + r * 32 + col,
                 p.w_scales + (n0 + r) * p.stride_ws + f * 32 + col);
  }
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
}

// The weight of unit u into the stage at `stage` from the unit layout (p.w_words: 18 KB per unit,
// units tile-major): two bulk copies of its chunks' codes and scales (the chunks inside K, a
// prefix of each part), announced on barrier `full` by one arrival. One thread. IMAGE: a third,
// the unit's activation block from the decoded image (p.a_image, one M tile of BM rows made by
// w4a4_quantize_act_m##BM: chunk c at c * BM * 256 bytes, the stage's B layout) into the stage's
// B block.
template <int BM, bool IMAGE>
__device__ __forceinline__ void unit_copy(const Params& p, int u, int n_folds, int k_chunks,
                                          u32 stage, u32 full) {
  using S = StreamShape<BM, true>;
  const int f = u % n_folds, n_ch = min(FOLD_CHUNKS, k_chunks - f * FOLD_CHUNKS);
  const unsigned char* src = (const unsigned char*)p.w_words + (long long)u * 18432;
  mbar_expect_tx(full, n_ch * (4608 + (IMAGE ? BM * 256 : 0)));
  bulk_copy_once(stage, src, n_ch * 4096, full);
  bulk_copy_once(stage + S::W_CODES, src + S::W_CODES, n_ch * 512, full);
  if (IMAGE)
    bulk_copy(stage + S::W_CODES + S::W_SCALES,
              p.a_image + (long long)f * FOLD_CHUNKS * (BM * 256), n_ch * BM * 256, full);
}

template <int NWG>
__device__ __forceinline__ void stream_quantize_rows(const Params& p, unsigned char* area,
                                                     int ctid) {
  constexpr int NT = 128 * NWG;
  u32* codes = (u32*)area;
  unsigned char* scl = area + QROWS_SCALES;
  u32* red_big = (u32*)(area + QROWS_RED);
  u32* red_bad = red_big + 8 * 16;
  float* s_dec = (float*)(area + QROWS_SDEC);
  float* enc6 = s_dec + 8;
  float* a_dec = s_dec + 16;
  const int blocks = p.K / 16, lane = ctid & 31, warp = ctid >> 5;
  // pass 1: each row's largest finite magnitude, per warp
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    if (r < p.M) {
      u32 big, bad;
      warp_row_max((const uint4*)(p.a_words + (long long)r * p.stride_aw), blocks, ctid, NT, true,
                   big, bad);
      if (lane == 0) {
        red_big[r * 16 + warp] = big;
        red_bad[r * 16 + warp] = bad;
      }
    }
  }
  asm volatile("bar.sync 8, %0;" ::"n"(NT) : "memory");
  if (ctid < p.M) {  // the row's scales
    u32 big = 0, bad = 0;
    for (int w = 0; w < NT / 32; ++w) {
      big = max(big, red_big[ctid * 16 + w]);
      bad |= red_bad[ctid * 16 + w];
    }
    s_dec[ctid] = row_scales(big, enc6[ctid]);
    a_dec[ctid] = bad ? __int_as_float(0x7FC00000) : s_dec[ctid];
  }
  asm volatile("bar.sync 8, %0;" ::"n"(NT) : "memory");
  // pass 2: every block's code words and scale byte
  for (int i = ctid; i < p.M * blocks; i += NT) {
    const int r = i / blocks, b = i - r * blocks;
    const uint4* x = (const uint4*)(p.a_words + (long long)r * p.stride_aw);
    const uint4 v[2] = {x[2 * b], x[2 * b + 1]};
    u32 cw[2];
    const u32 sb = quantize_block(v, s_dec[r], enc6[r], cw);
    *(uint2*)(codes + r * (p.K / 8) + 2 * b) = make_uint2(cw[0], cw[1]);
    scl[r * blocks + b] = (unsigned char)sb;
  }
}

// The producer warpgroup: unit i of this CTA into stage i % STAGES. The weight by 16-byte cp.async
// copies (sixteen threads per 256-byte row of codes: coalesced) that complete on the stage's full
// barrier (one arrival per thread); the activation slice read (two units ahead) and decoded into
// the stage's B block by the same threads (a second arrival each). Rows past N are not copied and
// activation rows past M not written (they only feed outputs that are never stored), nor chunks
// past K. IMAGE (unit layout): one thread's bulk copies of the weight and the image's block.
template <int BM, bool UNIT, bool IMAGE, bool QUANT>
__device__ __forceinline__ void stream_produce(const Params& p, unsigned char* smem, u32 base,
                                               u32 bars, int u0, int u1, int n_folds,
                                               int k_chunks, int tid) {
  using S = StreamShape<BM, UNIT>;
  [[maybe_unused]] const unsigned char* rows_area =
      smem + S::STAGES * S::STAGE + 16 * S::STAGES + 16;  // QUANT
  const unsigned char* w_codes = (const unsigned char*)p.w_words;
  const long long w_row = p.stride_ww * 4;
  // pull the first unit's weight into L2 before waiting: a prefetch, since L2 is where global
  // memory is coherent it cannot make a later copy stale even if the previous kernel wrote the
  // weight (a kernel-layout refresh does), where reading it into shared memory before the wait
  // could; only the first unit: every SM prefetching all its stages at once, 17 MB on N = K =
  // 8192, delayed each SM's first stage from 1.8 to 3.8 us on the H200
  if (UNIT) {
    if (tid == 0 && u0 < u1)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                       (const unsigned char*)p.w_words + (long long)u0 * 18432),
                   "r"(18432)
                   : "memory");
  } else if (u0 < u1) {
    const int n0 = (u0 / n_folds) * ROWS, f = u0 % n_folds, r = tid >> 1;
    if (n0 + r < p.N)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(w_codes + (n0 + r) * w_row + f * 256 +
                                                    (tid & 1) * 128));
  }
  wait_previous_kernel();
  if constexpr (IMAGE) {  // the activation block from the image (the previous kernel's output)
    for (int i = 0; u0 + i < u1; ++i) {
      const int s = i % S::STAGES, round = i / S::STAGES;
      if (round > 0) mbar_wait(bars + 8 * (S::STAGES + s), (round - 1) & 1);
      if (tid == 0)
        unit_copy<BM, true>(p, u0 + i, n_folds, k_chunks, base + s * S::STAGE, bars + 8 * s);
    }
    return;
  }
  StreamAct<BM> ahead[2];
  if constexpr (QUANT) {  // the first round's weight, then the consumers' codes of the rows
    static_assert(UNIT && !IMAGE, "the rows variant reads the unit layout");
    if (tid == 0)
      for (int i = 0; i < S::STAGES && u0 + i < u1; ++i)
        unit_copy<BM, false>(p, u0 + i, n_folds, k_chunks, base + i * S::STAGE, bars + 8 * i);
    mbar_wait(base + (u32)(rows_area - smem) + QROWS_BAR, 0);
  } else {
    if (u0 < u1) stream_load_act<BM>(p, u0, n_folds, k_chunks, tid, ahead[0]);
    if (u0 + 1 < u1) stream_load_act<BM>(p, u0 + 1, n_folds, k_chunks, tid, ahead[1]);
  }
  for (int i = 0; u0 + i < u1; ++i) {
    const int u = u0 + i, s = i % S::STAGES, round = i / S::STAGES;
    const u32 full = bars + 8 * s, empty = bars + 8 * (S::STAGES + s);
    const u32 stage = base + s * S::STAGE;
    const int n_ch = min(FOLD_CHUNKS, k_chunks - (u % n_folds) * FOLD_CHUNKS);
    if (round > 0) mbar_wait(empty, (round - 1) & 1);
    if (UNIT) {
      if (tid == 0 && !(QUANT && round == 0)) unit_copy<BM, false>(p, u, n_folds, k_chunks, stage, full);
    } else {
      stream_copy_canonical<BM>(p, u, n_folds, k_chunks, stage, full, tid);
    }
    StreamAct<BM> cur;
    if constexpr (QUANT) {
      stream_rows_act<BM>(p, rows_area, u, n_folds, k_chunks, tid, cur);
    } else {
      cur = ahead[0];
      ahead[0] = ahead[1];
      if (u + 2 < u1) stream_load_act<BM>(p, u + 2, n_folds, k_chunks, tid, ahead[1]);
    }
    unsigned char* bdst = smem + s * S::STAGE + S::W_CODES + S::W_SCALES;
#pragma unroll
    for (int j = 0; j < StreamAct<BM>::PER; ++j) {
      const int id = tid + 128 * j, tp = id & 7, rc = id >> 3, r = rc % BM, c = rc / BM;
      if (r < p.M && c < n_ch) {
        u32 o[8];
        decode_pair(cur.w[j].x, cur.w[j].y, cur.s[j], o);
        store_b_pair<BM>(bdst + c * 8 * (BM * 32), r, tp, LBO_BYTES, SBO_BYTES, o);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // for the consumers' wgmma
    mbar_arrive(full);
  }
}

// A consumer warpgroup's unit: the fold chunk's chain, the weight decoded from the stage into
// register fragments; chunk c + 1 is decoded while chunk c's chain runs (one chain in flight).
template <int BM, bool UNIT>
__device__ __forceinline__ void stream_unit(const unsigned char* stage, u32 stage_addr, int n_ch,
                                            int tid, Acc<BM>& part) {
  using S = StreamShape<BM, UNIT>;
  const int lane = tid & 31, warp = tid >> 5;
  const int r0 = 16 * warp + (lane >> 2), t = lane & 3;
  const u64 desc0 = smem_desc(stage_addr + S::W_CODES + S::W_SCALES, LBO_BYTES, SBO_BYTES);
  Raw raw;
  u32 a[2][8][4];
  if (UNIT)
    unit_raw(stage, 0, warp, lane, raw);
  else
    stream_raw(stage, r0, 0, t, raw);
  decode_raw<UNIT>(raw, a[0]);
#pragma unroll
  for (int c = 0; c < FOLD_CHUNKS; ++c) {
    if (c < n_ch) {
      issue_chunk<BM>(part, a[c & 1], desc0 + (u64)(c * 8 * BM * 2), c == 0);
      if (c + 1 < n_ch) {
        if (UNIT)
          unit_raw(stage, c + 1, warp, lane, raw);
        else
          stream_raw(stage, r0, c + 1, t, raw);
        decode_raw<UNIT>(raw, a[(c + 1) & 1]);
      }
      wgmma_wait<0>();
    }
  }
  fence_acc(part);
}

// A unit's workspace slot holds its 64 x BM partial in one of two layouts. At M <= STREAM_LIVE_M
// (BM = 8) with at least STREAM_MANY_UNITS units per CTA, column-major: element i of a consumer
// thread at batch column r = 8 (i / 4) + 2 t + (i % 2), then the 64 weight rows, so the columns
// inside M are a prefix (M x 256 bytes; only those are stored and folded, a warp's eight rows g
// of one column in one 32-byte sector). Otherwise by 16-byte piece: a thread's piece e (elements
// 4e .. 4e + 3) at (e x 128 + thread) x 16 bytes, so that a warp's 16-byte stores and loads cover
// whole 32-byte sectors (512 contiguous bytes), at BM = 16 too. H100, same run: column-major
// 1.04-1.06x at M = 1-2 on 8192^2, 4096 x 12288 and 28672 x 4096 (11-27 units per CTA),
// 0.97-0.98x at M = 1 on 5120 x 2048 and 2048 x 4096 (2-3 units per CTA, where the wider fold's
// instructions sit on the short kernel's tail), no gain at M = 4 (benchmarks/RESULTS.md).
#define STREAM_LIVE_M 2
template <int BM>
__device__ __forceinline__ bool live_columns(const Params& p, bool many_units) {
  return BM == 8 && p.M <= STREAM_LIVE_M && many_units;
}
__device__ __forceinline__ int partial_column(int i, int t) { return 8 * (i >> 2) + 2 * t + (i & 1); }
__device__ __forceinline__ int partial_slot(int i, int warp, int g, int t) {
  return partial_column(i, t) * ROWS + 16 * warp + g + ((i & 2) ? 8 : 0);
}
// By piece: unit u's piece e of consumer thread tid, in float4s from p.partials (a unit holds
// 128 threads x BM / 8 pieces).
template <int BM>
__device__ __forceinline__ long long partial_piece(long long u, int e, int tid) {
  return u * 16 * BM + 128 * e + tid;
}

// Fold tile `tile`'s partials in chunk order and store its outputs (the warpgroup that completed
// the tile's arrivals): R partials in flight, then added in order. `live`: column-major slots,
// only the columns inside M, 16 in flight (one round up to K = 8192); else by piece, 4.
template <int BM>
__device__ __forceinline__ void stream_fold(const Params& p, int tile, int n_folds, bool live,
                                            int tid, const float* a_dec) {
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  Acc<BM> acc;
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) acc.d[i] = 0.f;
  if (!live) {
    // this thread's first piece of the tile's first unit
    const float4* col =
        (const float4*)p.partials + partial_piece<BM>((long long)tile * n_folds, 0, tid);
    for (int f0 = 0; f0 < n_folds; f0 += 4) {
      float v[4][BM / 2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (f0 + j < n_folds) {
#pragma unroll
          for (int e = 0; e < BM / 8; ++e) {
            const float4 x = __ldcg(col + partial_piece<BM>(f0 + j, e, 0));
            v[j][4 * e] = x.x; v[j][4 * e + 1] = x.y; v[j][4 * e + 2] = x.z; v[j][4 * e + 3] = x.w;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (f0 + j < n_folds) {
#pragma unroll
          for (int e = 0; e < BM / 2; ++e) acc.d[e] = __fadd_rn(acc.d[e], v[j][e]);
        }
      }
    }
    store_out<BM>(p, acc, tile * ROWS + 16 * warp, 0, g, t, 0, BM, a_dec);
    return;
  }
  constexpr int R = 16;
  const float* tile_parts = p.partials + (long long)tile * n_folds * ROWS * BM;
  for (int f0 = 0; f0 < n_folds; f0 += R) {
    float v[R][BM / 2];
#pragma unroll
    for (int j = 0; j < R; ++j) {
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) {
        v[j][i] = 0.f;
        if (f0 + j < n_folds && partial_column(i, t) < p.M)
          v[j][i] = __ldcg(tile_parts + (long long)(f0 + j) * ROWS * BM + partial_slot(i, warp, g, t));
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (f0 + j < n_folds) {
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) acc.d[i] = __fadd_rn(acc.d[i], v[j][i]);
      }
    }
  }
  store_out<BM>(p, acc, tile * ROWS + 16 * warp, 0, g, t, 0, BM, a_dec);
}

template <int BM, int NWG, bool UNIT, bool IMAGE = false, bool QUANT = false>
__device__ __forceinline__ void gemm_stream(const Params& p) {
  using S = StreamShape<BM, UNIT>;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const u32 bars = base + S::STAGES * S::STAGE;  // full[STAGES], then empty[STAGES]
  int* last = (int*)(smem + S::STAGES * S::STAGE + 16 * S::STAGES);
  unsigned char* rows_area = smem + S::STAGES * S::STAGE + 16 * S::STAGES + 16;  // QUANT
  // per CTA part of a tile (a ring: parts in flight span at most the stages and the warpgroups'
  // units), its units counted so far
  int* part_counts = (int*)(rows_area + (QUANT ? STREAM_QROWS_BYTES : 0));
  static_assert(S::STAGES % NWG == 0, "one consumer warpgroup per stage (StreamShape)");
  const int n_folds = (p.K + 511) / 512, k_chunks = p.K / 128;
  const int units = ((p.N + ROWS - 1) / ROWS) * n_folds;
  const int u0 = (int)((long long)blockIdx.x * units / gridDim.x);
  const int u1 = (int)((long long)(blockIdx.x + 1) * units / gridDim.x);
  // warp-uniform for the compiler (see gemm_ws)
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0), tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::STAGES; ++s) {
      // each producer thread: its copies (canonical) and its stores; unit layout: the stores and
      // the bulk copies' announcement
      mbar_init(bars + 8 * s, IMAGE ? 1 : UNIT ? 129 : 256);
      mbar_init(bars + 8 * (S::STAGES + s), 128);  // the consuming warpgroup
    }
    if (QUANT) mbar_init(base + (u32)(rows_area - smem) + QROWS_BAR, 128 * NWG);  // the consumers
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < STREAM_PART_SLOTS) part_counts[threadIdx.x] = 0;
  __syncthreads();
  if (wg == NWG) {
    stream_produce<BM, UNIT, IMAGE, QUANT>(p, smem, base, bars, u0, u1, n_folds, k_chunks, tid);
    return;
  }
  wait_previous_kernel();
  const float* own_dec = nullptr;  // QUANT: the rows' decode scales, made here
  if constexpr (QUANT) {
    stream_quantize_rows<NWG>(p, rows_area, threadIdx.x);
    mbar_arrive(base + (u32)(rows_area - smem) + QROWS_BAR);
    own_dec = (const float*)(rows_area + QROWS_SDEC) + 16;
  }
  PHASE_TIME(0);
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  int run = 0;  // this warpgroup's units of the current tile whose arrival is not yet counted
  const bool by_part = units >= STREAM_MANY_UNITS * (int)gridDim.x;  // the arrivals
  const bool live = live_columns<BM>(p, by_part);  // the workspace slots' layout
  for (int i = wg; u0 + i < u1; i += NWG) {
    const int u = u0 + i, s = i % S::STAGES;
    const int tile = u / n_folds;
    const int n_ch = min(FOLD_CHUNKS, k_chunks - (u % n_folds) * FOLD_CHUNKS);
    mbar_wait(bars + 8 * s, (i / S::STAGES) & 1);
    if (i == wg) PHASE_TIME(1);
    Acc<BM> part;
#pragma unroll
    for (int e = 0; e < BM / 2; ++e) part.d[e] = 0.f;
    stream_unit<BM, UNIT>(smem + s * S::STAGE, base + s * S::STAGE, n_ch, tid, part);
    if (u + NWG >= u1) PHASE_TIME(2);
    mbar_arrive(bars + 8 * (S::STAGES + s));  // every read of the stage is done
    if (n_folds == 1) {  // the fold of one chunk: 0 + p_0 (a -0 partial becomes +0)
#pragma unroll
      for (int e = 0; e < BM / 2; ++e) part.d[e] = __fadd_rn(0.f, part.d[e]);
      store_out<BM>(p, part, tile * ROWS + 16 * warp, 0, g, t, 0, BM, own_dec);
      continue;
    }
    if (live) {
      float* mine = p.partials + (long long)u * ROWS * BM;
#pragma unroll
      for (int i = 0; i < BM / 2; ++i)
        if (partial_column(i, t) < p.M) __stcg(mine + partial_slot(i, warp, g, t), part.d[i]);
    } else {
      float4* parts = (float4*)p.partials;
#pragma unroll
      for (int e = 0; e < BM / 8; ++e)
        parts[partial_piece<BM>(u, e, tid)] = make_float4(part.d[4 * e], part.d[4 * e + 1], part.d[4 * e + 2], part.d[4 * e + 3]);
    }
    ++run;
    const int next = u + NWG;
    if (next < u1 && next / n_folds == tile) continue;
    // leaving the tile (the barrier orders the warpgroup's partial stores before thread 0's
    // arrival). Large weights (`by_part`): count this warpgroup's units of the CTA's part of the
    // tile in shared memory; the warpgroup completing the part arrives for the whole of it: a tile
    // inside the CTA needs no GPU-scope arrival; a part the tile continues past (the CTA's last
    // units, whose next CTA did that tile's units first) reads the tile's counter (acquire) and
    // if every other part is in, folds with no fence or atomic; else the fence makes the part's
    // stores visible GPU-wide before its units are added, and the last arrival folds. Small
    // weights: each warpgroup arrives for its own units.
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
    if (tid == 0) {
      const int t0 = tile * n_folds, part = min(u1, t0 + n_folds) - max(u0, t0);
      int arriving = run;
      bool done = true;
      if (by_part) {
        int* count = part_counts + (tile - u0 / n_folds) % STREAM_PART_SLOTS;
        __threadfence_block();
        done = atomicAdd(count, run) + run == part;
        arriving = done && part != n_folds ? part : 0;
        if (done) {
          __threadfence_block();  // acquire: the part's other partial stores
          *count = 0;
        }
        if (arriving && t0 + n_folds > u1) {
          int others;
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];"
                       : "=r"(others)
                       : "l"(p.counters + tile)
                       : "memory");
          if (others == n_folds - part) arriving = 0;
        }
      }
      if (arriving) {
        __threadfence();
        done = atomicAdd(p.counters + tile, arriving) + arriving == n_folds;
        if (done) __threadfence();  // acquire: the other partials before the fold's loads
      }
      last[wg] = done;
    }
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
    run = 0;
    if (!last[wg]) continue;
    stream_fold<BM>(p, tile, n_folds, live, tid, own_dec);
    if (tid == 0) p.counters[tile] = 0;
  }
  PHASE_TIME(3);
}

#define STREAM_KERNEL(BM, NWG)                                                               \
  extern "C" __global__ void __launch_bounds__(128 * (NWG + 1), 1)                           \
      w4a4_stream_m##BM##_w##NWG(const Params p) {                                           \
    gemm_stream<BM, NWG, false>(p);                                                          \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(128 * (NWG + 1), 1)                           \
      w4a4_stream_unit_m##BM##_w##NWG(const Params p) {                                      \
    gemm_stream<BM, NWG, true>(p);                                                           \
  }
STREAM_KERNEL(8, 2)
STREAM_KERNEL(8, 3)
STREAM_KERNEL(16, 2)
STREAM_KERNEL(16, 3)
#define STREAM_IMAGE_KERNEL(BM, NWG)                                                         \
  extern "C" __global__ void __launch_bounds__(128 * (NWG + 1), 1)                           \
      w4a4_stream_image_m##BM##_w##NWG(const Params p) {                                     \
    gemm_stream<BM, NWG, true, true>(p);                                                     \
  }
STREAM_IMAGE_KERNEL(16, 2)  // 8 < M <= 16 only: at M <= 8 it measured slower (w4a4_gemm_cuda.py)
STREAM_IMAGE_KERNEL(16, 3)
#define STREAM_ROWS_KERNEL(BM, NWG)                                                          \
  extern "C" __global__ void __launch_bounds__(128 * (NWG + 1), 1)                           \
      w4a4_stream_rows_m##BM##_w##NWG(const Params p) {                                      \
    gemm_stream<BM, NWG, true, false, true>(p);                                              \
  }
STREAM_ROWS_KERNEL(8, 2)  // M <= 8, M x K <= STREAM_QROWS_MAX: the rows quantized in the kernel
STREAM_ROWS_KERNEL(8, 3)

// ---- Wide M, register A: consumers decode the staged weight codes into wgmma fragments ----
//
// Same K order and fold as above. A CTA computes 128 weight rows x BN batch rows over a range of
// fold chunks (split z of gridDim.z: fold chunks [z F / S, (z + 1) F / S)). A producer warpgroup
// fills a STAGES-deep ring, one 128-element chunk per stage: the codes and scales of the 128 rows
// (16-byte cp.async, four threads per row: coalesced; rows 96 bytes apart, conflict-free for the
// consumers' 8-byte reads) and the chunk's block of the decoded activation image (one bulk copy).
// Two consumer warpgroups, 64 weight rows each, decode their rows' codes from the stage into
// register A fragments (chunk j + 1 while chains j - 1 and j run) and run m64 nBN k16 chains
// against the shared activation block: the activation's shared-memory bytes are read once per
// 128 rows, and the weight crosses shared memory as 4-bit codes. Split K (small grids): split 0
// keeps its fold-chunk prefix, the others each fold chunk's partial, in a global workspace; the
// tile's last CTA folds them in chunk order (the tile counter as in the streamed kernel).
// EVEN = false (any K % 16 == 0, rows of codes 8-byte aligned): K's last chunk of codes copied
// with zero fill past K (in 8-byte blocks where rows are not 16-byte aligned), the scales read
// from rows of whole chunks zero-padded past K (written by the activation pass before, see
// pad_weight_scales: four-byte copies from unaligned rows in the producer measured 1.3-1.45x
// the kernel's time), so the blocks past K are zeros, as the other kernels make them: the same
// bits.

#define WR_ROWS 128   // weight rows per CTA (two consumer warpgroups)
#define WR_STRIDE 96  // bytes per weight row of a stage: 64 of codes, 8 of scales, padding

// CL = 1: split K over gridDim.z with a global workspace (above). CL = 2: the two CTAs of a
// thread-block cluster share a tile, CTA z taking the fold chunks f with f % 2 == z; the second
// hands each fold chunk's partial to the first (a bulk copy per warp between the CTAs' shared
// memories, SLOTS slots), which folds it in chunk order between its own: no workspace, no
// counter, the fold overlapped. (Remote stores from the threads instead measured 2-3x the
// hand-over's cost: each warp waited for the cluster network, H200, 2026-12-04.)
template <int BN, int CL>
struct WideShape {
  static constexpr int W_BYTES = WR_ROWS * WR_STRIDE;
  static constexpr int A_BYTES = BN * 256;
  static constexpr int STAGE = W_BYTES + A_BYTES;
  static constexpr int SLOT_BYTES = BN * 512;  // 256 consumer threads x BN / 2 floats
  static constexpr int PIECE_BYTES = SLOT_BYTES / 8;  // a consumer warp's share, [e][lane]
  static constexpr int SLOTS = CL == 1 ? 0 : (BN >= 128 ? 1 : 2);
  static constexpr int RING_BYTES = CL == 1 ? 204800 : 225280 - SLOTS * SLOT_BYTES;
  static constexpr int STAGES = RING_BYTES / STAGE < 8 ? RING_BYTES / STAGE : 8;  // w4a4_gemm_cuda.py
  // after the stages: full[STAGES], empty[STAGES], a flag (16 bytes), slot full[SLOTS] and
  // empty[SLOTS] barriers (16 bytes each pair), then the slots
  static constexpr int BARS = STAGES * STAGE;
  static constexpr int SLOT_BARS = BARS + 16 * STAGES + 16;
  static constexpr int SLOTS_AT = SLOT_BARS + 16 * SLOTS;
  // stream-K (CL = 1): an output tile of its own, as the ring keeps running across tiles (half
  // the tile's raw sums at a time, BN / 2 rows of 528 bytes: wide_store)
  static constexpr int OUT_AT = SLOTS_AT + SLOTS * SLOT_BYTES;
  static constexpr int OUT_BYTES = BN * (128 * 2 + 16);
  static_assert(BN / 2 * 528 + BN * 4 <= OUT_BYTES, "wide_store's half tile and scales");
};

__device__ __forceinline__ void wgmma(Acc<128>& c, const u32 (&a)[4], u64 desc, int accumulate) {
  asm volatile(WGMMA_HEAD(69) "128k16.f32.bf16.bf16 {"
               ACC128_REGS
               "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
               : ACC128_OUT(c)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

// A consumer thread's weight data of one stage: rows r0 and r0 + 8 of the stage (the layout
// load_raw reads from global).
__device__ __forceinline__ void wide_raw(const unsigned char* stage, int r0, int t, Raw& r) {
  const unsigned char* w0 = stage + r0 * WR_STRIDE + 8 * t;
  const unsigned char* w1 = w0 + 8 * WR_STRIDE;
  const uint2 a = *(const uint2*)w0, b = *(const uint2*)w1;
  const uint2 c = *(const uint2*)(w0 + 32), d = *(const uint2*)(w1 + 32);
  r.w[0] = a.x; r.w[1] = a.y; r.w[2] = b.x; r.w[3] = b.y;
  r.w[4] = c.x; r.w[5] = c.y; r.w[6] = d.x; r.w[7] = d.y;
  const unsigned char* s0 = stage + r0 * WR_STRIDE + 64 + t;
  r.s[0] = s0[0];
  r.s[1] = s0[8 * WR_STRIDE];
  r.s[2] = s0[4];
  r.s[3] = s0[8 * WR_STRIDE + 4];
}

// A CTA's chunks: its fold chunks f_begin, f_begin + f_step, ... (< n_folds), each's 128-element
// chunks in order; the i-th is chunk ((i / 4) f_step + f_begin) 4 + i % 4 (every fold chunk but
// K's last has four).
struct WideSeq {
  int f_begin, f_step, n;  // n: chunks in the sequence
  bool keep;               // fold partials add into the CTA's running sum (else the workspace)
  __device__ __forceinline__ WideSeq(int f_begin_, int f_end, int f_step_, int k_chunks)
      : f_begin(f_begin_), f_step(f_step_), keep(f_begin_ == 0) {
    const int folds = f_end > f_begin ? (f_end - f_begin + f_step - 1) / f_step : 0;
    const int last = f_begin + (folds - 1) * f_step;
    n = folds ? (folds - 1) * FOLD_CHUNKS + min(FOLD_CHUNKS, k_chunks - last * FOLD_CHUNKS) : 0;
  }
  __device__ __forceinline__ int fold(int i) const { return (i >> 2) * f_step + f_begin; }
  __device__ __forceinline__ int chunk(int i) const { return fold(i) * FOLD_CHUNKS + (i & 3); }
};

// The codes of chunk j of 128 rows from n0 with zeros past K (K's last chunk, or rows of codes
// only 8-byte aligned: then in 8-byte blocks, thread tid taking block tid % 8 of rows tid / 8 +
// 16 c). Not inlined: the common path keeps its registers (the producer has 56).
__device__ __noinline__ void wide_codes_zfill(u32 stage, const unsigned char* w_codes,
                                              long long w_row, int n0, int N, int j,
                                              int row_bytes, int tid, bool codes16) {
  if (codes16) {
    const int r = tid >> 2, col = (tid & 3) * 16;
    const int valid = min(max(row_bytes - (j * 64 + col), 0), 16);
    const unsigned char* src = w_codes + (n0 + r) * w_row + (valid ? j * 64 + col : 0);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (n0 + r + 32 * c < N)
        cp_async_zfill<16>(stage + (r + 32 * c) * WR_STRIDE + col, src + 32 * c * w_row, valid);
    return;
  }
  const int r = tid >> 3, col = (tid & 7) * 8, valid = j * 64 + col < row_bytes ? 8 : 0;
  const unsigned char* src = w_codes + (n0 + r) * w_row + (valid ? j * 64 + col : 0);
#pragma unroll
  for (int c = 0; c < 8; ++c)
    if (n0 + r + 16 * c < N)
      cp_async_zfill<8>(stage + (r + 16 * c) * WR_STRIDE + col, src + 16 * c * w_row, valid);
}

// The producer warpgroup: chunk q.chunk(i) of weight rows from n0 and batch tile bx into stage
// (o + i) % STAGES (o: the ring's position, where a CTA runs several tiles). Rows past N are not
// copied (they only feed outputs that are never stored). The first sequence (`first`) pulls its
// first chunks into L2 and then waits for the previous kernel.
template <int BN, int CL, bool EVEN>
__device__ __forceinline__ void wide_produce(const Params& p, u32 base, u32 bars, int n0, int bx,
                                             const WideSeq& q, int o, bool first, int tid) {
  using S = WideShape<BN, CL>;
  const unsigned char* w_codes = (const unsigned char*)p.w_words;
  const long long w_row = p.stride_ww * 4;
  const int row_bytes = p.K / 2;
  // rows of codes 16-byte aligned (always where EVEN), else copied in 8-byte blocks
  const bool codes16 = EVEN || (w_row % 16 == 0 && (unsigned long long)w_codes % 16 == 0);
  if (first) {  // the weight is no previous kernel's output: the first chunks into L2 meanwhile
    for (int i = 0; i < 4; ++i) {
      const int id = tid + 128 * i, r = id >> 2, col = (id & 3) * 16;
      if (n0 + r < p.N && q.n > 0 && (EVEN || q.chunk(0) * 64 + col < row_bytes))
        asm volatile("prefetch.global.L2 [%0];" ::"l"(w_codes + (n0 + r) * w_row +
                                                      q.chunk(0) * 64 + col));
    }
    wait_previous_kernel();
  }
  for (int i = 0; i < q.n; ++i) {
    const int j = q.chunk(i), s = (o + i) % S::STAGES, round = (o + i) / S::STAGES;
    const u32 full = bars + 8 * s, empty = bars + 8 * (S::STAGES + s);
    const u32 stage = base + s * S::STAGE;
    if (round > 0) mbar_wait(empty, (round - 1) & 1);
    if (tid == 0) {
      mbar_expect_tx(full, S::A_BYTES);
      const unsigned char* src = p.a_image + ((long long)bx * p.a_chunks + j) * S::A_BYTES;
      bulk_copy(stage + S::W_BYTES, src, S::A_BYTES, full);
    }
    if (EVEN || (codes16 && j * 64 + 64 <= row_bytes)) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // codes: 128 rows x 4 granules
        const int id = tid + 128 * c, r = id >> 2, col = (id & 3) * 16;
        if (n0 + r < p.N)
          cp_async16(stage + r * WR_STRIDE + col, w_codes + (n0 + r) * w_row + j * 64 + col);
      }
    } else {
      wide_codes_zfill(stage, w_codes, w_row, n0, p.N, j, row_bytes, tid, codes16);
    }
    if (n0 + tid < p.N)  // scales: 8 bytes per row (rows of whole chunks, zeros past K)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(stage + tid * WR_STRIDE + 64),
                   "l"(p.w_scales + (n0 + tid) * p.stride_ws + j * 8)
                   : "memory");
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
    if (i + 8 < q.n) {  // keep the weight streaming into L2 ahead of the ring
      const int r = tid >> 2, col = (tid & 3) * 16, ahead = q.chunk(i + 8);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (n0 + r + 32 * c < p.N && (EVEN || ahead * 64 + col < row_bytes))
          asm volatile("prefetch.global.L2 [%0];" ::"l"(w_codes + (n0 + r + 32 * c) * w_row +
                                                        ahead * 64 + col));
    }
  }
}

// Cluster helpers (CL = 2): an address in a cluster CTA's shared memory, an arrival on a barrier
// there, a barrier of all the cluster's threads.
__device__ __forceinline__ u32 cluster_addr(u32 local, u32 rank) {
  u32 remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ void mbar_arrive_remote(u32 cluster_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_bar) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}
__device__ __forceinline__ u32 cluster_ctas() {
  u32 n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// The second CTA of a cluster pair hands its k-th partial (fold chunk 2k + 1) to the first: each
// consumer warp stores its piece into its own slot k % SLOTS (once the first has read that slot's
// previous partial, whose copy from here is then done too) and copies it with one bulk copy into
// the same place of the first's slot, completing its bytes on the first's full barrier.
template <int BN>
__device__ __forceinline__ void wide_hand_over(u32 base, int k, int ctid, const Acc<BN>& part) {
  using S = WideShape<BN, 2>;
  const int slot = k % S::SLOTS;
  const u32 piece = base + S::SLOTS_AT + slot * S::SLOT_BYTES + (ctid >> 5) * S::PIECE_BYTES;
  mbar_wait(base + S::SLOT_BARS + 8 * (S::SLOTS + slot), ((k / S::SLOTS) & 1) ^ 1);
#pragma unroll
  for (int e = 0; e < BN / 8; ++e)  // [e][lane] float4
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(piece + 512 * e +
                                                                16 * (ctid & 31)),
                 "f"(part.d[4 * e]), "f"(part.d[4 * e + 1]), "f"(part.d[4 * e + 2]),
                 "f"(part.d[4 * e + 3])
                 : "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the bulk copy
  __syncwarp();
  if ((ctid & 31) == 0)
    asm volatile(
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(cluster_addr(piece, 0)),
        "r"(piece), "n"(S::PIECE_BYTES), "r"(cluster_addr(base + S::SLOT_BARS + 8 * slot, 0))
        : "memory");
}

// The first CTA of a cluster pair folds the second's k-th partial (fold chunk 2k + 1) from
// slot k % SLOTS into acc, re-arms the slot's full barrier for its next phase (thread 0) and frees
// the slot (one arrival per warp on the second CTA's empty barrier).
template <int BN>
__device__ __forceinline__ void wide_fold_slot(u32 base, int k, int ctid, Acc<BN>& acc,
                                               const unsigned char* smem) {
  using S = WideShape<BN, 2>;
  const int slot = k % S::SLOTS;
  const u32 full = base + S::SLOT_BARS + 8 * slot;
  mbar_wait(full, (k / S::SLOTS) & 1);
  if (ctid == 0) mbar_expect_tx(full, S::SLOT_BYTES);
  const float4* src = (const float4*)(smem + S::SLOTS_AT + slot * S::SLOT_BYTES +
                                      (ctid >> 5) * S::PIECE_BYTES) + (ctid & 31);
#pragma unroll
  for (int e = 0; e < BN / 8; ++e) {
    const float4 v = src[e * 32];
    acc.d[4 * e] = __fadd_rn(acc.d[4 * e], v.x);
    acc.d[4 * e + 1] = __fadd_rn(acc.d[4 * e + 1], v.y);
    acc.d[4 * e + 2] = __fadd_rn(acc.d[4 * e + 2], v.z);
    acc.d[4 * e + 3] = __fadd_rn(acc.d[4 * e + 3], v.w);
  }
  __syncwarp();
  if ((ctid & 31) == 0)
    mbar_arrive_remote(cluster_addr(base + S::SLOT_BARS + 8 * (S::SLOTS + slot), 1));
}

// Consumer step of sequence chunk i (fragments in a[P]), two chains in flight: chain i is issued
// while chain i - 1 may still run (unless i - 1 ended a fold chunk), then chain i - 1 is awaited
// (its stage released) and chunk i + 1 decoded into its fragments a[P ^ 1]; at a fold chunk's
// end chain i is awaited and folded: CL = 1, split 0: the prefix in `acc`, other splits: the
// partial to the workspace; CL = 2, first CTA: the second's partial that precedes it from its
// slot, then its own; second CTA: the partial handed to the first.
template <int BN, int CL, int P>
__device__ __forceinline__ void wide_step(const Params& p, const unsigned char* smem, u32 base,
                                          u32 bars, int o, int i, const WideSeq& q, int r0, int t,
                                          int ctid, u32 (&a)[2][8][4], Acc<BN>& part,
                                          Acc<BN>& acc, float4* slots) {
  using S = WideShape<BN, CL>;
  const int s = (o + i) % S::STAGES;
  const u64 desc = smem_desc(base + s * S::STAGE + S::W_BYTES, LBO_BYTES, SBO_BYTES);
  issue_chunk<BN>(part, a[P], desc, (i & 3) == 0);
  if ((i & 3) != 0) {  // chain i - 1 in flight: await it, release its stage
    wgmma_wait<1>();
    mbar_arrive(bars + 8 * (S::STAGES + (o + i - 1) % S::STAGES));
  }
  if (i + 1 < q.n) {
    const int s1 = (o + i + 1) % S::STAGES;
    mbar_wait(bars + 8 * s1, ((o + i + 1) / S::STAGES) & 1);
    Raw raw;
    wide_raw(smem + s1 * S::STAGE, r0, t, raw);
    decode_raw(raw, a[P ^ 1]);
  }
  if (((i + 1) & 3) != 0 && i + 1 != q.n) return;
  wgmma_wait<0>();
  fence_acc(part);
  mbar_arrive(bars + 8 * (S::STAGES + s));  // the chain and the code reads of stage s are done
  const int f = q.fold(i);
  if constexpr (CL == 2) {
    if (q.f_begin == 1) {  // the second CTA: its partial to the first
      wide_hand_over<BN>(base, f / 2, ctid, part);
      return;
    }
    // the first CTA: the second's partial of the fold chunk before this one, then its own
    if (f > 0) wide_fold_slot<BN>(base, f / 2 - 1, ctid, acc, smem);
  }
  if (CL == 2 || q.keep) {  // the running sum (from fold chunk 0, or a prefix loaded)
#pragma unroll
    for (int e = 0; e < BN / 2; ++e) acc.d[e] = __fadd_rn(acc.d[e], part.d[e]);
  } else {
    float4* mine = slots + (long long)f * (BN / 8) * 256;
#pragma unroll
    for (int e = 0; e < BN / 8; ++e)
      mine[e * 256] =
          make_float4(part.d[4 * e], part.d[4 * e + 1], part.d[4 * e + 2], part.d[4 * e + 3]);
  }
}

// The consumers' run through sequence q from ring position o (q.n > 0 unless EMPTY_OK): its first
// chunk decoded into a[0], then one fold chunk per iteration (a sequence's fold chunks start at
// multiples of four; fragment buffers alternate): its last chain is awaited at its end, so none
// is in flight across the loop's back edge (the compiler would wait there).
template <int BN, int CL, bool EMPTY_OK>
__device__ __forceinline__ void wide_consume(const Params& p, const unsigned char* smem, u32 base,
                                             u32 bars, int o, const WideSeq& q, int r0, int t,
                                             int ctid, u32 (&a)[2][8][4], Acc<BN>& part,
                                             Acc<BN>& acc, float4* slots) {
  using S = WideShape<BN, CL>;
  if (!EMPTY_OK || q.n > 0) {
    Raw raw;
    const int s0 = o % S::STAGES;
    mbar_wait(bars + 8 * s0, (o / S::STAGES) & 1);
    PHASE_TIME(1);
    wide_raw(smem + s0 * S::STAGE, r0, t, raw);
    decode_raw(raw, a[0]);
  }
  static_assert(FOLD_CHUNKS == 4, "the loop below steps through one fold chunk's four chunks");
  for (int i = 0; i < q.n; i += FOLD_CHUNKS) {
    wide_step<BN, CL, 0>(p, smem, base, bars, o, i, q, r0, t, ctid, a, part, acc, slots);
    if (i + 1 < q.n)
      wide_step<BN, CL, 1>(p, smem, base, bars, o, i + 1, q, r0, t, ctid, a, part, acc, slots);
    if (i + 2 < q.n)
      wide_step<BN, CL, 0>(p, smem, base, bars, o, i + 2, q, r0, t, ctid, a, part, acc, slots);
    if (i + 3 < q.n)
      wide_step<BN, CL, 1>(p, smem, base, bars, o, i + 3, q, r0, t, ctid, a, part, acc, slots);
  }
}

// The CTA's outputs (128 weight rows x BN batch rows) through shared memory, so that global stores
// are row segments of y instead of 2-byte elements 4 rows apart, with little code: each thread's
// raw sums go into a float32 tile [rows][128] (pitch 528 bytes: conflict-free), then a rolled loop
// over 8-column row segments applies the epilogue (out_value, as store_out does: the same bits) and
// stores 16 bytes (32 of float32). A thread's segments share their columns, so it loads their
// weight decode scales and bias once, and the tile's activation decode scales go through shared
// memory (one load per thread), all before the first barrier: one memory latency in all. (BN / 2
// unrolled copies of the arithmetic per output type, store_out's way, made the wide kernels' code
// ~150 KB, cold in the instruction cache after the main loop.) PASSES = 2: the tile in two halves
// of BN / 2 rows (stream-K's own tile region). RANGE: the tile's rows [r_lo, r_hi) only (a
// cluster split's share). For a y with unit column stride and 16-byte aligned rows, else
// store_out. Called by both consumer warpgroups once no other reader of `smem` (the
// tile) is left: the ring's, or stream-K's tile region.
template <int BN, int PASSES, bool RANGE = false>
__device__ __forceinline__ void wide_store(const Params& p, const Acc<BN>& acc,
                                           unsigned char* smem, int n0, int m0, int wg, int tid,
                                           int r_lo = 0, int r_hi = BN) {
  static_assert(PASSES == 1 || !RANGE, "a row range in one pass only");
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const bool f32 = p.out_kind == 2;
  const int esize = f32 ? 4 : 2;
  if (p.stride_yn != 1 || ((unsigned long long)p.y & 15) != 0 || (p.stride_ym * esize) % 16 != 0) {
    store_out<BN, RANGE>(p, acc, n0 + 64 * wg + 16 * warp, m0, g, t, r_lo, r_hi);
    return;
  }
  constexpr int PITCH = 528, TILE_M = BN / PASSES, ELEMS = BN / 2 / PASSES;
  const int ctid = 128 * wg + tid, n = n0 + 8 * (ctid & 15);  // this thread's segments' columns
  float wd[8], bs[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int nc = min(n + c, p.N - 1);
    wd[c] = p.w_dec[(long long)nc * p.w_dec_stride];
    bs[c] = p.bias ? p.bias[nc] : 0.f;
  }
  const float ad = ctid < BN ? p.a_dec[(long long)min(m0 + ctid, p.M - 1) * p.a_dec_stride] : 0.f;
  float* ads = (float*)(smem + TILE_M * PITCH);  // the tile's activation decode scales
  float* mine = (float*)(smem + 2 * t * PITCH) + 64 * wg + 16 * warp + g;
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    // both warpgroups past the ring (pass 0) or the previous pass's (or tile's) reads
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (pass == 0 && ctid < BN) ads[ctid] = ad;
#pragma unroll
    for (int i = pass * ELEMS; i < (pass + 1) * ELEMS; ++i) {  // rows 8 j + 2 t + (e & 1)
      const int j = i / 4 - pass * TILE_M / 8, e = i % 4;
      mine[(8 * j + (e & 1)) * (PITCH / 4) + ((e & 2) ? 8 : 0)] = acc.d[i];
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (n >= p.N) continue;
#pragma unroll 1
    for (int r = (RANGE ? r_lo : 0) + (ctid >> 4); r < (RANGE ? r_hi : TILE_M); r += 16) {
      const int m = m0 + pass * TILE_M + r;
      if (m >= p.M) break;
      const float a = ads[pass * TILE_M + r];
      const float* src = (const float*)(smem + r * PITCH) + 8 * (ctid & 15);
      float v[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) v[c] = out_value(p, src[c], a, wd[c], bs[c]);
      char* row = (char*)p.y + ((long long)m * p.stride_ym + n) * esize;
      const int valid = min(8, p.N - n);  // the last columns of y: element by element
      if (f32) {
        if (valid == 8) {
          ((float4*)row)[0] = make_float4(v[0], v[1], v[2], v[3]);
          ((float4*)row)[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
          for (int c = 0; c < valid; ++c) ((float*)row)[c] = v[c];
        }
      } else {
        unsigned short h[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) h[c] = out16(p, v[c]);
        if (valid == 8) {
          *(uint4*)row = make_uint4(h[0] | (u32)h[1] << 16, h[2] | (u32)h[3] << 16,
                                    h[4] | (u32)h[5] << 16, h[6] | (u32)h[7] << 16);
        } else {
          for (int c = 0; c < valid; ++c) ((unsigned short*)row)[c] = h[c];
        }
      }
    }
  }
}

// A split tile's fold (CL = 1): split 0's prefix (its partial slot 0), then the later splits'
// fold chunks [f_later, n_folds) added in order, FL partials in flight; for this thread's float4
// groups [e0, e1) of the tile only (the batch rows 8 e0 to 8 e1).
template <int BN>
__device__ __forceinline__ void wide_fold_partials(Acc<BN>& acc, const float4* slots, int f_later,
                                                   int n_folds, int e0, int e1) {
#pragma unroll
  for (int e = 0; e < BN / 8; ++e)
    if (e >= e0 && e < e1) {
      const float4 v = __ldcg(slots + e * 256);
      acc.d[4 * e] = v.x; acc.d[4 * e + 1] = v.y; acc.d[4 * e + 2] = v.z; acc.d[4 * e + 3] = v.w;
    }
  constexpr int FL = BN >= 128 ? 1 : 128 / BN;
  for (int fa = f_later; fa < n_folds; fa += FL) {
    float4 v[FL][BN / 8];
#pragma unroll
    for (int c = 0; c < FL; ++c)
      if (fa + c < n_folds) {
#pragma unroll
        for (int e = 0; e < BN / 8; ++e)
          if (e >= e0 && e < e1) v[c][e] = __ldcg(slots + ((fa + c) * (BN / 8) + e) * 256);
      }
#pragma unroll
    for (int c = 0; c < FL; ++c)
      if (fa + c < n_folds) {
#pragma unroll
        for (int e = 0; e < BN / 8; ++e)
          if (e >= e0 && e < e1) {
            acc.d[4 * e] = __fadd_rn(acc.d[4 * e], v[c][e].x);
            acc.d[4 * e + 1] = __fadd_rn(acc.d[4 * e + 1], v[c][e].y);
            acc.d[4 * e + 2] = __fadd_rn(acc.d[4 * e + 2], v[c][e].z);
            acc.d[4 * e + 3] = __fadd_rn(acc.d[4 * e + 3], v[c][e].w);
          }
      }
  }
}

template <int BN, int CL, bool EVEN>
__device__ __forceinline__ void gemm_wide(const Params& p) {
  using S = WideShape<BN, CL>;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const u32 bars = base + S::BARS;  // full[STAGES], then empty[STAGES]
  int* last = (int*)(smem + S::BARS + 16 * S::STAGES);
  const int n_folds = (p.K + 511) / 512, k_chunks = (p.K + 127) / 128, splits = gridDim.z;
  const int z = blockIdx.z;
  // CL = 1: split z's fold chunks [z F / S, (z + 1) F / S); CL = 2: every second from z
  const WideSeq q = CL == 1 ? WideSeq(z * n_folds / splits, (z + 1) * n_folds / splits, 1, k_chunks)
                            : WideSeq(z, n_folds, 2, k_chunks);
  const int n0 = blockIdx.y * WR_ROWS;
  // warp-uniform for the compiler (see gemm_ws)
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0), tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::STAGES; ++s) {
      mbar_init(bars + 8 * s, 129);                // each producer thread's copies + the bulk copy
      mbar_init(bars + 8 * (S::STAGES + s), 256);  // every consumer thread
    }
    for (int s = 0; s < S::SLOTS; ++s) {
      // full: the first CTA's own arrival with the slot's bytes, which the second CTA's bulk
      // copies complete; empty: the first CTA's eight consumer warps, one arrival each
      mbar_init(base + S::SLOT_BARS + 8 * s, 1);
      mbar_init(base + S::SLOT_BARS + 8 * (S::SLOTS + s), 8);
    }
    if (CL == 2 && blockIdx.z == 0)
      for (int s = 0; s < S::SLOTS; ++s) mbar_expect_tx(base + S::SLOT_BARS + 8 * s, S::SLOT_BYTES);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (CL == 1)
    __syncthreads();
  else
    cluster_sync();  // both CTAs' slot barriers initialized before either arrives on them
  // registers: 168 per thread at launch; the producer needs 56, the consumers up to 224 (BN = 128:
  // two accumulators and two chunks of fragments), 56 x 128 + 224 x 256 = 168 x 384
  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    wide_produce<BN, CL, EVEN>(p, base, bars, n0, blockIdx.x, q, 0, true, tid);
    // CL = 2: neither CTA leaves while the other may reach its barriers; a split launched as a
    // cluster: the consumers' barrier before the fold counts every thread
    if (CL == 2 || cluster_ctas() > 1) cluster_sync();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  wait_previous_kernel();
  PHASE_TIME(0);
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int r0 = 64 * wg + 16 * warp + g;  // this thread's rows r0, r0 + 8 of the stage
  const int ctid = 128 * wg + tid;
  const int tile = blockIdx.x * gridDim.y + blockIdx.y;
  Acc<BN> part, acc;
#pragma unroll
  for (int e = 0; e < BN / 2; ++e) acc.d[e] = 0.f;
  // split K: partial (tile, fold chunk f) as BN / 8 float4 per thread, [f][e][256 threads]
  float4* slots = CL == 1 ? (float4*)p.partials + (long long)tile * n_folds * (BN / 8) * 256 + ctid
                          : nullptr;
  u32 a[2][8][4];
  wide_consume<BN, CL, true>(p, smem, base, bars, 0, q, r0, t, ctid, a, part, acc, slots);
  PHASE_TIME(2);
  const int m0 = blockIdx.x * BN;
  if constexpr (CL == 2) {
    if (z == 0) {
      if (n_folds % 2 == 0) wide_fold_slot<BN>(base, n_folds / 2 - 1, ctid, acc, smem);
      wide_store<BN, 1>(p, acc, smem, n0, m0, wg, tid);
    }
    PHASE_TIME(3);
    cluster_sync();
    return;
  }
  if (splits == 1) {
    wide_store<BN, 1>(p, acc, smem, n0, m0, wg, tid);
    PHASE_TIME(3);
    return;
  }
  if (z == 0) {
#pragma unroll
    for (int e = 0; e < BN / 8; ++e)
      slots[e * 256] =
          make_float4(acc.d[4 * e], acc.d[4 * e + 1], acc.d[4 * e + 2], acc.d[4 * e + 3]);
  }
  // the fold: of the whole tile by its last CTA, or (the tile's splits launched as a cluster) of
  // split z's share of its batch rows, the float4 groups [e0, e1) (rows 8 e0 to 8 e1), by every
  // split at once once the cluster barrier has released all partials to the cluster
  const bool shared_fold = cluster_ctas() > 1;
  int e0 = 0, e1 = BN / 8;
  if (shared_fold) {
    cluster_sync();
    e0 = z * (BN / 8) / splits;
    e1 = (z + 1) * (BN / 8) / splits;
  } else {
    // count this CTA's arrival (the barrier orders both warpgroups' partial stores before thread
    // 0's fence, which makes them visible GPU-wide before the atomic); the last CTA folds
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (threadIdx.x == 0) {
      __threadfence();
      const int done = atomicAdd(p.counters + tile, 1) + 1 == splits;
      if (done) __threadfence();  // acquire: the other CTAs' partials before the fold's loads
      *last = done;
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (!*last) {
      PHASE_TIME(3);
      return;
    }
  }
  wide_fold_partials<BN>(acc, slots, n_folds / splits, n_folds, e0, e1);
  wide_store<BN, 1, true>(p, acc, smem, n0, m0, wg, tid, 8 * e0, 8 * e1);
  if (!shared_fold && threadIdx.x == 0) p.counters[tile] = 0;
  PHASE_TIME(3);
}

// Stream-K over the wide kernel's tiles (CL = 1) where they outnumber the G CTAs (at most one per
// SM). Tiles are numbered weight-major (the batch tiles of one weight slice side by side, as the
// plain kernel's grid runs them). All but the last one or two waves' worth run whole, CTA c taking
// tiles c, c + G, ... (data-parallel: the CTAs share weight slices at each moment); the last
// T' tiles (G <= T' < 2G) are shared as (tile, fold chunk) units, tile-major, in equal ranges
// [c U / G, (c + 1) U / G) of their U = T' F units. A range then holds at least a tile's F fold
// chunks: the tail of one tile, whole tiles and the head of another. A CTA runs that head first and
// publishes its running sum (the prefix over fold chunks 0 .. h - 1) to the workspace with a flag
// (the tile's counter), and its tail last, from the previous CTA's prefix of that tile. The sums
// are the contract's, ((0 + p_0) + p_1) + ... in fold-chunk order, as one CTA adds them; one
// prefix per shared tile crosses memory.
struct WideSk {
  int F, nbx, waves, full0, full1, head_tile, head_f, tail_tile, tail_f;
  __device__ __forceinline__ WideSk(const Params& p, int bn, int n_folds) : F(n_folds) {
    nbx = (p.M + bn - 1) / bn;
    const int tiles = nbx * ((p.N + WR_ROWS - 1) / WR_ROWS), G = gridDim.x;
    waves = tiles % G ? max(tiles / G - 1, 0) : tiles / G;  // of whole tiles
    const long long first = (long long)waves * G * F, units = (long long)tiles * F - first;
    const long long u0 = first + blockIdx.x * units / G;
    const long long u1 = first + (blockIdx.x + 1) * units / G;
    head_tile = u1 / F, head_f = u1 % F;  // head: fold chunks [0, head_f) of head_tile
    tail_tile = u0 / F, tail_f = u0 % F;  // tail: [tail_f, F) of tail_tile, where tail_f > 0
    full0 = (u0 + F - 1) / F, full1 = u1 / F;  // whole tiles [full0, full1)
  }
  __device__ __forceinline__ int count() const {
    return waves + (head_f > 0) + (full1 - full0) + (tail_f > 0);
  }
  // Segment s in run order: its tile, first and end fold chunk, kind (0 whole, 1 head, 2 tail).
  __device__ __forceinline__ void segment(int s, int& tile, int& fb, int& fe, int& kind) const {
    fb = 0, fe = F, kind = 0;
    if (s < waves) {
      tile = blockIdx.x + s * gridDim.x;
      return;
    }
    s -= waves;
    if (head_f > 0) {
      if (s == 0) {
        tile = head_tile, fe = head_f, kind = 1;
        return;
      }
      --s;
    }
    if (s < full1 - full0)
      tile = full0 + s;
    else
      tile = tail_tile, fb = tail_f, kind = 2;
  }
};

template <int BN, bool EVEN>
__device__ __forceinline__ void gemm_wide_sk(const Params& p) {
  using S = WideShape<BN, 1>;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const u32 bars = base + S::BARS;  // full[STAGES], then empty[STAGES]
  const int n_folds = (p.K + 511) / 512, k_chunks = (p.K + 127) / 128;
  const WideSk sk(p, BN, n_folds);
  const int segments = sk.count();
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0), tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::STAGES; ++s) {
      mbar_init(bars + 8 * s, 129);                // each producer thread's copies + the bulk copy
      mbar_init(bars + 8 * (S::STAGES + s), 256);  // every consumer thread
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (wg == 2) {  // the producer: the segments' chunks through one ring
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    for (int sg = 0, o = 0; sg < segments; ++sg) {
      int tile, fb, fe, kind;
      sk.segment(sg, tile, fb, fe, kind);
      const WideSeq q(fb, fe, 1, k_chunks);
      wide_produce<BN, 1, EVEN>(p, base, bars, (tile / sk.nbx) * WR_ROWS, tile % sk.nbx, q, o,
                                sg == 0, tid);
      o += q.n;
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  wait_previous_kernel();
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int r0 = 64 * wg + 16 * warp + g;  // this thread's rows r0, r0 + 8 of the stage
  const int ctid = 128 * wg + tid;
  Acc<BN> part, acc;
  u32 a[2][8][4];
  for (int sg = 0, o = 0; sg < segments; ++sg) {
    int tile, fb, fe, kind;
    sk.segment(sg, tile, fb, fe, kind);
    WideSeq q(fb, fe, 1, k_chunks);
    q.keep = true;
    // the tile's prefix: BN / 8 float4 per consumer thread, [e][256 threads]
    float4* prefix = (float4*)p.partials + (long long)tile * (BN / 8) * 256 + ctid;
    if (kind == 2) {  // the tail: wait for the previous CTA's prefix, start from it
      if (ctid == 0) {
        int ready = 0;
        while (!ready)
          asm volatile("ld.acquire.gpu.global.s32 %0, [%1];"
                       : "=r"(ready)
                       : "l"(p.counters + tile)
                       : "memory");
        p.counters[tile] = 0;  // zero for the next launch (this CTA is the flag's only reader)
      }
      asm volatile("bar.sync 1, 256;" ::: "memory");
#pragma unroll
      for (int e = 0; e < BN / 8; ++e) {
        const float4 v = __ldcg(prefix + e * 256);
        acc.d[4 * e] = v.x, acc.d[4 * e + 1] = v.y, acc.d[4 * e + 2] = v.z, acc.d[4 * e + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int e = 0; e < BN / 2; ++e) acc.d[e] = 0.f;
    }
    wide_consume<BN, 1, false>(p, smem, base, bars, o, q, r0, t, ctid, a, part, acc, nullptr);
    o += q.n;
    if (kind == 1) {  // the head: publish the prefix (stores, then the flag with release)
#pragma unroll
      for (int e = 0; e < BN / 8; ++e)
        prefix[e * 256] =
            make_float4(acc.d[4 * e], acc.d[4 * e + 1], acc.d[4 * e + 2], acc.d[4 * e + 3]);
      asm volatile("bar.sync 1, 256;" ::: "memory");
      if (ctid == 0) {
        __threadfence();
        asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p.counters + tile), "r"(1)
                     : "memory");
      }
    } else {
      wide_store<BN, 2>(p, acc, smem + S::OUT_AT, (tile / sk.nbx) * WR_ROWS,
                        (tile % sk.nbx) * BN, wg, tid);
    }
  }
}

// The register-A wide kernels of batch tile BN: plain (K split through the workspace), two-CTA
// cluster, stream-K.
#define WIDE_KERNEL(BN, EVEN, SUFFIX)                                                        \
  extern "C" __global__ void __launch_bounds__(384, 1) w4a4_wide_n##BN##SUFFIX(              \
      const Params p) {                                                                      \
    gemm_wide<BN, 1, EVEN>(p);                                                               \
  }                                                                                          \
  extern "C" __global__ void __cluster_dims__(1, 1, 2) __launch_bounds__(384, 1)             \
      w4a4_wide_c2_n##BN##SUFFIX(const Params p) {                                           \
    gemm_wide<BN, 2, EVEN>(p);                                                               \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(384, 1) w4a4_wide_sk_n##BN##SUFFIX(           \
      const Params p) {                                                                      \
    gemm_wide_sk<BN, EVEN>(p);                                                               \
  }
WIDE_KERNEL(32, true, _even_k)
WIDE_KERNEL(64, true, _even_k)
WIDE_KERNEL(128, true, _even_k)
WIDE_KERNEL(32, false, )
WIDE_KERNEL(64, false, )
WIDE_KERNEL(128, false, )
