// Consumer-side probe of the streamed small-M GEMM (benchmarks/consumer_probe.py; issue 13),
// appended by the script to kernels/w4a4_gemm_sm90a.cu so that it runs the shipped functions:
// each of a CTA's NWG warpgroups runs `units` units on a stage of fixed data in shared memory
// (never refilled: no producer, no stream, no hand-off), and its thread 0 records the clock
// cycles they took, at BM = 8 and 16 batch columns. MODE 0: the chains only (four chunks of eight
// m64n8k16 steps on fixed A fragments, each chunk awaited, as stream_unit does); 1: stream_unit
// itself (the unit layout's reads, the decode, the chains). (A third mode, the reads and decode
// alone, timed ~50 cycles per unit: the compiler had dropped most of the decode, so it is not
// here.)

struct ConsumerProbe {
  unsigned long long* cycles;  // [grid][NWG]
  float* sink;
  int units;
};

template <int MODE, int BM>
__device__ __forceinline__ void consumer_probe(const ConsumerProbe& q) {
  using S = StreamShape<BM, true>;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127, nwg = blockDim.x >> 7;
  for (int i = threadIdx.x; i < nwg * S::STAGE / 4; i += blockDim.x) {
    const int off = (i * 4) % S::STAGE;
    u32 v = (u32)i * 2654435761u;
    if (off >= S::W_CODES && off < S::W_CODES + S::W_SCALES) v &= 0x37373737u;  // finite E4M3
    if (off >= S::W_CODES + S::W_SCALES) v = 0x3F803F80u;  // the activation: BF16 ones
    ((u32*)smem)[i] = v;
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const unsigned char* stage = smem + wg * S::STAGE;
  const u32 stage_addr = base + wg * S::STAGE;
  float sink = 0.f;
  u32 a[8][4];
#pragma unroll
  for (int q2 = 0; q2 < 8; ++q2)
#pragma unroll
    for (int j = 0; j < 4; ++j) a[q2][j] = 0x3F803F80u ^ (u32)(tid + q2 + j);
  const u64 desc0 = smem_desc(stage_addr + S::W_CODES + S::W_SCALES, LBO_BYTES, SBO_BYTES);
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
  const long long t0 = clock64();
  for (int u = 0; u < q.units; ++u) {
    asm volatile("" ::: "memory");  // each unit reads the stage again (no hoisting)
    Acc<BM> part;
#pragma unroll
    for (int e = 0; e < BM / 2; ++e) part.d[e] = 0.f;
    if constexpr (MODE == 0) {
#pragma unroll
      for (int c = 0; c < FOLD_CHUNKS; ++c) {
        issue_chunk<BM>(part, a, desc0 + (u64)(c * 8 * BM * 2), c == 0);
        wgmma_wait<0>();
      }
      fence_acc(part);
    } else {
      stream_unit<BM, true>(stage, stage_addr, FOLD_CHUNKS, tid, part);
    }
    sink += part.d[0] + part.d[3] + part.d[1] + part.d[2];
  }
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
  const long long t1 = clock64();
  if (tid == 0) q.cycles[blockIdx.x * nwg + wg] = (unsigned long long)(t1 - t0);
  if (sink == 1234.5f) q.sink[threadIdx.x] = sink;  // the work is used
}

#define CONSUMER_PROBE(MODE, BM)                                                           \
  extern "C" __global__ void __launch_bounds__(512, 1)                                     \
      consumer_probe_##MODE##_m##BM(const ConsumerProbe q) {                               \
    consumer_probe<MODE, BM>(q);                                                           \
  }
CONSUMER_PROBE(0, 8)
CONSUMER_PROBE(1, 8)
CONSUMER_PROBE(0, 16)
CONSUMER_PROBE(1, 16)
