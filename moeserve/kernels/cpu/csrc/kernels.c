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
 * from this file's pool (see "threads" below; the count is set by ms_set_threads, not torch).
 *
 * Weight layouts (packed once at load by moeserve/kernels/cpu/pack.py), all in tiles of 16
 * output columns, columns padded to whole tiles:
 *   bf16  [tile][K/2][16][2]        pairs of k per column (what VDPBF16PS reads)
 *   q4    [tile / 4][K/32][tile % 4] blocks of 384 bytes: the codes (4 x 64 bytes, each 4
 *         k-pairs x 16 columns of 4-bit codes, order: see q4_unpack), then 16 fp32 scales d
 *         and 16 fp32 offsets c, so that w = d * (128 + q) + c
 *   q4h   the same in blocks of 320 bytes: the codes, then d and lo as fp16, c = lo - 128 d
 *         (GGUF Q4_1's own scale and minimum, when they are fp16 values)
 *         The blocks of four consecutive tiles alternate group by group, so a one-row GEMM
 *         reads each item's weights as one stream.
 *   i8    [tile][K][16] int8        per-column fp32 scales s: w = s * q
 */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
#define QUAD 4      /* q4: tiles whose blocks alternate */
#define Q4_CODES 256
#define Q4_BLOCK 384  /* codes, d and c in fp32 */
#define Q4H_BLOCK 320 /* codes, d and lo in fp16 */
#ifndef Q4_PREFETCH
#define Q4_PREFETCH 0 /* groups ahead that a q4 GEMM asks the caches for (0: none) */
#endif

int ms_simd(void) { return MS_SIMD; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half -> float, exactly */
static inline float f16_to_f32(uint16_t h) {
    float sign = (h & 0x8000u) ? -1.0f : 1.0f;
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) return sign * ldexpf((float)m, -24);
    if (e == 31) return m ? NAN : sign * INFINITY;
    return sign * ldexpf((float)(m | 0x400), e - 25);
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

/* ---- threads ---------------------------------------------------------------------------------
 * A call's work is split into chunks, each computed whole by whichever thread claims it (which
 * thread never changes a result: every chunk computes its own outputs in its own fixed
 * order). The calling thread claims chunks itself and returns once every chunk is done; the
 * pool's workers join in when they are running. Nothing waits for a worker that has not
 * claimed anything, so a worker that the OS has put aside (other processes, an event loop
 * sharing the cores) delays a call by at most the one chunk it holds: a barrier of a fixed
 * team (OpenMP's) would wait for it at every parallel loop, and a decode step runs hundreds.
 *
 * The claim counter packs the job's generation, its chunk count and the next chunk into one
 * word, so a worker can never claim a chunk of a job other than the one it read. Workers spin
 * for WORKER_SPIN_NS after their last job (the next one usually follows within microseconds),
 * then sleep until woken. One caller uses the pool at a time; another one that finds it busy
 * computes its call alone. */
#define MAX_THREADS 64
#define WORKER_SPIN_NS 200000
#define WAIT_SPIN_NS 20000
#define STALL_MIN_NS 200000
#define STALL_CHUNKS 8
#define MIN_BACKOFF_NS 2000000
#define MAX_BACKOFF_NS 128000000
#define IDX_BITS 20
#define IDX_MASK ((1ull << IDX_BITS) - 1)
#define GEN_SHIFT (2 * IDX_BITS)
#define GUIDED_SHARE 2 /* a chunk is at most 1 / (this * threads) of the units left */

typedef void (*chunk_fn)(void* arg, int64_t chunk, int worker);

static struct {
    pthread_mutex_t owner; /* held by the calling thread that uses the pool */
    pthread_mutex_t lock;  /* guards sleeping workers */
    pthread_cond_t wake;
    /* generation << GEN_SHIFT | units << IDX_BITS | next unit */
    _Alignas(64) _Atomic uint64_t claim;
    _Alignas(64) _Atomic int64_t done; /* units finished in the current generation */
    _Alignas(64) _Atomic(chunk_fn) fn;
    _Atomic(void*) arg;
    _Atomic int64_t items, per; /* the job's items, and how many consecutive ones a unit is */
    _Atomic int joiners;        /* workers 1 .. joiners take part in the current job */
    _Atomic int threads;        /* the job's threads (the caller and its workers) */
    _Atomic int sleepers;
    int workers;        /* worker threads started */
    int64_t solo_until; /* the caller computes alone until then (after a stall) */
    int64_t backoff;    /* how long the next stall makes it do so */
} POOL = {.owner = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .backoff = MIN_BACKOFF_NS};

static _Atomic int THREADS = 1;

void ms_set_threads(int n) { atomic_store(&THREADS, n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* claim and run chunks of the job of generation `gen` until none is left; how many it ran.
 * A chunk is a run of units, a share of what is left (guided scheduling): few claims while
 * much is left, single units at the end so that the threads finish together. */
static int64_t work_on(uint64_t gen, int worker) {
    chunk_fn fn = atomic_load(&POOL.fn);
    void* arg = atomic_load(&POOL.arg);
    int64_t items = atomic_load(&POOL.items), per = atomic_load(&POOL.per);
    uint64_t share = (uint64_t)GUIDED_SHARE * (uint64_t)atomic_load(&POOL.threads);
    uint64_t v = atomic_load(&POOL.claim);
    int64_t ran = 0;
    for (;;) {
        uint64_t units = (v >> IDX_BITS) & IDX_MASK, next = v & IDX_MASK;
        if ((v >> GEN_SHIFT) != gen || next >= units) return ran;
        uint64_t take = (units - next) / share;
        if (take < 1) take = 1;
        if (!atomic_compare_exchange_weak(&POOL.claim, &v, v + take)) continue;
        int64_t end = (int64_t)(next + take) * per < items ? (int64_t)(next + take) * per : items;
        for (int64_t i = (int64_t)next * per; i < end; i++) fn(arg, i, worker);
        atomic_fetch_add(&POOL.done, (int64_t)take);
        ran++;
        v = atomic_load(&POOL.claim);
    }
}

static void* worker_main(void* p) {
    int id = (int)(intptr_t)p;
    uint64_t seen = atomic_load(&POOL.claim) >> GEN_SHIFT;
    for (;;) {
        uint64_t gen = atomic_load(&POOL.claim) >> GEN_SHIFT;
        if (gen != seen) {
            seen = gen;
            if (id <= atomic_load(&POOL.joiners)) work_on(gen, id);
            continue;
        }
        int64_t until = now_ns() + WORKER_SPIN_NS;
        while (atomic_load(&POOL.claim) >> GEN_SHIFT == seen && now_ns() < until)
            for (int i = 0; i < 64; i++) cpu_relax();
        if (atomic_load(&POOL.claim) >> GEN_SHIFT != seen) continue;
        pthread_mutex_lock(&POOL.lock);
        atomic_fetch_add(&POOL.sleepers, 1);
        while (atomic_load(&POOL.claim) >> GEN_SHIFT == seen) pthread_cond_wait(&POOL.wake, &POOL.lock);
        atomic_fetch_sub(&POOL.sleepers, 1);
        pthread_mutex_unlock(&POOL.lock);
    }
    return NULL;
}

/* a forked child has none of the parent's workers: it starts its own */
static void pool_after_fork(void) {
    POOL.workers = 0;
    atomic_store(&POOL.sleepers, 0);
    pthread_mutex_init(&POOL.owner, NULL);
    pthread_mutex_init(&POOL.lock, NULL);
    pthread_cond_init(&POOL.wake, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* workers 1 .. want exist (the caller holds POOL.owner); fewer where threads cannot start */
static void start_workers(int want) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    while (POOL.workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker_main, (void*)(intptr_t)(POOL.workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        POOL.workers++;
    }
}

/* the calling thread waits for chunks that workers hold: spinning, then yielding its core (a
 * worker the OS put aside may be waiting for it) */
static void wait_done(int64_t n) {
    int64_t yield_at = now_ns() + WAIT_SPIN_NS;
    while (atomic_load(&POOL.done) < n) {
        if (now_ns() < yield_at)
            for (int i = 0; i < 16; i++) cpu_relax();
        else
            sched_yield();
    }
}

/* fn(arg, i, worker) for every item i < n, spread over the pool in chunks of consecutive
 * items (see work_on); worker < the thread count (0: the calling thread) names per-thread
 * scratch.
 *
 * When the cores are oversubscribed a worker is sometimes put aside while it holds a chunk,
 * and the caller waits for it: a stall (a wait of more than STALL_CHUNKS of the caller's own
 * chunks and STALL_MIN_NS). After a stall the caller computes its calls alone for `backoff`
 * nanoseconds, then tries its workers again; each further stall doubles the backoff (up to
 * MAX_BACKOFF_NS), and a call without one sets it back to MIN_BACKOFF_NS. */
static void pool_run(chunk_fn fn, void* arg, int64_t n) {
    int threads = atomic_load(&THREADS);
    if (n <= 0) return;
    if (n == 1 || threads == 1 || pthread_mutex_trylock(&POOL.owner)) {
        for (int64_t c = 0; c < n; c++) fn(arg, c, 0);
        return;
    }
    if (POOL.solo_until && now_ns() < POOL.solo_until) {
        for (int64_t c = 0; c < n; c++) fn(arg, c, 0);
        pthread_mutex_unlock(&POOL.owner);
        return;
    }
    start_workers(threads - 1);
    int64_t per = (n + (int64_t)IDX_MASK - 1) / (int64_t)IDX_MASK; /* units fit the counter */
    int64_t chunks = (n + per - 1) / per;                           /* (units) */
    atomic_store(&POOL.fn, fn);
    atomic_store(&POOL.arg, arg);
    atomic_store(&POOL.items, n);
    atomic_store(&POOL.per, per);
    atomic_store(&POOL.threads, threads);
    atomic_store(&POOL.done, 0);
    atomic_store(&POOL.joiners, threads - 1);
    uint64_t gen = (atomic_load(&POOL.claim) >> GEN_SHIFT) + 1;
    gen &= (1ull << (64 - GEN_SHIFT)) - 1;
    atomic_store(&POOL.claim, gen << GEN_SHIFT | (uint64_t)chunks << IDX_BITS);
    if (atomic_load(&POOL.sleepers)) {
        pthread_mutex_lock(&POOL.lock);
        pthread_cond_broadcast(&POOL.wake);
        pthread_mutex_unlock(&POOL.lock);
    }
    int64_t t0 = now_ns();
    int64_t own = work_on(gen, 0);
    int64_t t1 = now_ns();
    wait_done(chunks);
    int64_t waited = now_ns() - t1;
    int64_t per_chunk = own ? (t1 - t0) / own : 0;
    if (waited > STALL_MIN_NS && waited > STALL_CHUNKS * per_chunk) {
        POOL.solo_until = now_ns() + POOL.backoff;
        POOL.backoff = POOL.backoff * 2 > MAX_BACKOFF_NS ? MAX_BACKOFF_NS : POOL.backoff * 2;
    } else {
        POOL.solo_until = 0;
        POOL.backoff = MIN_BACKOFF_NS;
    }
    pthread_mutex_unlock(&POOL.owner);
}

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

/* the block of tile t, group g of a q4 / q4h weight (blocks of `blk` bytes) */
static inline const uint8_t* q4_at(const uint8_t* w, int64_t G, int64_t t, int64_t g, int blk) {
    return w + (((t / QUAD) * G + g) * QUAD + t % QUAD) * blk;
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

/* R rows x C consecutive tiles of a q4 (half: q4h) weight; acc[r * C + c] */
static inline __attribute__((always_inline)) void q4_block(
    int R, int C, int half, const uint16_t* x, int64_t ldx, const float* xs, int64_t G,
    const uint8_t* w, int64_t t0, __m512* acc) {
    int blk = half ? Q4H_BLOCK : Q4_BLOCK;
    for (int i = 0; i < R * C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 s[32];
        for (int i = 0; i < R * C; i++) s[i] = _mm512_setzero_ps();
#if Q4_PREFETCH > 0
        if (g + Q4_PREFETCH < G)
            for (int c = 0; c < C; c++) {
                const char* ahead = (const char*)q4_at(w, G, t0 + c, g + Q4_PREFETCH, blk);
                for (int l = 0; l < blk; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
            }
#endif
        for (int u = 0; u < 4; u++) {
            __m512i v[4][4];
            for (int c = 0; c < C; c++) q4_unpack(q4_at(w, G, t0 + c, g, blk) + u * 64, v[c]);
            for (int e = 0; e < 4; e++) {
                int64_t kp = g * 16 + u * 4 + e;
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < C; c++)
                        s[r * C + c] = dp_pair(s[r * C + c], (__m512bh)v[c][e], x + r * ldx, kp);
            }
        }
        for (int c = 0; c < C; c++) {
            const uint8_t* b = q4_at(w, G, t0 + c, g, blk) + Q4_CODES;
            __m512 dv, cv;
            if (half) {
                dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)b));
                __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + 32)));
                /* 128 d is exact: the same one rounding as c = lo - 128 d in fp32 at load */
                cv = _mm512_sub_ps(lo, _mm512_mul_ps(_mm512_set1_ps((float)Q4_BIAS), dv));
            } else {
                dv = _mm512_loadu_ps((const float*)b);
                cv = _mm512_loadu_ps((const float*)(b + 64));
            }
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

enum { FMT_BF16 = 0, FMT_Q4 = 1, FMT_I8 = 2, FMT_Q4H = 3 };

typedef struct {
    int fmt;
    const void* w;
    const float* a; /* i8: s */
    const float* b;
    int64_t K, N;
} weight_t;

#if MS_SIMD
static inline __attribute__((always_inline)) void run_block(
    int R, int C, const weight_t* W, const uint16_t* x, int64_t ldx, const float* xs, int64_t t0,
    void* y, int64_t ldy, int fp32) {
    __m512 acc[32];
    int64_t K = W->K;
    if (W->fmt == FMT_Q4)
        q4_block(R, C, 0, x, ldx, xs, K / GROUP, (const uint8_t*)W->w, t0, acc);
    else if (W->fmt == FMT_Q4H)
        q4_block(R, C, 1, x, ldx, xs, K / GROUP, (const uint8_t*)W->w, t0, acc);
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
    int half = W->fmt == FMT_Q4H, blk = half ? Q4H_BLOCK : Q4_BLOCK;
    float acc = 0.0f;
    /* column j, k-parity e within vector s of a 64-byte block: see q4_unpack */
    int lane = j / 4, pos = 2 * (j % 4);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t* b = q4_at((const uint8_t*)W->w, G, t, g, blk);
        float s = 0.0f;
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < 4; v++) {
                const uint8_t* q8 = b + u * 64 + lane * 16 + (v & 1) * 8 + pos;
                int64_t kp = g * 16 + u * 4 + v;
                for (int e = 1; e >= 0; e--) {
                    int q = (v < 2) ? (q8[e] & 15) : (q8[e] >> 4);
                    s = fmaf(bf16_to_f32(x[2 * kp + e]), (float)(Q4_BIAS + q), s);
                }
            }
        float d, c;
        if (half) {
            uint16_t h[2];
            memcpy(&h[0], b + Q4_CODES + 2 * j, 2);
            memcpy(&h[1], b + Q4_CODES + 32 + 2 * j, 2);
            d = f16_to_f32(h[0]);
            c = f16_to_f32(h[1]) - (float)Q4_BIAS * d;
        } else {
            memcpy(&d, b + Q4_CODES + 4 * j, 4);
            memcpy(&c, b + Q4_CODES + 64 + 4 * j, 4);
        }
        acc = fmaf(d, s, acc);
        acc = fmaf(c, xs[g], acc);
    }
    return acc;
}
#endif

typedef struct {
    const weight_t* W;
    const uint16_t* x;
    int64_t ldx, M;
    void* y;
    int64_t ldy;
    int fp32;
    const float* xs; /* q4: group sums of x */
    int64_t T, G;    /* column tiles, q4 groups */
} gemm_job_t;

#if MS_SIMD
/* one row: four tiles per chunk (four independent chains in flight) */
static void gemm_row_chunk(void* p, int64_t it, int worker) {
    const gemm_job_t* J = (const gemm_job_t*)p;
    (void)worker;
    int64_t t0 = it * 4;
    if (t0 + 4 <= J->T)
        simd_item(J->W, J->x, J->ldx, J->xs, 1, t0, 4, J->y, J->ldy, J->fp32);
    else
        for (int64_t t = t0; t < J->T; t++)
            simd_item(J->W, J->x, J->ldx, J->xs, 1, t, 1, J->y, J->ldy, J->fp32);
}

/* chunk = (block of ROWS rows, column tile) */
static void gemm_block_chunk(void* p, int64_t c, int worker) {
    const gemm_job_t* J = (const gemm_job_t*)p;
    (void)worker;
    int64_t b = c / J->T, t = c % J->T, m0 = b * ROWS;
    int R = (int)(J->M - m0 < ROWS ? J->M - m0 : ROWS);
    char* yrow = (char*)J->y + m0 * J->ldy * (J->fp32 ? 4 : 2);
    simd_item(J->W, J->x + m0 * J->ldx, J->ldx, J->xs ? J->xs + m0 * J->G : NULL, R, t, 1, yrow,
              J->ldy, J->fp32);
}
#else
/* chunk = (row, column tile) */
static void gemm_generic_chunk(void* p, int64_t c, int worker) {
    const gemm_job_t* J = (const gemm_job_t*)p;
    (void)worker;
    int64_t m = c / J->T, n0 = (c % J->T) * TILE;
    int64_t n1 = n0 + TILE < J->W->N ? n0 + TILE : J->W->N;
    for (int64_t n = n0; n < n1; n++) {
        float v = generic_dot(J->W, J->x + m * J->ldx, J->xs ? J->xs + m * J->G : NULL, n);
        if (J->fp32)
            ((float*)J->y)[m * J->ldy + n] = v;
        else
            ((uint16_t*)J->y)[m * J->ldy + n] = f32_to_bf16(v);
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T; y bf16 (fp32 when y_fp32), row strides ldx / ldy in elements */
static void gemm(const weight_t* W, const uint16_t* x, int64_t ldx, int64_t M, void* y,
                 int64_t ldy, int y_fp32) {
    float* xs = NULL;
    if (W->fmt == FMT_Q4 || W->fmt == FMT_Q4H) {
        xs = (float*)malloc(sizeof(float) * (size_t)(M * (W->K / GROUP) + 1));
        group_sums(x, ldx, M, W->K, xs);
    }
    gemm_job_t J = {W, x, ldx, M, y, ldy, y_fp32, xs, tiles_of(W->N), W->K / GROUP};
#if MS_SIMD
    if (M == 1)
        pool_run(gemm_row_chunk, &J, (J.T + 3) / 4);
    else
        pool_run(gemm_block_chunk, &J, (M + ROWS - 1) / ROWS * J.T);
#else
    pool_run(gemm_generic_chunk, &J, M * J.T);
#endif
    free(xs);
}

void ms_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K,
                  int64_t N, void* y, int64_t ldy, int y_fp32) {
    weight_t W = {FMT_BF16, w, NULL, NULL, K, N};
    gemm(&W, x, ldx, M, y, ldy, y_fp32);
}

void ms_gemm_q4(const uint16_t* x, int64_t ldx, int64_t M, const uint8_t* w, int half, int64_t K,
                int64_t N, void* y, int64_t ldy, int y_fp32) {
    weight_t W = {half ? FMT_Q4H : FMT_Q4, w, NULL, NULL, K, N};
    gemm(&W, x, ldx, M, y, ldy, y_fp32);
}

void ms_gemm_i8(const uint16_t* x, int64_t ldx, int64_t M, const int8_t* w, const float* s,
                int64_t K, int64_t N, void* y, int64_t ldy, int y_fp32) {
    weight_t W = {FMT_I8, w, s, NULL, K, N};
    gemm(&W, x, ldx, M, y, ldy, y_fp32);
}

/* ---- elementwise ----------------------------------------------------------------------- */

typedef struct {
    const uint16_t* g0;
    int64_t ldg;
    const uint16_t* u0;
    int64_t ldu, I;
    uint16_t* out;
    int64_t ldo;
} silu_job_t;

static void silu_row(void* p, int64_t m, int worker) {
    const silu_job_t* J = (const silu_job_t*)p;
    (void)worker;
    int64_t I = J->I;
    const uint16_t* g = J->g0 + m * J->ldg;
    const uint16_t* u = J->u0 + m * J->ldu;
    uint16_t* o = J->out + m * J->ldo;
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

/* rows of a step: on the calling thread below ROWS_PARALLEL, over the pool from there on */
#define ROWS_PARALLEL 16

static void rows_run(chunk_fn fn, void* arg, int64_t M) {
    if (M >= ROWS_PARALLEL)
        pool_run(fn, arg, M);
    else
        for (int64_t m = 0; m < M; m++) fn(arg, m, 0);
}

/* out[m, i] = silu(g[m, i]) * u[m, i], bf16 in and out, fp32 inside (rounded once) */
void ms_silu_mul(const uint16_t* g0, int64_t ldg, const uint16_t* u0, int64_t ldu, int64_t M,
                 int64_t I, uint16_t* out, int64_t ldo) {
    silu_job_t J = {g0, ldg, u0, ldu, I, out, ldo};
    rows_run(silu_row, &J, M);
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

static void scratch_alloc(attn_scratch_t* S, const attn_t* A, int rows) {
    int Dqk = A->Dqk, Dv = A->Dv;
    S->kt = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)((Dqk / 2) * KEYS));
    S->vf = (float*)malloc(sizeof(float) * (size_t)(KEYS * Dv));
    S->vp = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(KEYS / 2 * Dv));
    S->pb = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)rows * KEYS);
    S->o = (float*)malloc(sizeof(float) * (size_t)rows * (size_t)Dv);
    S->ml = (float*)malloc(sizeof(float) * (size_t)rows * 2);
    S->lv = (float*)malloc(sizeof(float) * (size_t)rows * 16);
    S->p = (float*)malloc(sizeof(float) * (size_t)rows * KEYS);
    S->alpha = (float*)malloc(sizeof(float) * (size_t)rows);
    S->nk = (int*)malloc(sizeof(int) * (size_t)rows);
}

static void scratch_free(attn_scratch_t* S) {
    free(S->kt);
    free(S->vf);
    free(S->vp);
    free(S->pb);
    free(S->o);
    free(S->ml);
    free(S->lv);
    free(S->p);
    free(S->alpha);
    free(S->nk);
}

typedef struct {
    const attn_t* A;
    const int64_t* item_seq;
    const int64_t* item_row;
    const int* item_head;
    const int64_t *q_len, *seq_len, *q_start;
    int pos_tile;
    attn_scratch_t scratch[MAX_THREADS]; /* per worker, allocated at its first item */
} attn_job_t;

static void attn_chunk(void* p, int64_t it, int worker) {
    attn_job_t* J = (attn_job_t*)p;
    attn_scratch_t* S = &J->scratch[worker];
    if (!S->kt) scratch_alloc(S, J->A, J->pos_tile * (J->A->H / J->A->KVH));
    int64_t b = J->item_seq[it], i = J->item_row[it];
    int npos = (int)(J->q_len[b] - i < J->pos_tile ? J->q_len[b] - i : J->pos_tile);
    int64_t pos0 = J->seq_len[b] - J->q_len[b] + i;
    attn_item(J->A, S, b, J->item_head[it], J->q_start[b] + i, pos0, npos);
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
    attn_job_t J = {&A, item_seq, item_row, item_head, q_len, seq_len, q_start, pos_tile, {{0}}};
    pool_run(attn_chunk, &J, items);
    for (int w = 0; w < MAX_THREADS; w++)
        if (J.scratch[w].kt) scratch_free(&J.scratch[w]);
    free(item_seq);
    free(item_row);
    free(item_head);
    return 0;
}

/* ---- a pre-norm decoder layer (Llama: GQA attention, RoPE, SwiGLU) in one call -------------
 * What the layer-by-layer path computes, with its roundings: the residual add in bf16
 * (fp32 add, one rounding), RMSNorm as torch's (x * rsqrt(mean(x^2) + eps) * w in fp32,
 * rounded once; the mean in torch's order, see sum_squares), RoPE in bf16 as HF writes it
 * (x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16, cos and sin
 * rounded to bf16 first), then the GEMMs, attention and SiLU * up above. Every part works row
 * by row, so a row's bits stay independent of the batch, the chunking and the threads. */

typedef struct {
    weight_t qkv, o, gate_up, down;
    const uint16_t* norm_in;   /* [hidden] bf16 */
    const uint16_t* norm_post; /* [hidden] bf16 */
    float eps;
    int H, KVH, D;              /* query heads, KV heads, head size */
    int64_t hidden, inter;      /* model and MLP widths */
    uint16_t* kc;               /* K cache [pages, page_size, KVH, D] bf16 */
    uint16_t* vc;               /* V cache, the same layout */
    int page_size;
    float scale;                /* attention's softmax scale */
    const float* cos;           /* [positions, D/2] fp32 (the RoPE tables) */
    const float* sin;
} ms_layer_t;

typedef struct {
    int64_t M;                 /* rows (tokens) of the step */
    const int64_t* positions;  /* [M] */
    const int64_t* slots;      /* [M] cache slot of each row (negative: not written) */
    const int32_t* table;      /* [B, table_stride] pages of each sequence */
    int64_t table_stride, B;
    const int64_t* q_start;    /* [B] first row of each sequence */
    const int64_t* q_len;      /* [B] its rows */
    const int64_t* seq_len;    /* [B] its keys after the step */
    int pos_tile;              /* attention: query positions per work item */
    uint16_t* h;               /* scratch [M, hidden] */
    uint16_t* qkv;             /* scratch [M, (H + 2 KVH) D] */
    uint16_t* att;             /* scratch [M, H D] */
    uint16_t* gu;              /* scratch [M, 2 inter] */
    uint16_t* act;             /* scratch [M, inter] */
} ms_step_t;

static inline uint16_t bf16_mul(uint16_t a, uint16_t b) {
    return f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b));
}

static inline uint16_t bf16_add(uint16_t a, uint16_t b) {
    return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b));
}

/* The sum of x[i]^2 (fp32 squares) in the order of torch's CPU sum over a contiguous fp32 row
 * (ATen's cascade sum, SumKernel.cpp, over vectors of 8 floats: what torch 2.11-2.13 run on
 * AVX2 and AVX-512 CPUs alike), which is what torch's RMSNorm takes the mean of: the norms
 * then match torch's to the bit. Vectors of SUM_LANES are summed SUM_ILP at a time, in
 * cascade levels. */
#define SUM_LANES 8
#define SUM_ILP 4
#define SUM_LEVELS 4
#define SUM_MIN_POWER 4

static int ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1)); }

static inline void add_squares(float* acc, const uint16_t* x) {
    for (int l = 0; l < SUM_LANES; l++) {
        float v = bf16_to_f32(x[l]);
        acc[l] += v * v;
    }
}

static float sum_squares(const uint16_t* x, int64_t n) {
    int64_t nvec = n / SUM_LANES, rows = nvec / SUM_ILP;
    float acc[SUM_LEVELS][SUM_ILP][SUM_LANES];
    memset(acc, 0, sizeof(acc));
    int power = ceil_log2(rows) / SUM_LEVELS;
    if (power < SUM_MIN_POWER) power = SUM_MIN_POWER;
    int64_t step = (int64_t)1 << power, mask = step - 1, i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < SUM_ILP; k++)
                add_squares(acc[0][k], x + (i * SUM_ILP + k) * SUM_LANES);
        for (int lv = 1; lv < SUM_LEVELS; lv++) {
            for (int k = 0; k < SUM_ILP; k++)
                for (int l = 0; l < SUM_LANES; l++) {
                    acc[lv][k][l] += acc[lv - 1][k][l];
                    acc[lv - 1][k][l] = 0.0f;
                }
            if (i & (mask << (lv * power))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < SUM_ILP; k++) add_squares(acc[0][k], x + (i * SUM_ILP + k) * SUM_LANES);
    for (int lv = 1; lv < SUM_LEVELS; lv++)
        for (int k = 0; k < SUM_ILP; k++)
            for (int l = 0; l < SUM_LANES; l++) acc[0][k][l] += acc[lv][k][l];
    for (int64_t v = rows * SUM_ILP; v < nvec; v++) add_squares(acc[0][0], x + v * SUM_LANES);
    for (int k = 1; k < SUM_ILP; k++)
        for (int l = 0; l < SUM_LANES; l++) acc[0][0][l] += acc[0][k][l];
    float s = 0.0f;
    for (int64_t t = nvec * SUM_LANES; t < n; t++) {
        float v = bf16_to_f32(x[t]);
        s += v * v;
    }
    for (int l = 0; l < SUM_LANES; l++) s += acc[0][0][l];
    return s;
}

/* out = RMSNorm(x) * w, one row */
static void rms_row(const uint16_t* x, const uint16_t* w, float eps, int64_t n, uint16_t* out) {
    float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(x[i]) * r * bf16_to_f32(w[i]));
}

typedef struct {
    const uint16_t* x;
    uint16_t* res;
    int first;
    const uint16_t* w;
    float eps;
    int64_t N;
    uint16_t* out;
} norm_job_t;

static void add_rmsnorm_row(void* p, int64_t m, int worker) {
    const norm_job_t* J = (const norm_job_t*)p;
    (void)worker;
    int64_t N = J->N;
    const uint16_t* xr = J->x + m * N;
    uint16_t* rr = J->res + m * N;
    if (J->first)
        memcpy(rr, xr, sizeof(uint16_t) * (size_t)N);
    else
        for (int64_t i = 0; i < N; i++) rr[i] = bf16_add(xr[i], rr[i]);
    rms_row(rr, J->w, J->eps, N, J->out + m * N);
}

/* res = x (first layer) or bf16(x + res); out = RMSNorm(res) * w; rows of N */
static void add_rmsnorm(const uint16_t* x, uint16_t* res, int first, const uint16_t* w, float eps,
                        int64_t M, int64_t N, uint16_t* out) {
    norm_job_t J = {x, res, first, w, eps, N, out};
    rows_run(add_rmsnorm_row, &J, M);
}

/* RoPE (halves rotated) on one head in place: cos/sin of its position, D/2 each */
static void rope_head(uint16_t* p, const float* cs, const float* sn, int D) {
    int half = D / 2;
    for (int i = 0; i < half; i++) {
        uint16_t c = f32_to_bf16(cs[i]), s = f32_to_bf16(sn[i]);
        uint16_t ns = s ^ 0x8000u; /* -sin, exactly */
        uint16_t x1 = p[i], x2 = p[i + half];
        p[i] = bf16_add(bf16_mul(x1, c), bf16_mul(x2, ns));
        p[i + half] = bf16_add(bf16_mul(x2, c), bf16_mul(x1, s));
    }
}

typedef struct {
    const ms_layer_t* L;
    const ms_step_t* S;
} layer_job_t;

/* RoPE on a row's q and k heads, then its k and v into the caches */
static void rope_and_cache_row(void* p, int64_t m, int worker) {
    const ms_layer_t* L = ((const layer_job_t*)p)->L;
    const ms_step_t* S = ((const layer_job_t*)p)->S;
    (void)worker;
    int D = L->D, KVH = L->KVH;
    int64_t width = (int64_t)(L->H + 2 * KVH) * D, kv_tok = (int64_t)KVH * D;
    uint16_t* row = S->qkv + m * width;
    const float* cs = L->cos + S->positions[m] * (D / 2);
    const float* sn = L->sin + S->positions[m] * (D / 2);
    for (int h = 0; h < L->H + KVH; h++) rope_head(row + (int64_t)h * D, cs, sn, D);
    int64_t slot = S->slots[m];
    if (slot < 0) return;
    memcpy(L->kc + slot * kv_tok, row + (int64_t)L->H * D, sizeof(uint16_t) * (size_t)kv_tok);
    memcpy(L->vc + slot * kv_tok, row + (int64_t)(L->H + KVH) * D,
           sizeof(uint16_t) * (size_t)kv_tok);
}

/* x [M, hidden]: in, the previous layer's MLP output (the embeddings when `first`); out, this
 * layer's. res [M, hidden]: the residual stream, updated. Returns 0, or -1 when a size is
 * unsupported. */
int ms_decoder_layer(const ms_layer_t* L, const ms_step_t* S, uint16_t* x, uint16_t* res,
                     int first) {
    int64_t M = S->M, hidden = L->hidden, I = L->inter;
    int H = L->H, KVH = L->KVH, D = L->D;
    int64_t width = (int64_t)(H + 2 * KVH) * D, kv_tok = (int64_t)KVH * D;
    if (D % 2 || KVH <= 0 || H % KVH) return -1;
    add_rmsnorm(x, res, first, L->norm_in, L->eps, M, hidden, S->h);
    gemm(&L->qkv, S->h, hidden, M, S->qkv, width, 0);
    layer_job_t J = {L, S};
    rows_run(rope_and_cache_row, &J, M);
    int rc = ms_attention(S->qkv, width, D, H, KVH, D, D, L->kc, L->vc, kv_tok, D, D, S->table,
                          S->table_stride, L->page_size, S->B, S->q_start, S->q_len, S->seq_len,
                          L->scale, S->att, (int64_t)H * D, D, S->pos_tile);
    if (rc) return rc;
    gemm(&L->o, S->att, (int64_t)H * D, M, x, hidden, 0);
    add_rmsnorm(x, res, 0, L->norm_post, L->eps, M, hidden, S->h);
    gemm(&L->gate_up, S->h, hidden, M, S->gu, 2 * I, 0);
    ms_silu_mul(S->gu, 2 * I, S->gu + I, 2 * I, M, I, S->act, I);
    gemm(&L->down, S->act, I, M, x, hidden, 0);
    return 0;
}

/* out = RMSNorm(bf16(x + res)) * w and res = bf16(x + res): the model's last norm */
void ms_add_rmsnorm(const uint16_t* x, uint16_t* res, const uint16_t* w, float eps, int64_t M,
                    int64_t N, uint16_t* out) {
    add_rmsnorm(x, res, 0, w, eps, M, N, out);
}
