/* What one AVX-512 shuffle, conversion or pair dot product costs this core (docs/performance.md,
 * twenty-fourth session): a loop of 8 independent instances of each, ns per instruction. On the
 * 2-core Zen 4 VM vpermt2b, vpermt2w, vpermt2d, vpermb, vpshufb and vshufi64x2 all took
 * 0.28-0.30 ns, vpunpcklbw 0.23, vpaddd 0.20, vcvtph2ps and vcvtne2ps2bf16 0.50.
 *
 *     gcc -O2 -march=cooperlake -mavx512vbmi docs/repro/shuffle_costs.c -o /tmp/shuffle_costs
 *     /tmp/shuffle_costs
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 100000000L
#define BENCH(name, expr) { __m512i a0=_mm512_set1_epi32(1),a1=_mm512_set1_epi32(2),a2=_mm512_set1_epi32(3),a3=_mm512_set1_epi32(4),a4=_mm512_set1_epi32(5),a5=_mm512_set1_epi32(6),a6=_mm512_set1_epi32(7),a7=_mm512_set1_epi32(8); \
  __m512i t=_mm512_set1_epi32(0x01020304), u=_mm512_set1_epi32(0x05060708); double s=now(); \
  for(long i=0;i<N/8;i++){ \
   __asm__ volatile("" : "+v"(t), "+v"(u)); \
   a0=expr(a0); a1=expr(a1); a2=expr(a2); a3=expr(a3); a4=expr(a4); a5=expr(a5); a6=expr(a6); a7=expr(a7);} \
  double e=now()-s; __m512i r=_mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)),_mm512_add_epi32(_mm512_add_epi32(a4,a5),_mm512_add_epi32(a6,a7))); \
  printf("%-28s %.3f ns each (%d)\n", name, e/N*1e9, _mm512_reduce_add_epi32(r)); }
#define PT2B(x) _mm512_permutex2var_epi8(t, x, u)
#define PT2W(x) _mm512_permutex2var_epi16(t, x, u)
#define PT2D(x) _mm512_permutex2var_epi32(t, x, u)
#define PT2Q(x) _mm512_permutex2var_epi64(t, x, u)
#define PB(x) _mm512_permutexvar_epi8(x, t)
#define PSHUFB(x) _mm512_shuffle_epi8(t, x)
#define UNPB(x) _mm512_unpacklo_epi8(x, t)
#define SHUFI(x) _mm512_shuffle_i64x2(x, t, 0x4e)
#define ADDD(x) _mm512_add_epi32(x, t)
#define TERN(x) _mm512_ternarylogic_epi32(x, t, u, 0xca)
#define SRLW(x) _mm512_srli_epi16(x, 4)
#define CVTPH(x) _mm512_castps_si512(_mm512_cvtph_ps(_mm512_castsi512_si256(x)))
#define DPBF(x) _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(x), (__m512bh)t, (__m512bh)u))
#define CVT2BF(x) (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(x), _mm512_castsi512_ps(t))
#define VPMOVZX(x) _mm512_cvtepu8_epi16(_mm512_castsi512_si256(x))
int main(){
 BENCH("vpermt2b", PT2B) BENCH("vpermt2w", PT2W) BENCH("vpermt2d", PT2D) BENCH("vpermt2q", PT2Q)
 BENCH("vpermb", PB) BENCH("vpshufb", PSHUFB) BENCH("vpunpcklbw", UNPB) BENCH("vshufi64x2", SHUFI)
 BENCH("vpaddd", ADDD) BENCH("vpternlogd", TERN) BENCH("vpsrlw", SRLW) BENCH("vcvtph2ps", CVTPH)
 BENCH("vdpbf16ps", DPBF) BENCH("vcvtne2ps2bf16", CVT2BF) BENCH("vpmovzxbw", VPMOVZX)
}
