/* What a core reads from blocks at random places while it also computes (docs/performance.md,
 * fifteenth session): the access pattern of a paged serving pass (a page holds one KV head's 16
 * keys in 4 KiB of bf16 K, and as much V, at a random place) without the pass.
 *
 *     gcc -O3 -mavx512f -fopenmp docs/repro/random_blocks.c -o /tmp/random_blocks
 *     OMP_NUM_THREADS=2 /tmp/random_blocks BLOCK DIST SPREAD WORK
 *     MB=2 OMP_NUM_THREADS=2 /tmp/random_blocks 4096 0 0 WORK   # the same work on 2 MiB, in cache
 *
 * 512 MiB (MB=...: less, walked 512/MB times) in blocks of BLOCK bytes, visited in a shuffled
 * order by OMP_NUM_THREADS threads; each block's 64-byte lines read in the order of AMX tile
 * loads (line c of each of 16 rows, then c + 1), then WORK rounds of 8 independent FMAs. DIST > 0:
 * the lines of the block DIST ahead asked for with prefetcht2, all at the block's start
 * (SPREAD 0) or one every few FMAs through the work (SPREAD 1). Prints GB/s and the best of 5 ms. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc < 5) { fprintf(stderr, "usage: %s BLOCK DIST SPREAD WORK\n", argv[0]); return 2; }
  size_t block = atoi(argv[1]), row = block / 16;
  int dist = atoi(argv[2]), spread = atoi(argv[3]), work = atoi(argv[4]);
  size_t total = (size_t)(getenv("MB") ? atoi(getenv("MB")) : 512) << 20;
  size_t walks = ((size_t)512 << 20) / total, n = total / block, lines = block / 64;
  uint8_t *pool = aligned_alloc(4096, total);
  memset(pool, 1, total);
  uint32_t *order = malloc(n * sizeof *order);
  for (size_t i = 0; i < n; i++) order[i] = i;
  srand(1);
  for (size_t i = n - 1; i > 0; i--) { size_t j = rand() % (i + 1); uint32_t t = order[i]; order[i] = order[j]; order[j] = t; }
  double best = 1e9;
  long long sink = 0;
  for (int rep = 0; rep < 5; rep++) {
    double t0 = now();
#pragma omp parallel reduction(+ : sink)
    {
      size_t lo = n * omp_get_thread_num() / omp_get_num_threads(), hi = n * (omp_get_thread_num() + 1) / omp_get_num_threads();
      __m512i acc = _mm512_setzero_si512();
      __m512 f[8], g = _mm512_set1_ps(0.9999f);
      for (int k = 0; k < 8; k++) f[k] = _mm512_set1_ps(1.0f + k * 1e-3f);
      for (size_t walk = 0; walk < walks; walk++)
        for (size_t i = lo; i < hi; i++) {
          const uint8_t *ahead = pool + (size_t)order[i + dist < hi ? i + dist : i] * block;
          size_t asked = 0;
          if (dist > 0 && !spread)
            for (; asked < lines; asked++) _mm_prefetch((const char *)ahead + asked * 64, _MM_HINT_T2);
          const uint8_t *p = pool + (size_t)order[i] * block;
          for (size_t c = 0; c < row / 64; c++)
            for (size_t r = 0; r < 16; r++) acc = _mm512_add_epi64(acc, _mm512_load_si512(p + r * row + c * 64));
          int every = work / (int)lines > 0 ? work / (int)lines : 1;
          for (int w = 0; w < work; w++) {
            for (int k = 0; k < 8; k++) f[k] = _mm512_fmadd_ps(f[k], g, f[k]);
            if (dist > 0 && spread && w % every == 0 && asked < lines)
              _mm_prefetch((const char *)ahead + 64 * asked++, _MM_HINT_T2);
          }
          if (dist > 0)
            for (; asked < lines; asked++) _mm_prefetch((const char *)ahead + asked * 64, _MM_HINT_T2);
        }
      __m512 s = f[0];
      for (int k = 1; k < 8; k++) s = _mm512_add_ps(s, f[k]);
      sink += _mm512_reduce_add_epi64(acc) + (long long)_mm512_reduce_add_ps(s);
    }
    double t = now() - t0;
    if (t < best) best = t;
  }
  printf("MiB %zu block %zu dist %d spread %d work %d: %.2f GB/s, %.1f ms (%lld)\n", total >> 20, block, dist, spread,
         work, (double)total * walks / best / 1e9, best * 1e3, sink & 1);
  return 0;
}
