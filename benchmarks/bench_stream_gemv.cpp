// The bf16 GEMV of a decode step alone, on memory this program owns: M = 1 row against N×K bfloat16 weights in
// MatMulBF16's panel layout ([P, K/2, 32]), 2 threads, vdpbf16ps — to tell the machine's memory bandwidth (and its
// swings) from the engine's. Not part of the build; needs g++ and a CPU with avx512_bf16:
//   g++ -O3 -march=native -pthread benchmarks/bench_stream_gemv.cpp -o /tmp/gemv
//   /tmp/gemv N K CHAINS HUGE CONTIG     e.g. /tmp/gemv 600000 2048 1 0 0   (2.46 GB of weights)
// CHAINS: accumulators per panel (1, 2, 4); HUGE: madvise(MADV_HUGEPAGE) on the weights; CONTIG: each thread a
// contiguous half of the panels (1) or panel pairs dealt alternately (0, as ORT's pool hands them out). Prints the
// best of 12 timed passes in GB/s. benchmarks/RESULTS.md 2026-12-06 (the 1B sitting) has what it showed.
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <thread>
#include <vector>
#include <sys/mman.h>
static int64_t P, pairs;
static uint16_t* W; static uint16_t* A; static float* Y;
template <int CH>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void pair_tile(int64_t p) {
  const int64_t pe = pairs * 32;
  __m512 acc[CH][2];
  for (int c = 0; c < CH; ++c) for (int q = 0; q < 2; ++q) acc[c][q] = _mm512_setzero_ps();
  const uint16_t* w = W + p * pe;
  for (int64_t i = 0; i < pairs; i += CH) {
    for (int c = 0; c < CH; ++c) {
      int32_t pr; memcpy(&pr, A + 2 * (i + c), 4);
      __m512bh x = (__m512bh)_mm512_set1_epi32(pr);
      for (int q = 0; q < 2; ++q) acc[c][q] = _mm512_dpbf16_ps(acc[c][q], x, (__m512bh)_mm512_loadu_si512(w + q * pe + (i + c) * 32));
    }
  }
  for (int q = 0; q < 2; ++q) { __m512 s = acc[0][q]; for (int c = 1; c < CH; ++c) s = _mm512_add_ps(s, acc[c][q]); _mm512_storeu_ps(Y + (p + q) * 16, s); }
}
template <int CH> void run(int tid, int nt, bool contiguous) {
  int64_t items = P / 2;
  if (contiguous) { int64_t b = items * tid / nt, e = items * (tid + 1) / nt; for (int64_t it = b; it < e; ++it) pair_tile<CH>(it * 2); }
  else for (int64_t it = tid; it < items; it += nt) pair_tile<CH>(it * 2);
}
int main(int argc, char** argv) {
  int64_t N = atoll(argv[1]), K = atoll(argv[2]); int ch = atoi(argv[3]); bool huge = atoi(argv[4]); bool contig = atoi(argv[5]);
  P = N / 16; pairs = K / 2; size_t bytes = (size_t)P * pairs * 64;
  W = (uint16_t*)mmap(nullptr, bytes, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  if (huge) madvise(W, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes / 2; ++i) W[i] = 0x3f80 + (i & 7);
  A = (uint16_t*)aligned_alloc(64, K * 2 + 64); for (int64_t i = 0; i < K; ++i) A[i] = 0x3f80;
  Y = (float*)aligned_alloc(64, N * 4 + 64);
  double best = 0;
  for (int r = 0; r < 15; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    std::thread t1([&]{ ch == 1 ? run<1>(1, 2, contig) : ch == 2 ? run<2>(1, 2, contig) : run<4>(1, 2, contig); });
    ch == 1 ? run<1>(0, 2, contig) : ch == 2 ? run<2>(0, 2, contig) : run<4>(0, 2, contig);
    t1.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 2) best = std::max(best, bytes / s / 1e9);
  }
  printf("N=%ld K=%ld chains=%d huge=%d contig=%d: %.1f GB/s (y0 %.1f)\n", N, K, ch, huge, contig, best, Y[0]);
}
