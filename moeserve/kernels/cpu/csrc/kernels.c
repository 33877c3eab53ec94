/* Native CPU kernels with one arithmetic order per output element.
 *
 * Each output element is computed by one fixed sequence of floating-point operations that
 * depends only on its own inputs: not on how many rows the call holds, where the row sits
 * among them, how the work is split over threads, or what else runs in the step. A
 * sequence's logits then depend only on its tokens: a prefix-cache hit, chunked prefill, one
 * token per step or several verified at once give the same bits.
 *
 * Two builds of this file exist, chosen by the compiler's target (-march=native at build
 * time): AVX-512 with the BF16 dot-product instructions (VDPBF16PS), and portable C. A
 * process loads one of them and uses it for everything, so each is consistent with itself;
 * they need not agree with each other.
 *
 * Conventions: bf16 values travel as uint16_t; every length is in elements; threads come
 * from OpenMP (the process's libgomp, which torch shares, so torch.set_num_threads applies).
 *
 * Weight layouts (packed once at load by moeserve/kernels/cpu/pack.py), all in tiles of 16
 * output columns, columns padded to whole tiles:
 *   bf16  [tile][K/2][16][2]        pairs of k per column (what VDPBF16PS reads)
 *   q4    [tile][K/32][4][64 bytes] one 64-byte block = 4 k-pairs x 16 columns of 4-bit codes
 *                                   (order: see q4_unpack); per [tile][group][16] fp32 scales
 *                                   d and offsets c, so that w = d * (128 + q) + c
 *   i8    [tile][K][16] int8        per-column fp32 scales s: w = s * q
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MS_SIMD 1
#else
#define MS_SIMD 0
#endif

#define TILE 16     /* output columns per tile */
#define GROUP 32    /* q4: k per scale group */
#define ROWS 8      /* rows per GEMM work item */
#define KEYS 32     /* attention: keys per block, aligned to absolute key positions */
#define Q4_BIAS 128 /* q4 codes enter the dot products as the bf16 value 128 + q */

int ms_simd(void) { return MS_SIMD; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* to nearest even */
    return (uint16_t)(u >> 16);
}

/* exp on [-87, 88] (below: 0, -inf included): 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2, p
 * the Taylor polynomial of degree 6 (relative error ~1e-7) */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.428606765330187045e-06f
#define EXP_TERMS 7
static const float EXP_POLY[EXP_TERMS] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6,
                                          0.5f,       1.0f,       1.0f};

static inline float exp_scalar(float x) {
    if (!(x >= EXP_LO)) return 0.0f;
    if (x > EXP_HI) x = EXP_HI;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = EXP_POLY[0];
    for (int i = 1; i < EXP_TERMS; i++) p = fmaf(p, r, EXP_POLY[i]);
    return ldexpf(p, (int)n);
}

#if MS_SIMD
static inline __m512 exp512(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < EXP_TERMS; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

static inline void store_row16(void* y, int fp32, int64_t col, __m512 v, __mmask16 m) {
    if (fp32)
        _mm512_mask_storeu_ps((float*)y + col, m, v);
    else
        _mm256_mask_storeu_epi16((uint16_t*)y + col, m, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 bf16x16_to_f32(const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* acc += dot(b, the bf16 pair at x[2kp] in every lane), the pair read as an embedded
 * broadcast (the compiler would spend a separate broadcast instruction on it) */
static inline __m512 dp_pair(__m512 acc, __m512bh b, const uint16_t* x, int64_t kp) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*(const int32_t*)(x + 2 * kp)));
    return acc;
}

/* 16 x 16 dwords: r[i][j] -> r[j][i] */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* per 128-bit lane L, b[4i + c] = column 4L + c of rows 4i .. 4i+3 */
    for (int i = 0; i < 4; i++) {
        b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88);
        __m512i o0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xdd);
        __m512i e1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
        __m512i o1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(e0, e1, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(e0, e1, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(o0, o1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(o0, o1, 0xdd);
    }
}
#endif

static inline int64_t tiles_of(int64_t n) { return (n + TILE - 1) / TILE; }

/* ---- row sums for the q4 offsets: X[m][g] = sum of x over group g, in order ---------------- */
static void group_sums(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* out) {
    int64_t G = K / GROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int k = 0; k < GROUP; k++) s += bf16_to_f32(x[m * ldx + g * GROUP + k]);
            out[m * G + g] = s;
        }
}

/* ---- GEMM drivers -------------------------------------------------------------------------
 * Work items are (8-row block, column tile); a row's element sees the same operations in any
 * item shape: the kernels below only interleave independent elements. */
#if MS_SIMD
/* q4: 64 bytes -> 4 vectors of 16 columns x one k-pair each, as bf16 values 128 + q */
static inline void q4_unpack(const uint8_t* src, __m512i v[4]) {
    __m512i b = _mm512_loadu_si512(src);
    __m512i lo_mask = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8(0x43);
    __m512i lo = _mm512_and_si512(b, lo_mask);
    __m512i up = _mm512_and_si512(_mm512_srli_epi16(b, 4), lo_mask);
    v[0] = _mm512_unpacklo_epi8(lo, hi);
    v[1] = _mm512_unpackhi_epi8(lo, hi);
    v[2] = _mm512_unpacklo_epi8(up, hi);
    v[3] = _mm512_unpackhi_epi8(up, hi);
}

/* R rows x C consecutive tiles of a q4 weight; acc[r * C + c] */
static inline __attribute__((always_inline)) void q4_block(
    int R, int C, const uint16_t* x, int64_t ldx, const float* xs, int64_t G, const uint8_t* w,
    const float* d, const float* c0, int64_t t0, __m512* acc) {
    for (int i = 0; i < R * C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 s[32];
        for (int i = 0; i < R * C; i++) s[i] = _mm512_setzero_ps();
        for (int u = 0; u < 4; u++) {
            __m512i v[4][4];
            for (int c = 0; c < C; c++)
                q4_unpack(w + ((t0 + c) * G + g) * 256 + u * 64, v[c]);
            for (int e = 0; e < 4; e++) {
                int64_t kp = g * 16 + u * 4 + e;
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < C; c++)
                        s[r * C + c] = dp_pair(s[r * C + c], (__m512bh)v[c][e], x + r * ldx, kp);
            }
        }
        for (int c = 0; c < C; c++) {
            __m512 dv = _mm512_loadu_ps(d + ((t0 + c) * G + g) * TILE);
            __m512 cv = _mm512_loadu_ps(c0 + ((t0 + c) * G + g) * TILE);
            for (int r = 0; r < R; r++) {
                __m512* a = &acc[r * C + c];
                *a = _mm512_fmadd_ps(dv, s[r * C + c], *a);
                *a = _mm512_fmadd_ps(cv, _mm512_set1_ps(xs[r * G + g]), *a);
            }
        }
    }
}

static inline __attribute__((always_inline)) void bf16_block(
    int R, int C, const uint16_t* x, int64_t ldx, int64_t KP, const uint16_t* w, int64_t t0,
    __m512* acc) {
    for (int i = 0; i < R * C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < KP; kp++) {
        __m512bh v[4];
        for (int c = 0; c < C; c++)
            v[c] = (__m512bh)_mm512_loadu_si512(w + ((t0 + c) * KP + kp) * 2 * TILE);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r * C + c] = dp_pair(acc[r * C + c], v[c], x + r * ldx, kp);
    }
}

static inline __attribute__((always_inline)) void i8_block(
    int R, int C, const uint16_t* x, int64_t ldx, int64_t K, const int8_t* w, const float* s,
    int64_t t0, __m512* acc) {
    for (int i = 0; i < R * C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 v[4];
        for (int c = 0; c < C; c++)
            v[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i*)(w + ((t0 + c) * K + k) * TILE))));
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(bf16_to_f32(x[r * ldx + k]));
            for (int c = 0; c < C; c++) acc[r * C + c] = _mm512_fmadd_ps(xv, v[c], acc[r * C + c]);
        }
    }
    for (int c = 0; c < C; c++) {
        __m512 sv = _mm512_loadu_ps(s + (t0 + c) * TILE);
        for (int r = 0; r < R; r++) acc[r * C + c] = _mm512_mul_ps(acc[r * C + c], sv);
    }
}
#endif

enum { FMT_BF16 = 0, FMT_Q4 = 1, FMT_I8 = 2 };

typedef struct {
    int fmt;
    const void* w;
    const float* a; /* q4: d; i8: s */
    const float* b; /* q4: c */
    int64_t K, N;
} weight_t;

#if MS_SIMD
static inline __attribute__((always_inline)) void run_block(
    int R, int C, const weight_t* W, const uint16_t* x, int64_t ldx, const float* xs, int64_t t0,
    void* y, int64_t ldy, int fp32) {
    __m512 acc[32];
    int64_t K = W->K;
    if (W->fmt == FMT_Q4)
        q4_block(R, C, x, ldx, xs, K / GROUP, (const uint8_t*)W->w, W->a, W->b, t0, acc);
    else if (W->fmt == FMT_BF16)
        bf16_block(R, C, x, ldx, K / 2, (const uint16_t*)W->w, t0, acc);
    else
        i8_block(R, C, x, ldx, K, (const int8_t*)W->w, W->a, t0, acc);
    for (int c = 0; c < C; c++) {
        int64_t col = (t0 + c) * TILE;
        int64_t left = W->N - col;
        __mmask16 m = left >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) {
            char* row = (char*)y + r * ldy * (fp32 ? 4 : 2);
            store_row16(row, fp32, col, acc[r * C + c], m);
        }
    }
}

static void simd_item(const weight_t* W, const uint16_t* x, int64_t ldx, const float* xs, int R,
                      int64_t t0, int C, void* y, int64_t ldy, int fp32) {
    /* constant shapes, so each combination is its own unrolled code */
    if (C == 4) {
        run_block(1, 4, W, x, ldx, xs, t0, y, ldy, fp32);
        return;
    }
    switch (R) {
        case 8: run_block(8, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
        case 7: run_block(7, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
        case 6: run_block(6, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
        case 5: run_block(5, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
        case 4: run_block(4, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
        case 3: run_block(3, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
        case 2: run_block(2, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
        default: run_block(1, 1, W, x, ldx, xs, t0, y, ldy, fp32); break;
    }
}
#else
/* portable path: the same formats, one element at a time in the SIMD path's order */
static float generic_dot(const weight_t* W, const uint16_t* x, const float* xs, int64_t n) {
    int64_t t = n / TILE, j = n % TILE, K = W->K;
    if (W->fmt == FMT_BF16) {
        const uint16_t* w = (const uint16_t*)W->w + t * K * TILE;
        float acc = 0.0f;
        for (int64_t kp = 0; kp < K / 2; kp++) {
            acc = fmaf(bf16_to_f32(x[2 * kp + 1]), bf16_to_f32(w[(kp * TILE + j) * 2 + 1]), acc);
            acc = fmaf(bf16_to_f32(x[2 * kp]), bf16_to_f32(w[(kp * TILE + j) * 2]), acc);
        }
        return acc;
    }
    if (W->fmt == FMT_I8) {
        const int8_t* w = (const int8_t*)W->w + t * K * TILE;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc = fmaf(bf16_to_f32(x[k]), (float)w[k * TILE + j], acc);
        return acc * W->a[t * TILE + j];
    }
    int64_t G = K / GROUP;
    const uint8_t* w = (const uint8_t*)W->w + t * G * 256;
    float acc = 0.0f;
    /* column j, k-parity e within vector s of a 64-byte block: see q4_unpack */
    int lane = j / 4, pos = 2 * (j % 4);
    for (int64_t g = 0; g < G; g++) {
        float s = 0.0f;
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < 4; v++) {
                const uint8_t* blk = w + g * 256 + u * 64 + lane * 16 + (v & 1) * 8 + pos;
                int64_t kp = g * 16 + u * 4 + v;
                for (int e = 1; e >= 0; e--) {
                    int q = (v < 2) ? (blk[e] & 15) : (blk[e] >> 4);
                    s = fmaf(bf16_to_f32(x[2 * kp + e]), (float)(Q4_BIAS + q), s);
                }
            }
        acc = fmaf(W->a[(t * G + g) * TILE + j], s, acc);
        acc = fmaf(W->b[(t * G + g) * TILE + j], xs[g], acc);
    }
    return acc;
}
#endif

/* y[M, N] = x[M, K] @ W^T; y bf16 (fp32 when y_fp32), row strides ldx / ldy in elements */
static void gemm(const weight_t* W, const uint16_t* x, int64_t ldx, int64_t M, void* y,
                 int64_t ldy, int y_fp32) {
    float* xs = NULL;
    if (W->fmt == FMT_Q4) {
        xs = (float*)malloc(sizeof(float) * (size_t)(M * (W->K / GROUP) + 1));
        group_sums(x, ldx, M, W->K, xs);
    }
    int64_t G = W->K / GROUP;
#if MS_SIMD
    int64_t T = tiles_of(W->N);
    if (M == 1) {
        /* one row: four tiles per item (four independent chains in flight) */
        int64_t items = (T + 3) / 4;
#pragma omp parallel for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            int64_t t0 = it * 4;
            if (t0 + 4 <= T)
                simd_item(W, x, ldx, xs, 1, t0, 4, y, ldy, y_fp32);
            else
                for (int64_t t = t0; t < T; t++) simd_item(W, x, ldx, xs, 1, t, 1, y, ldy, y_fp32);
        }
    } else {
        int64_t blocks = (M + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) collapse(2)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t t = 0; t < T; t++) {
                int64_t m0 = b * ROWS;
                int R = (int)(M - m0 < ROWS ? M - m0 : ROWS);
                char* yrow = (char*)y + m0 * ldy * (y_fp32 ? 4 : 2);
                simd_item(W, x + m0 * ldx, ldx, xs ? xs + m0 * G : NULL, R, t, 1, yrow, ldy,
                          y_fp32);
            }
    }
#else
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < W->N; n++) {
            float v = generic_dot(W, x + m * ldx, xs ? xs + m * G : NULL, n);
            if (y_fp32)
                ((float*)y)[m * ldy + n] = v;
            else
                ((uint16_t*)y)[m * ldy + n] = f32_to_bf16(v);
        }
#endif
    free(xs);
}

void ms_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K,
                  int64_t N, void* y, int64_t ldy, int y_fp32) {
    weight_t W = {FMT_BF16, w, NULL, NULL, K, N};
    gemm(&W, x, ldx, M, y, ldy, y_fp32);
}

void ms_gemm_q4(const uint16_t* x, int64_t ldx, int64_t M, const uint8_t* w, const float* d,
                const float* c, int64_t K, int64_t N, void* y, int64_t ldy, int y_fp32) {
    weight_t W = {FMT_Q4, w, d, c, K, N};
    gemm(&W, x, ldx, M, y, ldy, y_fp32);
}

void ms_gemm_i8(const uint16_t* x, int64_t ldx, int64_t M, const int8_t* w, const float* s,
                int64_t K, int64_t N, void* y, int64_t ldy, int y_fp32) {
    weight_t W = {FMT_I8, w, s, NULL, K, N};
    gemm(&W, x, ldx, M, y, ldy, y_fp32);
}

/* ---- elementwise ----------------------------------------------------------------------- */

/* out[m, i] = silu(g[m, i]) * u[m, i], bf16 in and out, fp32 inside (rounded once) */
void ms_silu_mul(const uint16_t* g0, int64_t ldg, const uint16_t* u0, int64_t ldu, int64_t M,
                 int64_t I, uint16_t* out, int64_t ldo) {
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* g = g0 + m * ldg;
        const uint16_t* u = u0 + m * ldu;
        uint16_t* o = out + m * ldo;
#if MS_SIMD
        for (int64_t i = 0; i < I; i += 16) {
            __mmask16 k = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
            __m512 gv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, g + i)), 16));
            __m512 uv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, u + i)), 16));
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm256_mask_storeu_epi16(o + i, k, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sv, uv)));
        }
#else
        for (int64_t i = 0; i < I; i++) {
            float gv = bf16_to_f32(g[i]);
            float sv = gv / (1.0f + exp_scalar(-gv));
            o[i] = f32_to_bf16(sv * bf16_to_f32(u[i]));
        }
#endif
    }
}

/* x[i] = 1 / (1 + exp(-x[i])), fp32 in place */
void ms_sigmoid(float* x, int64_t n) {
#if MS_SIMD
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_mask_storeu_ps(x + i, k, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
#else
    for (int64_t i = 0; i < n; i++) x[i] = 1.0f / (1.0f + exp_scalar(-x[i]));
#endif
}

/* ---- paged attention ----------------------------------------------------------------------
 * Query row r of sequence b sits at position p = seq_len - q_len + i and attends keys 0..p.
 * Keys are visited in blocks of KEYS aligned to absolute positions; within a block the scores
 * are dot products in k-pair order, masked beyond p, and folded into a running max / sum /
 * output (online softmax, fp32) in block order. Everything a row computes depends on p and
 * the cached keys only, so the same position gives the same bits whether its keys were
 * written in this step or earlier, and whatever other rows share the call.
 *
 * Rows of one work item share the key / value loads: the query heads of one KV head at up
 * to `pos_tile` consecutive positions. */
typedef struct {
    const uint16_t* q;
    int64_t q_tok, q_head; /* strides */
    int H, KVH, Dqk, Dv;
    const uint16_t* kc;
    const uint16_t* vc;
    int64_t kv_tok, k_head, v_head;
    const int32_t* table;
    int64_t table_stride;
    int page_size;
    float scale;
    uint16_t* out;
    int64_t o_tok, o_head;
} attn_t;

static inline const uint16_t* kv_row(const attn_t* A, const uint16_t* base, int64_t head_stride,
                                     int64_t b, int64_t key, int g) {
    int64_t page = A->table[b * A->table_stride + key / A->page_size];
    return base + (page * A->page_size + key % A->page_size) * A->kv_tok + g * head_stride;
}

typedef struct {
    uint32_t* kt; /* [Dqk/2][KEYS] k-pairs of the block's keys, transposed */
    float* vf;    /* portable build: [KEYS][Dv] the block's values in fp32 */
    uint32_t* vp; /* AVX-512 build: [KEYS/2][Dv] value pairs of consecutive keys (bf16 x 2) */
    uint16_t* pb; /* AVX-512 build: [rows][KEYS] the block's weights in bf16 */
    float* o;     /* [rows][Dv] running outputs */
    float* ml;    /* [rows][2] running max and (portable build) sum */
    float* lv;    /* AVX-512 build: [rows][16] running sums per lane, added up at the end */
    float* p;     /* [rows][KEYS] the block's weights */
    float* alpha; /* [rows] the block's rescale of the running output */
    int* nk;      /* [rows] keys of the block each row sees */
} attn_scratch_t;

/* the keys k0 .. k0+KEYS-1 of sequence b, KV head g: k-pairs transposed into kt (zeros past
 * `valid`), values into vf */
static void load_block(const attn_t* A, attn_scratch_t* S, int64_t b, int g, int64_t k0,
                       int valid) {
    int DP = A->Dqk / 2, Dv = A->Dv;
    const uint16_t* kr[KEYS];
    for (int j = 0; j < valid; j++) kr[j] = kv_row(A, A->kc, A->k_head, b, k0 + j, g);
    int dp = 0;
#if MS_SIMD
    for (; dp + 16 <= DP; dp += 16)
        for (int kh = 0; kh < KEYS; kh += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = kh + j < valid ? _mm512_loadu_si512(kr[kh + j] + 2 * dp)
                                      : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(S->kt + (dp + i) * KEYS + kh, r[i]);
        }
#endif
    for (; dp < DP; dp++)
        for (int j = 0; j < KEYS; j++) {
            uint32_t v = 0;
            if (j < valid) memcpy(&v, kr[j] + 2 * dp, 4);
            S->kt[dp * KEYS + j] = v;
        }
#if MS_SIMD
    /* value pairs (key 2i, key 2i+1) per column: what VDPBF16PS multiplies the weight pairs
     * with; keys past `valid` are zeros */
    for (int j = 0; j < KEYS; j += 2) {
        const uint16_t* v0 = j < valid ? kv_row(A, A->vc, A->v_head, b, k0 + j, g) : NULL;
        const uint16_t* v1 = j + 1 < valid ? kv_row(A, A->vc, A->v_head, b, k0 + j + 1, g) : NULL;
        uint32_t* dst = S->vp + (j / 2) * Dv;
        for (int d = 0; d < Dv; d += 16) {
            __mmask16 m = Dv - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (Dv - d)) - 1);
            __m512i lo = v0 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v0 + d))
                            : _mm512_setzero_si512();
            __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v1 + d))
                            : _mm512_setzero_si512();
            _mm512_mask_storeu_epi32(dst + d, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
#else
    for (int j = 0; j < valid; j++) {
        const uint16_t* vr = kv_row(A, A->vc, A->v_head, b, k0 + j, g);
        float* dst = S->vf + j * Dv;
        for (int d = 0; d < Dv; d++) dst[d] = bf16_to_f32(vr[d]);
    }
#endif
}

#if MS_SIMD
/* columns d .. d+w of rows [r0, r0+n): o = o * alpha, then + the (bf16) weight pairs times the
 * value pairs of the keys each row sees, in key order; in a row's last pair a key past its
 * position counts as value zero, as it is when that key is not cached yet (n and nv are
 * constant per instance: the outputs stay in registers) */
static inline __attribute__((always_inline)) void pv_cols(attn_scratch_t* S, int n, int nv,
                                                          int r0, int d, int Dv, int w) {
    __mmask16 last = (__mmask16)(w % 16 ? (1u << (w % 16)) - 1 : 0xffff);
    __m512 o[4][4];
    int np[4], odd[4];
    for (int i = 0; i < n; i++) {
        const float* orow = S->o + (int64_t)(r0 + i) * Dv + d;
        float alpha = S->alpha[r0 + i];
        int nk = S->nk[r0 + i];
        np[i] = (nk + 1) / 2;
        odd[i] = nk % 2;
        for (int c = 0; c < nv; c++) {
            __mmask16 m = c == nv - 1 ? last : (__mmask16)0xffff;
            o[i][c] = _mm512_maskz_loadu_ps(m, orow + 16 * c);
            /* times 1 is the identity: skipping it is the same arithmetic */
            if (alpha != 1.0f) o[i][c] = _mm512_mul_ps(o[i][c], _mm512_set1_ps(alpha));
        }
    }
    /* rows see a prefix of the block's keys; the last row (latest position) the most */
    for (int kp = 0; kp < np[n - 1]; kp++) {
        __m512i v[4];
        const uint32_t* vr = S->vp + kp * Dv + d;
        for (int c = 0; c < nv; c++) {
            __mmask16 m = c == nv - 1 ? last : (__mmask16)0xffff;
            v[c] = _mm512_maskz_loadu_epi32(m, vr + 16 * c);
        }
        for (int i = 0; i < n; i++) {
            if (kp >= np[i]) continue;
            const uint16_t* pr = S->pb + (r0 + i) * KEYS;
            if (kp == np[i] - 1 && odd[i]) {
                for (int c = 0; c < nv; c++) {
                    __m512i even = _mm512_maskz_mov_epi16((__mmask32)0x55555555u, v[c]);
                    o[i][c] = dp_pair(o[i][c], (__m512bh)even, pr, kp);
                }
            } else {
                for (int c = 0; c < nv; c++) o[i][c] = dp_pair(o[i][c], (__m512bh)v[c], pr, kp);
            }
        }
    }
    for (int i = 0; i < n; i++) {
        float* orow = S->o + (int64_t)(r0 + i) * Dv + d;
        for (int c = 0; c < nv; c++) {
            __mmask16 m = c == nv - 1 ? last : (__mmask16)0xffff;
            _mm512_mask_storeu_ps(orow + 16 * c, m, o[i][c]);
        }
    }
}
#endif

/* rows [r0, r0 + n) of the item, all at positions >= k0: scores, softmax update, outputs */
static inline __attribute__((always_inline)) void attn_rows(
    const attn_t* A, attn_scratch_t* S, int n, int r0, int G, int g, int64_t q0, int64_t pos0,
    int64_t k0) {
    int DP = A->Dqk / 2, Dv = A->Dv;
    const uint16_t* qr[4];
    for (int i = 0; i < n; i++) {
        int r = r0 + i;
        qr[i] = A->q + (q0 + r / G) * A->q_tok + (g * G + r % G) * A->q_head;
        int64_t seen = pos0 + r / G - k0 + 1;
        S->nk[r] = (int)(seen < KEYS ? seen : KEYS);
    }
#if MS_SIMD
    /* scores of keys 0-15 and 16-31 of the block */
    __m512 s[4][2];
    for (int i = 0; i < n; i++) s[i][0] = s[i][1] = _mm512_setzero_ps();
    for (int dp = 0; dp < DP; dp++) {
        __m512bh k0v = (__m512bh)_mm512_loadu_si512(S->kt + dp * KEYS);
        __m512bh k1v = (__m512bh)_mm512_loadu_si512(S->kt + dp * KEYS + 16);
        for (int i = 0; i < n; i++) {
            s[i][0] = dp_pair(s[i][0], k0v, qr[i], dp);
            s[i][1] = dp_pair(s[i][1], k1v, qr[i], dp);
        }
    }
    for (int i = 0; i < n; i++) {
        int r = r0 + i, nk = S->nk[r];
        float* m = &S->ml[2 * r];
        __m512 scale = _mm512_set1_ps(A->scale), ninf = _mm512_set1_ps(-INFINITY);
        __mmask16 m0 = nk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1);
        __mmask16 m1 = nk >= 32 ? (__mmask16)0xffff
                                : (nk > 16 ? (__mmask16)((1u << (nk - 16)) - 1) : (__mmask16)0);
        __m512 s0 = _mm512_mask_mov_ps(ninf, m0, _mm512_mul_ps(s[i][0], scale));
        __m512 s1 = _mm512_mask_mov_ps(ninf, m1, _mm512_mul_ps(s[i][1], scale));
        float mnew = fmaxf(*m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
        __m512 mv = _mm512_set1_ps(mnew);
        /* the weights in bf16 (what the value products take); the sum of the same values */
        __m512bh pb = _mm512_cvtne2ps_pbh(exp512(_mm512_sub_ps(s1, mv)),
                                          exp512(_mm512_sub_ps(s0, mv)));
        __m512i pbits = (__m512i)pb;
        __m512 p0 = _mm512_castsi512_ps(_mm512_slli_epi32(pbits, 16));
        __m512 p1 = _mm512_castsi512_ps(_mm512_and_si512(pbits, _mm512_set1_epi32((int)0xffff0000)));
        /* exp(0) is exactly 1 here: skipping it when the max stays is the same arithmetic */
        float alpha = mnew == *m ? 1.0f : _mm512_cvtss_f32(exp512(_mm512_set1_ps(*m - mnew)));
        __m512 lsum = _mm512_loadu_ps(S->lv + r * 16);
        if (alpha != 1.0f) lsum = _mm512_mul_ps(lsum, _mm512_set1_ps(alpha));
        _mm512_storeu_ps(S->lv + r * 16, _mm512_add_ps(lsum, _mm512_add_ps(p0, p1)));
        *m = mnew;
        S->alpha[r] = alpha;
        /* keys in order: lanes 0-15 of pb are keys 0-15, 16-31 keys 16-31 */
        _mm512_storeu_si512(S->pb + r * KEYS, pbits);
    }
    /* o[r] = o[r] * alpha + sum_j p[r][j] v[j], j ascending, 64 columns and 4 rows at a time */
    for (int d = 0; d < Dv; d += 64) {
        int w = Dv - d < 64 ? Dv - d : 64;
        for (int i0 = 0; i0 < n; i0 += 4) {
            int m = n - i0 < 4 ? n - i0 : 4;
            int nv = (w + 15) / 16;
#define PV(M)                                                        \
    switch (nv) {                                                    \
        case 4: pv_cols(S, M, 4, r0 + i0, d, Dv, w); break;          \
        case 3: pv_cols(S, M, 3, r0 + i0, d, Dv, w); break;          \
        case 2: pv_cols(S, M, 2, r0 + i0, d, Dv, w); break;          \
        default: pv_cols(S, M, 1, r0 + i0, d, Dv, w); break;         \
    }
            switch (m) {
                case 4: PV(4) break;
                case 3: PV(3) break;
                case 2: PV(2) break;
                default: PV(1) break;
            }
#undef PV
        }
    }
#else
    for (int i = 0; i < n; i++) {
        int r = r0 + i, nk = S->nk[r];
        float sc[KEYS], bmax = -INFINITY;
        for (int j = 0; j < KEYS; j++) {
            float acc = 0.0f;
            for (int dp = 0; dp < DP; dp++) {
                uint16_t kp[2];
                memcpy(kp, &S->kt[dp * KEYS + j], 4);
                acc = fmaf(bf16_to_f32(qr[i][2 * dp + 1]), bf16_to_f32(kp[1]), acc);
                acc = fmaf(bf16_to_f32(qr[i][2 * dp]), bf16_to_f32(kp[0]), acc);
            }
            sc[j] = j < nk ? acc * A->scale : -INFINITY;
            bmax = fmaxf(bmax, sc[j]);
        }
        float* m = &S->ml[2 * r];
        float mnew = fmaxf(*m, bmax);
        float alpha = exp_scalar(*m - mnew), bsum = 0.0f;
        float* p = S->p + r * KEYS;
        for (int j = 0; j < KEYS; j++) {
            p[j] = exp_scalar(sc[j] - mnew);
            bsum += p[j];
        }
        S->ml[2 * r + 1] = S->ml[2 * r + 1] * alpha + bsum;
        *m = mnew;
        float* o = S->o + (int64_t)r * Dv;
        for (int d = 0; d < Dv; d++) {
            float ov = o[d] * alpha;
            for (int j = 0; j < nk; j++) ov = fmaf(p[j], S->vf[j * Dv + d], ov);
            o[d] = ov;
        }
    }
#endif
}

static void attn_item(const attn_t* A, attn_scratch_t* S, int64_t b, int g, int64_t q0,
                      int64_t pos0, int npos) {
    int G = A->H / A->KVH, R = npos * G, Dv = A->Dv;
    int64_t last = pos0 + npos - 1;
    for (int r = 0; r < R; r++) {
        S->ml[2 * r] = -INFINITY;
        S->ml[2 * r + 1] = 0.0f;
        memset(S->lv + r * 16, 0, sizeof(float) * 16);
        memset(S->o + (int64_t)r * Dv, 0, sizeof(float) * (size_t)Dv);
    }
    for (int64_t k0 = 0; k0 <= last; k0 += KEYS) {
        int valid = (int)(last - k0 + 1 < KEYS ? last - k0 + 1 : KEYS);
        load_block(A, S, b, g, k0, valid);
        /* rows are ordered by position: those that see this block are a suffix */
        int first = k0 <= pos0 ? 0 : (int)(k0 - pos0) * G;
        for (int r = first; r < R; r += 4) {
            switch (R - r < 4 ? R - r : 4) {
                case 4: attn_rows(A, S, 4, r, G, g, q0, pos0, k0); break;
                case 3: attn_rows(A, S, 3, r, G, g, q0, pos0, k0); break;
                case 2: attn_rows(A, S, 2, r, G, g, q0, pos0, k0); break;
                default: attn_rows(A, S, 1, r, G, g, q0, pos0, k0); break;
            }
        }
    }
    for (int r = 0; r < R; r++) {
        int h = g * G + r % G;
        uint16_t* dst = A->out + (q0 + r / G) * A->o_tok + h * A->o_head;
        const float* o = S->o + (int64_t)r * Dv;
        int d = 0;
#if MS_SIMD
        float l = _mm512_reduce_add_ps(_mm512_loadu_ps(S->lv + r * 16));
        for (; d + 16 <= Dv; d += 16) {
            __m512 v = _mm512_div_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(l));
            _mm256_storeu_si256((__m256i*)(dst + d), (__m256i)_mm512_cvtneps_pbh(v));
        }
        if (d < Dv) {
            __mmask16 m = (__mmask16)((1u << (Dv - d)) - 1);
            __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, o + d), _mm512_set1_ps(l));
            _mm256_mask_storeu_epi16(dst + d, m, (__m256i)_mm512_cvtneps_pbh(v));
        }
#else
        float l = S->ml[2 * r + 1];
        for (; d < Dv; d++) dst[d] = f32_to_bf16(o[d] / l);
#endif
    }
}

/* q [T, H, Dqk] rows at strides (q_tok, q_head); caches addressed through the page table;
 * per sequence b: its first query row q_start[b], q_len[b] new rows, seq_len[b] keys after the
 * step. out [T, H, Dv] at strides (o_tok, o_head). Returns 0, or -1 when a size is unsupported
 * (Dqk odd, H not a multiple of KVH). */
int ms_attention(const uint16_t* q, int64_t q_tok, int64_t q_head, int H, int KVH, int Dqk, int Dv,
                 const uint16_t* kc, const uint16_t* vc, int64_t kv_tok, int64_t k_head,
                 int64_t v_head, const int32_t* table, int64_t table_stride, int page_size,
                 int64_t B, const int64_t* q_start, const int64_t* q_len, const int64_t* seq_len,
                 float scale, uint16_t* out, int64_t o_tok, int64_t o_head, int pos_tile) {
    if (Dqk % 2 || KVH <= 0 || H % KVH || pos_tile <= 0) return -1;
    attn_t A = {q, q_tok, q_head, H, KVH, Dqk, Dv, kc, vc, kv_tok, k_head, v_head,
                table, table_stride, page_size, scale, out, o_tok, o_head};
    int G = H / KVH;
    /* work items: (sequence, KV head, tile of positions) */
    int64_t items = 0;
    for (int64_t b = 0; b < B; b++) items += KVH * ((q_len[b] + pos_tile - 1) / pos_tile);
    int64_t* item_seq = (int64_t*)malloc(sizeof(int64_t) * (size_t)(items + 1));
    int64_t* item_row = (int64_t*)malloc(sizeof(int64_t) * (size_t)(items + 1));
    int* item_head = (int*)malloc(sizeof(int) * (size_t)(items + 1));
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++)
        for (int g = 0; g < KVH; g++)
            for (int64_t i = 0; i < q_len[b]; i += pos_tile) {
                item_seq[n] = b;
                item_row[n] = i;
                item_head[n] = g;
                n++;
            }
    int rows = pos_tile * G;
#pragma omp parallel
    {
        attn_scratch_t S;
        S.kt = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)((Dqk / 2) * KEYS));
        S.vf = (float*)malloc(sizeof(float) * (size_t)(KEYS * Dv));
        S.vp = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(KEYS / 2 * Dv));
        S.pb = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)rows * KEYS);
        S.o = (float*)malloc(sizeof(float) * (size_t)rows * (size_t)Dv);
        S.ml = (float*)malloc(sizeof(float) * (size_t)rows * 2);
        S.lv = (float*)malloc(sizeof(float) * (size_t)rows * 16);
        S.p = (float*)malloc(sizeof(float) * (size_t)rows * KEYS);
        S.alpha = (float*)malloc(sizeof(float) * (size_t)rows);
        S.nk = (int*)malloc(sizeof(int) * (size_t)rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t b = item_seq[it], i = item_row[it];
            int npos = (int)(q_len[b] - i < pos_tile ? q_len[b] - i : pos_tile);
            int64_t pos0 = seq_len[b] - q_len[b] + i;
            attn_item(&A, &S, b, item_head[it], q_start[b] + i, pos0, npos);
        }
        free(S.kt);
        free(S.vf);
        free(S.vp);
        free(S.pb);
        free(S.o);
        free(S.ml);
        free(S.lv);
        free(S.p);
        free(S.alpha);
        free(S.nk);
    }
    free(item_seq);
    free(item_row);
    free(item_head);
    return 0;
}
