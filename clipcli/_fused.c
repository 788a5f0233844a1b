/* Fused loops for clipcli's core: the sums of a block of values in one fixed order, at any vector width.
 *
 * Every sum here is taken in eight lanes: lane j adds the terms j, j + 8, j + 16, ... in turn (a row's last
 * terms, past a multiple of 8, go to the lanes 0, 1, ... as they come), then the lanes are added as
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). That order is all there is to the bits of a sum: the
 * same whether a build's vectors hold 2 or 4 doubles. Contracting a * b + c into one fused multiply-add
 * would change the bits; the build turns it off (-ffp-contract=off).
 *
 * Values are float64 rows (row_dots) or rows of one of three kinds, widened exactly to float64 as they are
 * read (from any address: loads go through memcpy): 0, float32 (an 'f' buffer); 1, bfloat16 and 2, float16, given as their bits (an 'H' buffer). Rows of
 * a kind hold a multiple of 8 values; the number of rows is that of the output's sums.
 *
 * row_dots(x, y, out): out[r] = the sum of x[r, i] * y[r, i] over float64 rows.
 * square_sums(x, out, kind) -> peak: out[r] = the sum of x*x over row r; the peak is the largest |x| (NaN
 *   aside: a NaN or inf makes its row's sum NaN or inf).
 * pair_sums(a, b, out, kind_a, kind_b) -> (changed, top): out[r] = (sum d*d, sum a*a, sum b*b, sum a*b)
 *   over rows r of A and B, with d = a - b in float64 (rounded once at most: exact unless a and b lie
 *   some 29 binades apart); returns how many d are not 0 and the largest |d|. For finite values: NaN or inf in a row makes its sums NaN or inf, and the counts
 *   are then of no use.
 * stats_f32(x, out, errors, start[, wide]): the statistics of float32 values, exact where they are counts and
 *   sums, added into `out` (int64); float64 rows of nine sums per block into `errors` (see stats_f32's section).
 * exact_columns(sums, cols) -> list: the exact sum of each column of stats_f32's error rows, as (integer, exponent).
 * crc32(data[, value[, level]]) -> int: zlib.crc32(data, value), of any buffer, by carry-less multiplication
 *   where the machine has it (see crc32's section; CRC32_LEVEL says which loop it runs).
 * All release the GIL while they run (crc32 from 4 KiB on).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int64_t v4i __attribute__((vector_size(32)));
typedef uint16_t v4h __attribute__((vector_size(8)));
typedef uint32_t v4u __attribute__((vector_size(16)));

/* A build for the machine's widest vectors where the compiler can pick one at load time. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

static inline double lanes_sum(v4d p, v4d q) {
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((q[0] + q[1]) + (q[2] + q[3]));
}

static inline v4d load64(const double *p) {
    v4d v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* float32 values as float64, by element: GCC 12 makes one vcvtps2pd of this, but splits __builtin_convertvector. */
static inline v4d widen(v4u bits) {
    v4f f;
    memcpy(&f, &bits, sizeof f);
    return (v4d){f[0], f[1], f[2], f[3]};
}

static inline v4u load_bits16(const void *p, Py_ssize_t i) {
    v4h h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return __builtin_convertvector(h, v4u);
}

/* Four values at p[i], as float64, of each kind. */
static inline v4d load_f32(const void *p, Py_ssize_t i) {
    v4f f;
    memcpy(&f, (const float *)p + i, sizeof f); /* the values may lie anywhere: an .npz member, say */
    return (v4d){f[0], f[1], f[2], f[3]};
}

static inline v4d load_bf16(const void *p, Py_ssize_t i) { return widen(load_bits16(p, i) << 16); }

/* float16's exponent and mantissa, moved into float32's place, are those of x * 2**-112 (the biases differ
 * by 112; subnormals included), exactly; inf and NaN get float32's exponent of ones. Then times 2**112. */
static inline v4d load_f16(const void *p, Py_ssize_t i) {
    v4u u = load_bits16(p, i), m = u & 0x7FFF;
    v4u special = (v4u)(m >= 0x7C00);
    return widen(((u & 0x8000) << 16) | (m << 13) | (special & 0x70000000)) * 0x1p112;
}

static inline v4d magnitude(v4d x) { return (v4d)((v4i)x & 0x7FFFFFFFFFFFFFFF); }

static inline v4d larger(v4d a, v4d b) {
    v4i m = a > b;
    return (v4d)((m & (v4i)a) | (~m & (v4i)b));
}

static inline double largest(v4d v) {
    double top = 0.0;
    for (int j = 0; j < 4; j++)
        top = v[j] > top ? v[j] : top;
    return top;
}

CLONES static void dot_rows(const double *x, const double *y, double *out, Py_ssize_t rows, Py_ssize_t cols) {
    Py_ssize_t main = cols - cols % 8;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const double *a = x + r * cols, *b = y + r * cols;
        v4d p = {0}, q = {0};
        for (Py_ssize_t i = 0; i < main; i += 8) {
            p += load64(a + i) * load64(b + i);
            q += load64(a + i + 4) * load64(b + i + 4);
        }
        for (Py_ssize_t i = main; i < cols; i++) {
            double u, v;
            memcpy(&u, a + i, sizeof u);
            memcpy(&v, b + i, sizeof v);
            double t = u * v;
            if (i - main < 4)
                p[i - main] += t;
            else
                q[i - main - 4] += t;
        }
        out[r] = lanes_sum(p, q);
    }
}

typedef double (*square_fn)(const void *, double *, Py_ssize_t, Py_ssize_t);

#define SQUARES(NAME, LOAD)                                                                                    \
    CLONES static double NAME(const void *x, double *out, Py_ssize_t rows, Py_ssize_t cols) {                  \
        v4d peak = {0};                                                                                        \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            v4d p = {0}, q = {0};                                                                              \
            for (Py_ssize_t i = r * cols; i < (r + 1) * cols; i += 8) {                                        \
                v4d u = LOAD(x, i), v = LOAD(x, i + 4);                                                        \
                p += u * u;                                                                                    \
                q += v * v;                                                                                    \
                peak = larger(larger(magnitude(u), magnitude(v)), peak);                                       \
            }                                                                                                  \
            out[r] = lanes_sum(p, q);                                                                          \
        }                                                                                                      \
        return largest(peak);                                                                                  \
    }

SQUARES(squares_f32, load_f32)
SQUARES(squares_bf16, load_bf16)
SQUARES(squares_f16, load_f16)
static const square_fn SQUARE_ROWS[3] = {squares_f32, squares_bf16, squares_f16};

typedef int64_t (*pair_fn)(const void *, const void *, double *, Py_ssize_t, Py_ssize_t, double *);

#define PAIRS(NAME, LOAD_A, LOAD_B)                                                                            \
    CLONES static int64_t NAME(const void *x, const void *y, double *out, Py_ssize_t rows, Py_ssize_t cols,     \
                               double *top) {                                                                  \
        v4i changed = {0};                                                                                     \
        v4d peak = {0};                                                                                        \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            v4d dd0 = {0}, dd1 = {0}, aa0 = {0}, aa1 = {0}, bb0 = {0}, bb1 = {0}, ab0 = {0}, ab1 = {0};         \
            for (Py_ssize_t i = r * cols; i < (r + 1) * cols; i += 8) {                                        \
                v4d u0 = LOAD_A(x, i), u1 = LOAD_A(x, i + 4), v0 = LOAD_B(y, i), v1 = LOAD_B(y, i + 4);        \
                v4d d0 = u0 - v0, d1 = u1 - v1;                                                                \
                dd0 += d0 * d0;                                                                                \
                dd1 += d1 * d1;                                                                                \
                aa0 += u0 * u0;                                                                                \
                aa1 += u1 * u1;                                                                                \
                bb0 += v0 * v0;                                                                                \
                bb1 += v1 * v1;                                                                                \
                ab0 += u0 * v0;                                                                                \
                ab1 += u1 * v1;                                                                                \
                peak = larger(larger(magnitude(d0), magnitude(d1)), peak);                                     \
                changed -= d0 != 0; /* a true comparison is -1 */                                              \
                changed -= d1 != 0;                                                                            \
            }                                                                                                  \
            out[4 * r] = lanes_sum(dd0, dd1);                                                                  \
            out[4 * r + 1] = lanes_sum(aa0, aa1);                                                              \
            out[4 * r + 2] = lanes_sum(bb0, bb1);                                                              \
            out[4 * r + 3] = lanes_sum(ab0, ab1);                                                              \
        }                                                                                                      \
        *top = largest(peak);                                                                                  \
        return changed[0] + changed[1] + changed[2] + changed[3];                                              \
    }

PAIRS(pairs_f32_f32, load_f32, load_f32)
PAIRS(pairs_f32_bf16, load_f32, load_bf16)
PAIRS(pairs_f32_f16, load_f32, load_f16)
PAIRS(pairs_bf16_f32, load_bf16, load_f32)
PAIRS(pairs_bf16_bf16, load_bf16, load_bf16)
PAIRS(pairs_bf16_f16, load_bf16, load_f16)
PAIRS(pairs_f16_f32, load_f16, load_f32)
PAIRS(pairs_f16_bf16, load_f16, load_bf16)
PAIRS(pairs_f16_f16, load_f16, load_f16)
static const pair_fn PAIR_ROWS[3][3] = {
    {pairs_f32_f32, pairs_f32_bf16, pairs_f32_f16},
    {pairs_bf16_f32, pairs_bf16_bf16, pairs_bf16_f16},
    {pairs_f16_f32, pairs_f16_bf16, pairs_f16_f16},
};

/* A C-contiguous buffer of native `format` ('d', 'f', 'H', or 'q': int64); writable if asked. */
static int get_buffer(PyObject *obj, Py_buffer *view, const char *format, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format;
    if (f[0] == '@' || f[0] == '=')
        f++;
    if (format[0] == 'q' && (f[0] == 'l' || f[0] == 'q') && f[1] == 0 && view->itemsize == 8)
        return 0; /* an int64 buffer: 'l' or 'q' by platform */
    if (strcmp(f, format) != 0 || view->itemsize != (format[0] == 'd' ? 8 : format[0] == 'f' ? 4 : 2)) {
        PyErr_Format(PyExc_TypeError, "expected a contiguous buffer of format '%s', got '%s'", format, view->format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The buffers of n objects in their formats, the last one writable; on failure none is held. */
static int get_buffers(int n, PyObject *const *objs, const char *const *formats, Py_buffer *views) {
    for (int i = 0; i < n; i++)
        if (get_buffer(objs[i], &views[i], formats[i], i == n - 1) < 0) {
            while (i--)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    return 0;
}

static void release_buffers(int n, Py_buffer *views) {
    for (int i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

/* --- stats_f32 ----------------------------------------------------------------------------------------
 *
 * One pass over float32 values, given as their bits u (a magnitude bits: u & 0x7FFFFFFF; E = u >> 23 & 0xFF,
 * the biased exponent; the significand m = u & 0x7FFFFF, with 1 << 23 added where E > 0, so that a finite
 * value is +-m * 2**(max(E, 1) - 150)). Added into `out` (int64, STATS_LEN: a running total over calls;
 * fresh, it holds zeros but for the smallest value, +inf's bits, the largest, -inf's, and the peak, -1):
 *   [0, 256)      values per E (E = 0: zeros and subnormals; 255: inf and NaN);
 *   [256, 512)    per E, the sum of +-m (int64: exact for 2**39 values; the AVX-512 loop's shares differ,
 *                 see below: only the total, the sum over E of these times 2**(max(E, 1) - 150), is the contract);
 *   [512, 768), [768, 1024): per E, the sum of m*m, its low and high 64 bits (an unsigned 128-bit sum; the
 *                 total as for the sums);
 *   [1024, 1047)  subnormals by the bit length of m, less one (k: m in [2**k, 2**(k + 1)));
 *   then NaN, +inf, -inf, zeros (+-0), subnormals; the float32 bits of the smallest and the largest value
 *   (NaN aside); the largest magnitude's bits and its first flat index (`start` is the first value's; the
 *   one seen first is kept on a tie, whatever the order of the calls); then per cast target (float16,
 *   bfloat16, float8_e4m3fn, float8_e5m2, in turn): the finite values that overflow, the non-zero values
 *   that flush to zero, the values that land subnormal.
 * The sums go through bins keyed by u >> 23 (sign and E) of the fractions f = u & 0x7FFFFF, in four copies
 * (value i to copy i % 4, so that runs of one binade do not wait on one another; the copies lie a padded row
 * apart, so that one key's four bins do not share an address's low 12 bits): per bin, side by side, the
 * count and the sum of f packed as count * 2**41 + sum, and the sum of f * f (added from scalar registers,
 * whose ports the vector work leaves free, in both loops); every
 * 2**18 values (2**16 a copy) they are emptied into the totals per E, the implicit bit added
 * ((f + 2**23)**2 = f**2 + 2**24 f + 2**46) and the sign applied.
 * Casts round to nearest even: a target's threshold on the magnitude bits decides each count; float16's,
 * float8_e4m3fn's and float8_e5m2's flush thresholds are normal powers of two, so that the values at or below
 * one are the subnormals, the values per E below its (the counts above) and the values exactly at it (exact
 * powers of two, found by one test of a group of sixteen and counted one by one: rare). The rounded
 * value r is (|x| + C) - C in float32, C = 2**(max(e, the target's smallest normal exponent) + 24 - p) (p:
 * the target's precision): float32's own rounding at C's last place. Where C would overflow (a vector with
 * a value above 464 goes the slow way, with masks) r is taken from the bits instead (RNE by integer
 * addition, carries into the exponent included). |x| - r is exact in float32, its square in float64. Per block of BLOCK values (the input starts a block)
 * `errors` gets a row (the last block may be shorter), each sum in the eight lanes' order of the header:
 *   [0] the sum of x*x over the values of magnitude 464 or less (float8_e4m3fn's overflow lies above: no
 *       target's overflows one of them);
 *   [1 + t] the sum of (|x| - r)**2 for target t over the values that do not overflow it;
 *   [5 + t] the sum of x*x over the values above 464 that do not overflow target t (so that the norm of
 *       those a target keeps is the exact sum of two sums of non-negative terms: no cancellation).
 * Two loops give these, to the bit: the generic one, eight values at a time, and, where the machine has
 * AVX-512 (and `wide` is true, as by default), stats_run_avx512 for runs of whole groups of sixteen
 * ordinary values (no NaN, inf or value above 464), in the generic loop's place. It adds into the same
 * sums in the same order (a fused multiply-add of an exact square rounds once, as the addition does), keeps
 * counts, extremes and bfloat16's counts of its own, added in at the end, and takes its zeros as the bins'
 * values of E = 0, less the subnormals and the generic loop's zeros. Its exact sums differ in form only:
 * the values of a block's window (the exponent fields from its largest's, 464's at most, less WINDOW; and
 * zeros; where the loop took the block before whole and its largest lay within a binade of the one before's,
 * from that block's largest's a binade up instead, with no pass over the block to find its own: the loop
 * stops at a value above the window, and the rest of the block takes the window of its own largest) are
 * summed, x and x*x, in float64 lanes, exactly (see open_window), and added to the totals per E at the
 * window's least field (x's sum as three signed 24-bit digits, 24 fields apart); only the values below the
 * window go to the bins. Every value is counted by its place in the window (E - least + 1; 0 below it, zeros
 * included), two at a time: a tally of pairs of places, one 32-bit addition a pair from scalar registers,
 * read a group late (its places stored from a vector, not forwarded) and emptied into the counts per E at the
 * block's end (see close_window). So the two loops give the same counts, error sums and exact totals of x and
 * x*x, but not the same shares of those totals per E (the totals are what the sums per E are for). A block
 * after one with more than SPREAD values below its window (values spread over many binades, which the
 * window's rare path would take one at a time) takes the bins for every value instead.
 */
#define STATS_BLOCK 8192
#define TARGETS 4
#define SUBNORMAL_BINS 23
enum {
    OUT_COUNTS = 0, OUT_SUMS = 256, OUT_SQ_LO = 512, OUT_SQ_HI = 768, OUT_SUBNORMAL = 1024,
    OUT_NAN = OUT_SUBNORMAL + SUBNORMAL_BINS, OUT_POSINF, OUT_NEGINF, OUT_ZEROS, OUT_SUBNORMALS, OUT_MIN, OUT_MAX,
    OUT_PEAK, OUT_PEAK_AT, OUT_CASTS, STATS_LEN = OUT_CASTS + 3 * TARGETS,
};
#define ERROR_SUMS 9
#define COPIES 4 /* copies of the bins: value i to copy i % 4, so that runs of one binade do not wait on one another */
#define FLUSH_VALUES (1 << 18) /* 2**16 a copy: the sums of f * f stay below 2**62 */
#define WINDOW 18       /* the AVX-512 loop's window: the exponent fields from a block's largest's less 18 on */
#define SPREAD (STATS_BLOCK / 16) /* a block with more values below its window takes the bins (see stats_run) */
#define WINDOW_SPLIT 43 /* its x*x split at 2**43 units: both parts' sums exact in float64 lanes (see open_window) */

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));

/* Per target, float32 magnitude bits: dropped bits of a normal value; the smallest normal (0: none below
 * float32's own); C; overflow from; flush up to; normal from (checked against ml_dtypes by the tests). */
static const uint32_t DROP[TARGETS] = {13, 16, 20, 21};
static const uint32_t TINY[TARGETS] = {0x38800000, 0x800000, 0x3C800000, 0x38800000};
static const uint32_t OVER[TARGETS] = {0x477FF000, 0x7F7F8000, 0x43E80001, 0x47700000};
static const uint32_t FLUSH[TARGETS] = {0x33000000, 0x8000, 0x3A800000, 0x37000000};
static const uint32_t NORMAL[TARGETS] = {0x387FE000, 0x7F8000, 0x3C700000, 0x38600000};
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define STATS_CLONES __attribute__((target_clones("avx2", "default")))
#define STATS_AVX512 1 /* with a faster loop for machines that have it (see stats_run_avx512) */
#else
#define STATS_CLONES
#define STATS_AVX512 0
#endif
#define OVER_LEAST 0x43E80001u /* float8_e4m3fn's */

typedef struct {
    /* by u >> 23 (sign and E): the count and the sum of f packed, and the sum of f * f, side by side */
    uint64_t pairs[COPIES][512 + 4][2] __attribute__((aligned(16)));
    uint32_t tally[2][32 * 32]; /* the AVX-512 loop's counts of pairs of values by their places in the window */
    int64_t counts[256], sums[256];
    unsigned __int128 square_sums[256];
    int64_t subnormal[SUBNORMAL_BINS];
} stats_bins;

/* Whether any lane of a mask is set (one test of the whole vector, not eight extractions). */
static inline int any_lane(v8i m) {
    uint64_t w[4];
    memcpy(w, &m, sizeof w);
    return (w[0] | w[1] | w[2] | w[3]) != 0;
}

static inline v8i select8(v8i m, v8i a, v8i b) { return (m & a) | (~m & b); }
static inline v8u select8u(v8i m, v8u a, v8u b) { return ((v8u)m & a) | (~(v8u)m & b); }

/* Eight float64 lanes (one AVX-512 register; two AVX2 ones): lane j adds the terms j, j + 8, ... */
typedef double v8d __attribute__((vector_size(64)));

static inline v8d widen8(v8f f) { return (v8d){f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]}; }

static inline double lanes8(v8d a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

/* Empties the bins of fractions f = u & 0x7FFFFF into the totals of significands m = f + 2**23 (E > 0) or f. */
static void empty_bins(stats_bins *b) {
    for (int c = 0; c < COPIES; c++)
        for (int key = 0; key < 512; key++) {
            int e = key & 0xFF;
            if (!b->pairs[c][key][0]) /* no value (the AVX-512 loop leaves most bins empty) */
                continue;
            int64_t v = (int64_t)b->pairs[c][key][0], n = v >> 41, f = v & (((int64_t)1 << 41) - 1), m = f;
            unsigned __int128 q = b->pairs[c][key][1];
            if (e > 0) { /* (f + 2**23)**2 = f**2 + 2**24 f + 2**46 */
                m += n << 23;
                q += ((unsigned __int128)f << 24) + ((unsigned __int128)n << 46);
            }
            b->counts[e] += n;
            b->sums[e] += key >> 8 ? -m : m;
            b->square_sums[e] += q;
            b->pairs[c][key][0] = b->pairs[c][key][1] = 0;
        }
}

/* Adds k values to the bins of their sign and exponent field (u >> 23): the count and the sum of the
 * fractions f = u & 0x7FFFFF packed as n * 2**41 + sum f (below 2**41), and the sum of f * f. */
static inline __attribute__((always_inline)) void add_to_bins(stats_bins *bins, const float *x, int k) {
    for (int j = 0; j < k; j++) {
        uint32_t b;
        memcpy(&b, x + j, sizeof b);
        uint64_t f = b & 0x7FFFFF;
        bins->pairs[j & 3][b >> 23][0] += f + ((uint64_t)1 << 41);
        bins->pairs[j & 3][b >> 23][1] += f * f;
    }
}

/* The squares of eight float32 values x8 added into the eight lanes of acc. */
#define ADD_SQUARES(acc, x8)                                                                                   \
    do {                                                                                                       \
        v8d w_ = widen8(x8);                                                                                   \
        acc += w_ * w_;                                                                                        \
    } while (0)

/* What the AVX-512 loop keeps between its runs: the block's sums (taken in and given back, in the generic
 * loop's order) and its own counts, extremes and bfloat16's counts (added to the generic loop's at the end). */
typedef struct {
    v8d base, err[TARGETS];
    v16i normal[TARGETS]; /* below a threshold: zeros included */
    v16f lo, hi;          /* the block's (its largest magnitude is the larger of theirs: see stats_loop) */
    v16i peak;            /* that, per lane, at its end (-1: none) */
    int64_t flush1, normal1;
    int64_t powers[TARGETS]; /* the values exactly at a flush threshold (not bfloat16's: see stats_loop) */
    v8d sum, high, low; /* the block's window: sum of x; sum of x*x as high + low parts (see the AVX-512 loop) */
    double magic;       /* 1.5 * 2**(52 + WINDOW_SPLIT) units of x*x */
    int32_t below;      /* (the window's least exponent field << 23) - 2: magnitudes m with m - 1 above it lie in it */
    int32_t least;      /* that exponent field */
    int32_t limit;      /* the largest magnitude bits in the window (464's at most): the checked loop stops above */
    int64_t below_count; /* the block's values below the window */
    int64_t spread;      /* those, counted whether or not the window was used */
} stats_lanes;

/* The subnormals among sixteen magnitudes (a mask `is_sub` of them): their bins by bit length, and
 * bfloat16's counts (its thresholds lie among float32's subnormals). */
static inline void count_subnormals(stats_lanes *s, stats_bins *bins, const int32_t *mag, uint32_t is_sub) {
    for (; is_sub; is_sub &= is_sub - 1) {
        int32_t m = mag[__builtin_ctz(is_sub)];
        bins->subnormal[31 - __builtin_clz(m)]++;
        s->flush1 += m < (int32_t)FLUSH[1] + 1;
        s->normal1 += m < (int32_t)NORMAL[1];
    }
}

#if STATS_AVX512
#include <immintrin.h>

/* The AVX-512 loop's constants, read from memory (a broadcast is a load there): GCC would rather make each
 * one again from an immediate, on the port the vectors need most. */
enum { K_FLUSH = 0, K_NORMAL = 4, K_TINY = 8, K_DROP = 12, K_ABS = 16, K_EXPONENT, K_FRACTION, K_ONE, K_DROP3,
       K_NORMAL_LEAST, K_POWER, K_LEN };
static const int32_t STATS_K[K_LEN] = {
    [K_FLUSH] = 0x33000001, 0x8001, 0x3A800001, 0x37000001, /* FLUSH + 1 */
    [K_NORMAL] = 0x387FE000, 0x7F8000, 0x3C700000, 0x38600000,
    [K_TINY] = 0x38800000, 0x800000, 0x3C800000, 0x38800000,
    [K_DROP] = 13 << 23, 16 << 23, 20 << 23, 21 << 23,
    [K_ABS] = 0x7FFFFFFF, 0x7F800000, 0x7FFFFF, 1, (21 - 13) << 23, /* float8_e5m2's DROP less float16's */
    0x800000, 0x807FFFFF, /* the least normal; a sign bit and a fraction: 0 of a normal power of two less it */
};
#define K(i) _mm512_set1_epi32(k[i])

/* C's bits of target T, from the magnitudes' exponent bits (see the section's header) */
#define AVX512_C(T) _mm512_add_epi32(_mm512_max_epi32(expo, K(K_TINY + T)), K(K_DROP + T))

/* Adds the squares of the sixteen residues of target T, rounded at C (its bits), to its error sums. */
#define AVX512_ERROR(T, C)                                                                                     \
    do {                                                                                                       \
        __m512 c_ = _mm512_castsi512_ps(C);                                                                    \
        __m512 d_ = _mm512_sub_ps(fm, _mm512_sub_ps(_mm512_add_ps(fm, c_), c_));                               \
        __m512d a_ = _mm512_cvtps_pd(_mm512_castps512_ps256(d_)), b_ = _mm512_cvtps_pd(_mm512_extractf32x8_ps(d_, 1)); \
        err##T = _mm512_fmadd_pd(a_, a_, err##T); /* a_ * a_ is exact: one rounding, as without the fma */    \
        err##T = _mm512_fmadd_pd(b_, b_, err##T);                                                              \
    } while (0)

#define AVX512_BELOW(T) \
    normal##T = _mm512_mask_add_epi32(normal##T, _mm512_cmplt_epi32_mask(mag, K(K_NORMAL + T)), normal##T, one)

/* The values of a group exactly at a flush threshold of float16, float8_e4m3fn or float8_e5m2 (each a power of
 * two) among those that are (a mask `twos` of them): the values at or below one are those, and those of lesser
 * exponent fields, which the bins count (see stats_loop). */
static void count_powers(stats_lanes *s, const int32_t *mag, uint32_t twos) {
    for (; twos; twos &= twos - 1) {
        int32_t m = mag[__builtin_ctz(twos)];
        for (int t = 0; t < TARGETS; t++)
            s->powers[t] += t != 1 && m == (int32_t)FLUSH[t];
    }
}

/* The lanes given back (and the last group's places tallied). */
#define STORE_LANES() \
    if (pending) \
        for (int j = 0; j < 16; j += 2) \
            bins->tally[j >> 1 & 1][places[(~i >> 4 & 1) * 16 + j]]++; \
    s->sum = (v8d)sum; \
    s->high = (v8d)high; \
    s->low = (v8d)low; \
    s->base = (v8d)base; \
    s->err[0] = (v8d)err0; \
    s->err[1] = (v8d)err1; \
    s->err[2] = (v8d)err2; \
    s->err[3] = (v8d)err3; \
    s->normal[0] = (v16i)normal0; \
    s->normal[2] = (v16i)normal2; \
    s->normal[3] = (v16i)normal3; \
    s->lo = (v16f)lo; \
    s->hi = (v16f)hi;

/* Adds the values of a group of sixteen below the window (a mask `below` of them) to the bins as the generic
 * loop does (they are tallied too, in place 0 of the window: see close_window). */
static void below_window(stats_bins *bins, const float *x, uint32_t below) {
    for (; below; below &= below - 1) {
        int j = __builtin_ctz(below);
        uint32_t b;
        memcpy(&b, x + j, sizeof b);
        uint64_t f = b & 0x7FFFFF;
        bins->pairs[j & 3][b >> 23][0] += f + ((uint64_t)1 << 41);
        bins->pairs[j & 3][b >> 23][1] += f * f;
    }
}

/* The generic loop's work for whole groups of sixteen values from i while none is NaN, inf, above 464 or
 * above the window (checked: s->limit), in AVX-512 (the same sums in the same order: the same bits); returns
 * where it stopped. The exact sums of x and x*x of the values in the block's window (see open_window) go to
 * float64 lanes, the others' to the bins; every value is tallied. */
__attribute__((target("arch=x86-64-v4"), always_inline)) static inline Py_ssize_t
stats_run(const float *x, Py_ssize_t i, Py_ssize_t end, stats_lanes *s, stats_bins *bins, const int32_t *k,
          int checked, int windowed) {
    __m512d base = (__m512d)s->base, err0 = (__m512d)s->err[0], err1 = (__m512d)s->err[1],
            err2 = (__m512d)s->err[2], err3 = (__m512d)s->err[3];
    __m512i normal0 = (__m512i)s->normal[0], normal2 = (__m512i)s->normal[2], normal3 = (__m512i)s->normal[3];
    __m512i one = K(K_ONE), below = _mm512_set1_epi32(s->below);
    __m512 lo = (__m512)s->lo, hi = (__m512)s->hi;
    __m512d sum = (__m512d)s->sum, high = (__m512d)s->high, low = (__m512d)s->low, magic = _mm512_set1_pd(s->magic);
    __m512i field = _mm512_set1_epi32(s->least - 1), limit = _mm512_set1_epi32(s->limit);
    uint32_t places[32] __attribute__((aligned(64))); /* two groups' places, in turn */
    int pending = 0;                                  /* the group before's places are not yet tallied */
    for (; end - i >= 16; i += 16) {
        __m512i u = _mm512_loadu_si512(x + i), mag = _mm512_and_si512(u, K(K_ABS));
        if (checked && _mm512_cmpgt_epi32_mask(mag, limit)) {
            STORE_LANES();
            return i;
        }
        __m512i expo = _mm512_and_si512(mag, K(K_EXPONENT)), mag1 = _mm512_sub_epi32(mag, one);
        __m512 fm = _mm512_castsi512_ps(mag), xf = _mm512_castsi512_ps(u);
        AVX512_BELOW(0);
        AVX512_BELOW(2);
        AVX512_BELOW(3);
        __mmask16 twos = _mm512_testn_epi32_mask(_mm512_sub_epi32(mag, K(K_NORMAL_LEAST)), K(K_POWER));
        if (twos) { /* powers of two: rare (none in a group of normal(0, 1) values but once in 2**19) */
            int32_t m[16];
            _mm512_storeu_si512(m, mag);
            count_powers(s, m, twos);
        }
        lo = _mm512_min_ps(xf, lo); /* xf < lo ? xf : lo */
        hi = _mm512_max_ps(xf, hi);
        /* x in float64, converted from memory (not by extracting the upper half on the vectors' busiest port) */
        __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i)), b = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
        base = _mm512_fmadd_pd(a, a, base);
        base = _mm512_fmadd_pd(b, b, base);
        /* the window: zeros (mag - 1 wraps) and the exponent fields from the least on */
        __mmask16 in = _mm512_cmpgt_epu32_mask(mag1, below);
        __m512i c0 = AVX512_C(0);
        AVX512_ERROR(0, c0);
        /* bfloat16's smallest normal is float32's: its C is the exponent's but for subnormals, which lie below
         * the window */
        AVX512_ERROR(1, in == 0xFFFF ? _mm512_add_epi32(expo, K(K_DROP + 1)) : AVX512_C(1));
        AVX512_ERROR(2, AVX512_C(2));
        AVX512_ERROR(3, _mm512_add_epi32(c0, K(K_DROP3))); /* float16's C 8 binades up (their TINY is one) */
        if (!windowed) { /* a block of values spread far below their largest: the bins take them all */
            __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag1, K(K_FRACTION));
            if (is_sub) {
                int32_t m[16];
                _mm512_storeu_si512(m, mag);
                count_subnormals(s, bins, m, is_sub);
            }
            add_to_bins(bins, x + i, 16);
            s->spread += __builtin_popcount(in ^ 0xFFFFu); /* to tell whether the next block is spread too */
            continue;
        }
        __mmask8 in_a = (__mmask8)in, in_b = (__mmask8)_kshiftri_mask16(in, 8);
        sum = _mm512_mask_add_pd(sum, in_a, sum, a);
        sum = _mm512_mask_add_pd(sum, in_b, sum, b);
        __m512d top_a = _mm512_sub_pd(_mm512_fmadd_pd(a, a, magic), magic); /* x*x to a multiple of 2**SPLIT units */
        __m512d top_b = _mm512_sub_pd(_mm512_fmadd_pd(b, b, magic), magic);
        high = _mm512_mask_add_pd(high, in_a, high, top_a);
        high = _mm512_mask_add_pd(high, in_b, high, top_b);
        low = _mm512_mask_add_pd(low, in_a, low, _mm512_fmsub_pd(a, a, top_a)); /* the rest, exact */
        low = _mm512_mask_add_pd(low, in_b, low, _mm512_fmsub_pd(b, b, top_b));
        if (in != 0xFFFF) { /* below the window: subnormals, and normals far below the block's largest */
            __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag1, K(K_FRACTION));
            if (is_sub) {
                int32_t m[16];
                _mm512_storeu_si512(m, mag);
                count_subnormals(s, bins, m, is_sub);
            }
            below_window(bins, x + i, in ^ 0xFFFFu);
            s->below_count += __builtin_popcount(in ^ 0xFFFFu);
            s->spread += __builtin_popcount(in ^ 0xFFFFu);
        }
        /* each value's place in the window, E - least + 1 (0: below it, or zero), and pairs of them tallied
         * from scalar registers (they have ports to spare, the vectors have not), a group late: the places
         * stored, even | odd << 5, are read back from memory once the store is done */
        __m512i place = _mm512_subs_epu16(_mm512_srli_epi32(mag, 23), field); /* 16-bit halves: max(E - least + 1, 0) */
        if (pending)
            for (int j = 0; j < 16; j += 2)
                bins->tally[j >> 1 & 1][places[(~i >> 4 & 1) * 16 + j]]++; /* the group before's */
        _mm512_store_si512(places + (i >> 4 & 1) * 16, _mm512_or_si512(place, _mm512_srli_epi64(place, 27)));
        __asm__ volatile("" ::: "memory"); /* not extracted on the vectors' ports instead */
        pending = 1;
    }
    STORE_LANES();
    return i;
}

/* stats_run for values that may hold NaN, inf, values above 464 or above the window (it stops before the
 * first group that does), for a run of ordinary values alone (a block whose own largest magnitude is
 * ordinary: no test), and for a block spread far below its largest (the block before had more than SPREAD
 * values below its window: the bins take every value, as in the generic loop, and the window's sums stay
 * empty). */
__attribute__((target("arch=x86-64-v4"), noipa)) static Py_ssize_t
stats_run_avx512(const float *x, Py_ssize_t i, Py_ssize_t end, stats_lanes *s, stats_bins *bins, const int32_t *k) {
    return stats_run(x, i, end, s, bins, k, 1, 1);
}

__attribute__((target("arch=x86-64-v4"), noipa)) static Py_ssize_t
stats_run_ordinary(const float *x, Py_ssize_t i, Py_ssize_t end, stats_lanes *s, stats_bins *bins, const int32_t *k) {
    return stats_run(x, i, end, s, bins, k, 0, 1);
}

__attribute__((target("arch=x86-64-v4"), noipa)) static Py_ssize_t
stats_run_spread(const float *x, Py_ssize_t i, Py_ssize_t end, stats_lanes *s, stats_bins *bins, const int32_t *k) {
    return stats_run(x, i, end, s, bins, k, 1, 0);
}

/* The largest magnitude bits among values [first, end) (a NaN's are the largest). */
__attribute__((target("arch=x86-64-v4"), noipa)) static int32_t
block_top(const float *x, Py_ssize_t first, Py_ssize_t end) {
    __m512i top = _mm512_setzero_si512(), abs = _mm512_set1_epi32(0x7FFFFFFF);
    Py_ssize_t i = first;
    for (; end - i >= 16; i += 16)
        top = _mm512_max_epi32(top, _mm512_and_si512(_mm512_loadu_si512(x + i), abs));
    int32_t best = _mm512_reduce_max_epi32(top);
    for (; i < end; i++) {
        int32_t v;
        memcpy(&v, x + i, sizeof v);
        v &= 0x7FFFFFFF;
        best = v > best ? v : best;
    }
    return best;
}

/* 2**k as a double, for k in [-1022, 1023] (no call into libm). */
static inline double power_of_two(int k) {
    uint64_t bits = (uint64_t)(k + 1023) << 52;
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Sets the AVX-512 loop's window for a block whose largest magnitude bits are `top`: the exponent fields E
 * from least = max(min(top's, 464's) - WINDOW, 1) on. A value x there is a multiple of the unit 2**(least - 150)
 * and below 2**(WINDOW + 24) units, so that a lane's sum of the 1024 it takes of a block is exact in float64
 * (below 2**52 units). x*x, a multiple of the unit squared below 2**84 of them, is split into a multiple of
 * 2**WINDOW_SPLIT units (fma(x, x, C) - C, C = 1.5 * 2**(52 + WINDOW_SPLIT) units: rounding at C's last
 * place) and the exact rest (fma(x, x, -that), at most 2**42 units): the lanes' sums of each part stay
 * below 2**53 of their units, exact too. */
static int open_window(stats_lanes *s, int32_t top) {
    int least = (top >> 23 < (int32_t)(OVER_LEAST >> 23) ? top >> 23 : (int32_t)(OVER_LEAST >> 23)) - WINDOW;
    least = least > 1 ? least : 1;
    s->least = least;
    s->below = (least << 23) - 2; /* from least << 23 itself on (its place is 1, not 0) */
    s->limit = ((least + WINDOW + 1) << 23) - 1 < (int32_t)OVER_LEAST - 1 ? ((least + WINDOW + 1) << 23) - 1
                                                                     : (int32_t)OVER_LEAST - 1;
    s->magic = 1.5 * power_of_two(52 + WINDOW_SPLIT + 2 * (least - 150));
    s->sum = s->high = s->low = (v8d){0};
    s->below_count = s->spread = 0;
    return top < (int32_t)OVER_LEAST; /* whether every value is ordinary */
}

/* Adds the window's counts and exact sums to the bins: the values per place in the window (from the tally of
 * pairs, emptied: place 0, less the values below the window, the bins have already, holds zeros), the sum of
 * x in units 2**(least - 150) as three signed digits of 24 bits at exponent fields least, least + 24 and
 * least + 48 (so that a bin's int64 sum holds no more than a value's share a block), the sum of x*x in units
 * squared at least. */
__attribute__((target("arch=x86-64-v4"))) static void close_window(stats_lanes *s, stats_bins *bins) {
    int least = s->least;
    uint32_t places[32] __attribute__((aligned(64))) = {0}; /* below 2**13 a block */
    __m512i even_lo = _mm512_setzero_si512(), even_hi = even_lo;
    for (int odd = 0; odd <= WINDOW + 1; odd++) { /* places beyond WINDOW + 1 hold nothing */
        uint32_t *t0 = bins->tally[0] + (odd << 5), *t1 = bins->tally[1] + (odd << 5);
        __m512i lo = _mm512_add_epi32(_mm512_loadu_si512(t0), _mm512_loadu_si512(t1));
        __m512i hi = _mm512_add_epi32(_mm512_loadu_si512(t0 + 16), _mm512_loadu_si512(t1 + 16));
        even_lo = _mm512_add_epi32(even_lo, lo);
        even_hi = _mm512_add_epi32(even_hi, hi);
        places[odd] += (uint32_t)_mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
        _mm512_storeu_si512(t0, _mm512_setzero_si512());
        _mm512_storeu_si512(t0 + 16, _mm512_setzero_si512());
        _mm512_storeu_si512(t1, _mm512_setzero_si512());
        _mm512_storeu_si512(t1 + 16, _mm512_setzero_si512());
    }
    _mm512_store_si512(places, _mm512_add_epi32(_mm512_load_si512(places), even_lo));
    _mm512_store_si512(places + 16, _mm512_add_epi32(_mm512_load_si512(places + 16), even_hi));
    bins->counts[0] += places[0] - s->below_count;
    for (int p = 1; p <= WINDOW + 1; p++)
        bins->counts[least + p - 1] += places[p];
    int64_t sum = 0, high = 0, low = 0;
    double unit = power_of_two(150 - least), units = power_of_two(300 - 2 * least); /* exact scalings */
    for (int j = 0; j < 8; j++) {
        sum += (int64_t)(s->sum[j] * unit);
        high += (int64_t)(s->high[j] * (units / power_of_two(WINDOW_SPLIT)));
        low += (int64_t)(s->low[j] * units);
    }
    for (int d = 0; d < 3; d++) {
        int64_t digit = d < 2 ? sum % (1 << 24) : sum; /* C's %: the sign of the sum */
        bins->sums[least + 24 * d] += digit;
        sum = (sum - digit) / (1 << 24);
    }
    bins->square_sums[least] += (unsigned __int128)(((__int128)high << WINDOW_SPLIT) + low);
}
#endif

STATS_CLONES static void stats_loop(const float *x, Py_ssize_t n, int64_t start, int64_t *out, double *errors,
                             stats_bins *bins, int avx512) {
    v8i zeros = {0}, below_flush[TARGETS] = {{0}}, below_normal[TARGETS] = {{0}}, peak = {0}; /* (flush: at) */
    v8f lo = {0}, hi = {0};
    const v8i iota = {0, 1, 2, 3, 4, 5, 6, 7};
    const float inf = __builtin_inff();
    int64_t nan = 0, posinf = 0, neginf = 0, over[TARGETS] = {0}, padding = 0;
    int32_t best = -1;
    Py_ssize_t best_block = 0;
    lo += inf;
    hi -= inf;
    peak -= 1;
    Py_ssize_t since_flush = 0;
#if STATS_AVX512
    Py_ssize_t resume = 0;
    int ordinary = 0, spread = 0; /* the block holds ordinary values alone; the block before was spread */
    int predicted = 0, whole = 0; /* the block's window is the block before's; the AVX-512 loop took the block whole */
    int32_t last = -1;            /* the largest magnitude bits of the block before, where the loop took it whole */
    int steady = 0;               /* those lay within a binade of the block before's before (see below) */
#endif
    stats_lanes lanes = {0};
    lanes.peak -= 1;
    v16f lanes_lo = lanes.lo + inf, lanes_hi = lanes.hi - inf; /* the AVX-512 loop's smallest and largest so far */
    for (Py_ssize_t first = 0; first < n; first += STATS_BLOCK) {
        Py_ssize_t end = first + STATS_BLOCK < n ? first + STATS_BLOCK : n;
        v8d base = {0}, err[TARGETS] = {{0}}, over_sums[TARGETS] = {{0}};
#if STATS_AVX512
        if (avx512) { /* after two blocks whose largest values lie within a binade of each other, the window of
                       * the block before's largest value a binade up (no pass of block_top first: the loop stops
                       * at a value above it, and the rest of the block opens its own) */
            predicted = steady && !spread;
            ordinary = open_window(&lanes, predicted ? last + (1 << 23) : block_top(x, first, end)) && !predicted;
            lanes.lo = (v16f){0} + inf;
            lanes.hi = (v16f){0} - inf;
            whole = 0;
        }
#endif
        for (Py_ssize_t i = first; i < end; i += 8) {
#if STATS_AVX512
            if (avx512 && i >= resume && end - i >= 16) { /* the sums go through `lanes`, and come back */
                lanes.base = base;
                memcpy(lanes.err, err, sizeof err);
                i = (spread ? stats_run_spread : ordinary ? stats_run_ordinary : stats_run_avx512)(x, i, end, &lanes, bins,
                                                                                              STATS_K);
                base = lanes.base;
                memcpy(err, lanes.err, sizeof err);
                if (i >= end) {
                    whole = i == end && resume <= first;
                    break;
                }
                if (predicted) { /* stopped by a value above the window: the rest of the block takes its own */
                    close_window(&lanes, bins);
                    predicted = 0;
                    ordinary = open_window(&lanes, block_top(x, i, end));
                    i -= 8; /* the loop again, from i */
                    continue;
                }
                resume = i + 64; /* stopped by a NaN, an inf or a value above 464: these go the generic way */
            }
#endif
            v8u u = {0};
            int k = end - i < 8 ? (int)(end - i) : 8;
            if (k == 8)
                memcpy(&u, x + i, sizeof u);
            else
                memcpy(&u, x + i, (size_t)k * 4); /* a block's last values padded with zeros */
            /* magnitudes lie below 2**31: signed comparisons (one instruction each) serve */
            v8i mag = (v8i)(u & 0x7FFFFFFF), expo = mag & 0x7F800000, is_zero = mag == 0;
            v8f fm = (v8f)mag, xf = (v8f)u;
            v8i is_sub = (mag < 0x800000) & ~is_zero; /* and padding */
            for (int t = 0; t < TARGETS; t++) {
                below_flush[t] += t == 1 ? mag < (int32_t)FLUSH[1] + 1 : mag == (int32_t)FLUSH[t];
                below_normal[t] += mag < (int32_t)NORMAL[t];
            }
            if (k == 8 && !any_lane(mag > (int32_t)OVER_LEAST - 1)) { /* no inf, NaN or overflow: no masks */
                zeros += is_zero;
                lo = (v8f)select8((v8i)(xf < lo), (v8i)xf, (v8i)lo);
                hi = (v8f)select8((v8i)(xf > hi), (v8i)xf, (v8i)hi);
                peak = select8(mag > peak, mag, peak);
                ADD_SQUARES(base, fm);
                for (int t = 0; t < TARGETS; t++) {
                    v8u c = (v8u)select8(expo > (int32_t)TINY[t], expo, (v8i){0} + (int32_t)TINY[t]) + (DROP[t] << 23);
                    v8f d = fm - ((fm + (v8f)c) - (v8f)c);
                    ADD_SQUARES(err[t], d);
                }
            } else {
                v8i valid = iota < k, number = (mag <= 0x7F800000) & valid;
                zeros += is_zero & valid;
                lo = (v8f)select8(number & (v8i)(xf < lo), (v8i)xf, (v8i)lo);
                hi = (v8f)select8(number & (v8i)(xf > hi), (v8i)xf, (v8i)hi);
                peak = select8(number & (mag > peak), mag, peak);
                for (int j = 0; j < k; j++) {
                    nan += mag[j] > 0x7F800000;
                    posinf += u[j] == 0x7F800000;
                    neginf += u[j] == 0xFF800000;
                    for (int t = 0; t < TARGETS; t++)
                        over[t] += (uint32_t)mag[j] >= OVER[t] && mag[j] < 0x7F800000;
                }
                v8u umag = (v8u)mag;
                v8f kept = (v8f)((v8i)fm & (v8i)(umag < OVER_LEAST));
                ADD_SQUARES(base, kept);
                padding += 8 - k;
                for (int t = 0; t < TARGETS; t++) {
                    uint32_t drop = DROP[t];
                    v8u c = (v8u)select8(expo > (int32_t)TINY[t], expo, (v8i){0} + (int32_t)TINY[t]) + (drop << 23);
                    v8u bits = (umag + ((1u << (drop - 1)) - 1) + ((umag >> drop) & 1)) & ~((1u << drop) - 1);
                    v8f r = (v8f)select8((v8i)(c >= 0x7F800000), (v8i)bits, (v8i)((fm + (v8f)c) - (v8f)c));
                    v8f d = (v8f)((v8i)(fm - r) & (v8i)(umag < OVER[t]));
                    ADD_SQUARES(err[t], d);
                    v8f o = (v8f)((v8i)fm & (v8i)(umag >= OVER_LEAST) & (v8i)(umag < OVER[t]));
                    ADD_SQUARES(over_sums[t], o);
                }
            }
            if (any_lane(is_sub))
                for (int j = 0; j < 8; j++)
                    if (is_sub[j])
                        bins->subnormal[31 - __builtin_clz(mag[j])]++;
            if (k == 8)
                add_to_bins(bins, x + i, 8); /* unrolled */
            else
                add_to_bins(bins, x + i, k);
        }
#if STATS_AVX512
        if (avx512) {
            close_window(&lanes, bins);
            spread = lanes.spread > SPREAD;
            for (int j = 0; j < 16; j++) { /* the block's largest magnitudes, from its extremes (NaN never) */
                int32_t low_bits, high_bits;
                memcpy(&low_bits, &lanes.lo[j], sizeof low_bits);
                memcpy(&high_bits, &lanes.hi[j], sizeof high_bits);
                low_bits &= 0x7FFFFFFF;
                high_bits &= 0x7FFFFFFF;
                lanes.peak[j] = lanes.lo[j] > lanes.hi[j] ? -1 : low_bits > high_bits ? low_bits : high_bits;
                lanes_lo[j] = lanes.lo[j] < lanes_lo[j] ? lanes.lo[j] : lanes_lo[j];
                lanes_hi[j] = lanes.hi[j] > lanes_hi[j] ? lanes.hi[j] : lanes_hi[j];
            }
            int32_t top = -1; /* the block's largest magnitude bits, where the loop took it whole */
            for (int j = 0; whole && j < 16; j++)
                top = lanes.peak[j] > top ? lanes.peak[j] : top;
            steady = whole && last >= 0 && abs((top >> 23) - (last >> 23)) <= 1;
            last = whole ? top : -1;
        }
#endif
        double *row = errors + (first / STATS_BLOCK) * ERROR_SUMS;
        row[0] = lanes8(base);
        for (int t = 0; t < TARGETS; t++) {
            row[1 + t] = lanes8(err[t]);
            row[5 + t] = lanes8(over_sums[t]);
        }
        for (int j = 0; j < 16; j++) { /* the first block where the largest magnitude so far appears */
            int32_t top = j < 8 && peak[j] > lanes.peak[j] ? peak[j] : lanes.peak[j];
            if (top > best) {
                best = top;
                best_block = first;
            }
        }
        since_flush += end - first;
        if (since_flush >= FLUSH_VALUES || end == n) {
            empty_bins(bins);
            since_flush = 0;
        }
    }
    int64_t *o = out;
    for (int e = 0; e < 256; e++) {
        unsigned __int128 q = ((unsigned __int128)(uint64_t)o[OUT_SQ_HI + e] << 64 | (uint64_t)o[OUT_SQ_LO + e]);
        q += bins->square_sums[e];
        o[OUT_COUNTS + e] += bins->counts[e];
        o[OUT_SUMS + e] += bins->sums[e];
        o[OUT_SQ_LO + e] = (int64_t)(uint64_t)q;
        o[OUT_SQ_HI + e] = (int64_t)(uint64_t)(q >> 64);
    }
    for (int k = 0; k < SUBNORMAL_BINS; k++)
        o[OUT_SUBNORMAL + k] += bins->subnormal[k];
    int64_t counts[3 * TARGETS + 2] = {0};
    float low, high;
    uint32_t bits = (uint32_t)o[OUT_MIN];
    memcpy(&low, &bits, sizeof low);
    bits = (uint32_t)o[OUT_MAX];
    memcpy(&high, &bits, sizeof high);
    for (int j = 0; j < 8; j++) { /* the counts below a magnitude hold the zeros and a tail's padding too */
        counts[0] += -zeros[j];
        for (int t = 0; t < TARGETS; t++) {
            counts[2 + t] -= below_flush[t][j];
            counts[2 + TARGETS + t] -= below_normal[t][j];
        }
        low = lo[j] < low ? lo[j] : low;
        high = hi[j] > high ? hi[j] : high;
    }
    o[OUT_NAN] += nan;
    o[OUT_POSINF] += posinf;
    o[OUT_NEGINF] += neginf;
    for (int c = 1; c < 3 * TARGETS + 2; c++)
        if (c == 2 + 1 || c >= 2 + TARGETS) /* below a magnitude: bfloat16's flush, and every normal */
            counts[c] -= counts[0] + padding;
    /* the AVX-512 loop's share: its zeros are this call's (the bins') less the generic loop's */
    int64_t subnormals = 0;
    for (int k = 0; k < SUBNORMAL_BINS; k++)
        subnormals += bins->subnormal[k];
    int64_t zeros_avx512 = bins->counts[0] - subnormals - counts[0];
    for (int j = 0; j < 16; j++) {
        for (int t = 0; t < TARGETS; t++)
            counts[2 + TARGETS + t] += lanes.normal[t][j];
        low = lanes_lo[j] < low ? lanes_lo[j] : low;
        high = lanes_hi[j] > high ? lanes_hi[j] : high;
    }
    for (int t = 0; t < TARGETS; t++)
        if (t != 1) {
            counts[2 + TARGETS + t] -= zeros_avx512;
            /* float16's, float8_e4m3fn's and float8_e5m2's flush thresholds are normal powers of two: the non-zero
             * values at or below one are the subnormals, those of the exponent fields from 1 below its, and
             * those at it (counted by both loops) */
            int64_t below = subnormals + counts[2 + t] + lanes.powers[t];
            for (uint32_t e = 1; e < FLUSH[t] >> 23; e++)
                below += bins->counts[e];
            counts[2 + t] = below;
        }
    counts[2 + 1] += lanes.flush1;
    counts[2 + TARGETS + 1] += lanes.normal1;
    o[OUT_ZEROS] += counts[0] + zeros_avx512;
    o[OUT_SUBNORMALS] += subnormals;
    memcpy(&bits, &low, sizeof bits);
    o[OUT_MIN] = bits;
    memcpy(&bits, &high, sizeof bits);
    o[OUT_MAX] = bits;
    for (Py_ssize_t i = best_block; best >= 0; i++) {
        memcpy(&bits, x + i, sizeof bits);
        if ((int32_t)(bits & 0x7FFFFFFF) == best) { /* larger, or as large and earlier (chunks come in any order) */
            if (best > o[OUT_PEAK] || (best == o[OUT_PEAK] && start + i < o[OUT_PEAK_AT])) {
                o[OUT_PEAK] = best;
                o[OUT_PEAK_AT] = start + i;
            }
            break;
        }
    }
    for (int t = 0; t < TARGETS; t++) {
        o[OUT_CASTS + 3 * t] += over[t];
        o[OUT_CASTS + 3 * t + 1] += counts[2 + t];
        o[OUT_CASTS + 3 * t + 2] += counts[2 + TARGETS + t] - counts[2 + t];
    }
}

/* Whether the machine runs stats_run_avx512. */
static int has_avx512(void) {
#if STATS_AVX512
    __builtin_cpu_init(); /* done already by libgcc's constructor, as the clones' resolvers need: harmless */
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2");
#else
    return 0;
#endif
}

static PyObject *stats_f32(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    long long start;
    int wide = 1;
    if (!PyArg_ParseTuple(args, "OOOL|p", &objs[0], &objs[1], &objs[2], &start, &wide))
        return NULL;
    Py_buffer v[3]; /* x, out, errors */
    const char *formats[2] = {"f", "q"};
    if (get_buffers(2, objs, formats, v) < 0)
        return NULL;
    if (get_buffer(objs[2], &v[2], "d", 1) < 0) {
        release_buffers(2, v);
        return NULL;
    }
    Py_ssize_t n = v[0].len / 4, blocks = (n + STATS_BLOCK - 1) / STATS_BLOCK;
    PyObject *result = NULL;
    stats_bins *bins = NULL;
    if (v[1].len != STATS_LEN * 8 || v[2].len != blocks * ERROR_SUMS * 8 || n >= ((Py_ssize_t)1 << 31))
        PyErr_SetString(PyExc_ValueError, "stats_f32 takes fewer than 2**31 values, STATS_LEN counts and nine sums a block");
    else if ((bins = calloc(1, sizeof *bins)) == NULL)
        PyErr_NoMemory();
    else {
        Py_BEGIN_ALLOW_THREADS
        stats_loop(v[0].buf, n, start, v[1].buf, v[2].buf, bins, wide && has_avx512());
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(bins);
    release_buffers(3, v);
    return result;
}

/* exact_columns(sums, cols) -> list: per column of a C-order float64 array of `cols` columns (non-negative
 * finite terms: stats_f32's error rows), its exact sum as (integer, exponent), the sum being integer *
 * 2**exponent; None for a column whose non-zero terms lie more than COLUMN_SPREAD binades apart (or that
 * holds a negative or non-finite term): the caller adds those another way. Each term is its 53-bit
 * significand shifted to the column's least exponent, added in 128 bits: below 2**(53 + 50 + 19), exact for
 * fewer than 2**19 rows (what a tensor's accumulator folds at most: 64 calls of 2**13 blocks). */
#define COLUMN_SPREAD 50
#define COLUMN_ROWS ((Py_ssize_t)1 << 19)

static PyObject *exact_column(const double *a, Py_ssize_t rows, Py_ssize_t cols) {
    int least = 1 << 30, most = -(1 << 30);
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint64_t b;
        memcpy(&b, a + r * cols, sizeof b);
        if (b >> 52 >= 0x7FF) /* negative (the sign bit) or not finite */
            Py_RETURN_NONE;
        int e = (int)(b >> 52) ? (int)(b >> 52) - 1075 : -1074;
        if (b) {
            least = e < least ? e : least;
            most = e > most ? e : most;
        }
    }
    if (most < least) /* all zero */
        return Py_BuildValue("(ii)", 0, 0);
    if (most - least > COLUMN_SPREAD)
        Py_RETURN_NONE;
    unsigned __int128 acc = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint64_t b;
        memcpy(&b, a + r * cols, sizeof b);
        if (!b)
            continue;
        uint64_t m = b & (((uint64_t)1 << 52) - 1);
        int e = -1074;
        if (b >> 52) {
            m |= (uint64_t)1 << 52;
            e = (int)(b >> 52) - 1075;
        }
        acc += (unsigned __int128)m << (e - least);
    }
    PyObject *high = PyLong_FromUnsignedLongLong((unsigned long long)(acc >> 64));
    PyObject *low = PyLong_FromUnsignedLongLong((unsigned long long)acc);
    PyObject *shift = PyLong_FromLong(64), *shifted = NULL, *total = NULL;
    if (high && low && shift && (shifted = PyNumber_Lshift(high, shift)) != NULL)
        total = PyNumber_Or(shifted, low);
    Py_XDECREF(high);
    Py_XDECREF(low);
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    if (total == NULL)
        return NULL;
    PyObject *pair = Py_BuildValue("(Ni)", total, least);
    return pair;
}

static PyObject *exact_columns(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t cols;
    if (!PyArg_ParseTuple(args, "On", &obj, &cols))
        return NULL;
    Py_buffer v;
    if (get_buffer(obj, &v, "d", 0) < 0)
        return NULL;
    Py_ssize_t n = v.len / 8;
    PyObject *out = NULL;
    if (cols <= 0 || n % cols != 0 || n / cols >= COLUMN_ROWS)
        PyErr_SetString(PyExc_ValueError, "exact_columns takes whole rows of `cols` float64 terms, fewer than 2**19");
    else if ((out = PyList_New(cols)) != NULL)
        for (Py_ssize_t j = 0; j < cols; j++) {
            PyObject *pair = exact_column((const double *)v.buf + j, n / cols, cols);
            if (pair == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, j, pair);
        }
    PyBuffer_Release(&v);
    return out;
}

/* The buffer format of a kind of values; NULL (an error set) for no kind. */
static const char *kind_format(int kind) {
    if (kind < 0 || kind > 2) {
        PyErr_SetString(PyExc_ValueError, "a kind is 0 (float32), 1 (bfloat16) or 2 (float16)");
        return NULL;
    }
    return kind ? "H" : "f";
}

/* Checks that x and y hold the same number of values, a whole number of rows of `rows` (a multiple of
 * `multiple` values each); sets *cols. */
static int row_shape(Py_buffer *x, Py_buffer *y, Py_ssize_t rows, Py_ssize_t multiple, Py_ssize_t *cols) {
    Py_ssize_t n = x->len / x->itemsize;
    if (y->len / y->itemsize != n || (rows == 0 ? n != 0 : n % rows != 0)) {
        PyErr_SetString(PyExc_ValueError, "the inputs must hold the same number of values, a row for each output");
        return -1;
    }
    *cols = rows ? n / rows : 0;
    if (*cols % multiple != 0) {
        PyErr_SetString(PyExc_ValueError, "rows must hold a multiple of 8 values");
        return -1;
    }
    return 0;
}

static PyObject *row_dots(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2]))
        return NULL;
    const char *formats[3] = {"d", "d", "d"};
    Py_buffer v[3]; /* x, y, out */
    if (get_buffers(3, objs, formats, v) < 0)
        return NULL;
    Py_ssize_t rows = v[2].len / 8, cols;
    PyObject *result = NULL;
    if (row_shape(&v[0], &v[1], rows, 1, &cols) == 0) {
        Py_BEGIN_ALLOW_THREADS
        dot_rows(v[0].buf, v[1].buf, v[2].buf, rows, cols);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    release_buffers(3, v);
    return result;
}

static PyObject *square_sums(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    int kind;
    if (!PyArg_ParseTuple(args, "OOi", &objs[0], &objs[1], &kind))
        return NULL;
    const char *formats[2] = {kind_format(kind), "d"};
    Py_buffer v[2]; /* x, out */
    if (formats[0] == NULL || get_buffers(2, objs, formats, v) < 0)
        return NULL;
    Py_ssize_t rows = v[1].len / 8, cols;
    PyObject *result = NULL;
    if (row_shape(&v[0], &v[0], rows, 8, &cols) == 0) {
        double peak;
        Py_BEGIN_ALLOW_THREADS
        peak = SQUARE_ROWS[kind](v[0].buf, v[1].buf, rows, cols);
        Py_END_ALLOW_THREADS
        result = PyFloat_FromDouble(peak);
    }
    release_buffers(2, v);
    return result;
}

static PyObject *pair_sums(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    int kind_a, kind_b;
    if (!PyArg_ParseTuple(args, "OOOii", &objs[0], &objs[1], &objs[2], &kind_a, &kind_b))
        return NULL;
    const char *formats[3] = {kind_format(kind_a), NULL, "d"};
    if (formats[0] == NULL || (formats[1] = kind_format(kind_b)) == NULL)
        return NULL;
    Py_buffer v[3]; /* a, b, out */
    if (get_buffers(3, objs, formats, v) < 0)
        return NULL;
    Py_ssize_t rows = v[2].len / 32, cols;
    PyObject *result = NULL;
    if (v[2].len % 32 != 0)
        PyErr_SetString(PyExc_ValueError, "the output must hold four sums a row");
    else if (row_shape(&v[0], &v[1], rows, 8, &cols) == 0) {
        double top;
        int64_t changed;
        Py_BEGIN_ALLOW_THREADS
        changed = PAIR_ROWS[kind_a][kind_b](v[0].buf, v[1].buf, v[2].buf, rows, cols, &top);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("Ld", (long long)changed, top);
    }
    release_buffers(3, v);
    return result;
}

/* --- crc32 --------------------------------------------------------------------------------------------
 *
 * zlib's CRC-32 (the zip and gzip polynomial, bit-reflected: 0xEDB88320): crc32(data, value) is
 * zlib.crc32(data, value) for any bytes and any start value. The state c is the CRC inverted, as in zlib.
 * Long runs are folded by carry-less multiplication, 64 bytes at a time into four 128-bit lanes (PCLMULQDQ)
 * or 256 bytes at a time into four 512-bit ones (VPCLMULQDQ, AVX-512), then reduced to 32 bits by Barrett's
 * method: V. Gopal, E. Ozturk et al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ
 * Instruction" (Intel, 2009). A lane folded forward over D bits is multiplied by the constants
 * x^(D+32) mod P (its low half) and x^(D-32) mod P (its high half), bit-reflected and shifted left once:
 * those below, for D = 2048, 512, 384, 256 and 128 (the last three fold a 512-bit lane's parts into one).
 * Short runs, the last bytes of a run (below 16) and machines without PCLMULQDQ use tables, eight bytes at
 * a time (slicing by 8).
 */
static uint32_t CRC_TABLE[8][256];

static void crc_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        CRC_TABLE[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            CRC_TABLE[t][i] = (CRC_TABLE[t - 1][i] >> 8) ^ CRC_TABLE[0][CRC_TABLE[t - 1][i] & 0xFF];
}

static uint32_t crc_bytes(uint32_t c, const unsigned char *p, size_t n) {
    const uint32_t(*t)[256] = (const uint32_t(*)[256])CRC_TABLE;
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        c = t[7][lo & 0xFF] ^ t[6][lo >> 8 & 0xFF] ^ t[5][lo >> 16 & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
            t[2][hi >> 8 & 0xFF] ^ t[1][hi >> 16 & 0xFF] ^ t[0][hi >> 24];
    }
    while (n--)
        c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define CRC_CLMUL 1
#include <immintrin.h>
#define CRC_128 __attribute__((target("pclmul,sse4.1")))
#define CRC_512 __attribute__((target("pclmul,sse4.1,avx512f,avx512vl,avx512bw,vpclmulqdq")))

/* The constant pair of a fold over D bits, as a 128-bit lane (low half first). */
#define CRC_K(d_plus, d_minus) _mm_set_epi64x((long long)(d_minus), (long long)(d_plus))

/* Lane x, folded forward onto lane y. */
CRC_128 __attribute__((always_inline)) static inline __m128i fold_128(__m128i x, __m128i k, __m128i y) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), y);
}

/* The state after lane x and the 16-byte blocks of p[0, n) (n a multiple of 16), reduced to 32 bits. */
CRC_128 __attribute__((always_inline)) static inline uint32_t crc_finish(__m128i x, const unsigned char *p, size_t n) {
    const __m128i k128 = CRC_K(0x1751997D0, 0x0CCAA009E), low32 = _mm_setr_epi32(-1, 0, -1, 0);
    for (; n; p += 16, n -= 16)
        x = fold_128(x, k128, _mm_loadu_si128((const __m128i *)p));
    /* 128 bits to 64: the low half times x^96 mod P onto the high half; then its low 32 bits times x^64 mod P. */
    x = _mm_xor_si128(_mm_srli_si128(x, 8), _mm_clmulepi64_si128(x, k128, 0x10));
    x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, low32), CRC_K(0x163CD6124, 0), 0x00));
    /* Barrett: the quotient by mu = x^64 / P, times P, cancels all but the remainder's 32 bits. */
    const __m128i barrett = CRC_K(0x1DB710641, 0x1F7011641);
    __m128i q = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), barrett, 0x10), low32);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x, _mm_clmulepi64_si128(q, barrett, 0x00)), 1);
}

/* The state after p[0, n), n a multiple of 16 and at least 64: four lanes folded 64 bytes at a time. */
CRC_128 static uint32_t crc_clmul(uint32_t c, const unsigned char *p, size_t n) {
    const __m128i *v = (const __m128i *)p;
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128(v), _mm_cvtsi32_si128((int)c)), x1 = _mm_loadu_si128(v + 1),
            x2 = _mm_loadu_si128(v + 2), x3 = _mm_loadu_si128(v + 3);
    const __m128i k512 = CRC_K(0x154442BD4, 0x1C6E41596), k128 = CRC_K(0x1751997D0, 0x0CCAA009E);
    for (v += 4, n -= 64; n >= 64; v += 4, n -= 64) {
        x0 = fold_128(x0, k512, _mm_loadu_si128(v));
        x1 = fold_128(x1, k512, _mm_loadu_si128(v + 1));
        x2 = fold_128(x2, k512, _mm_loadu_si128(v + 2));
        x3 = fold_128(x3, k512, _mm_loadu_si128(v + 3));
    }
    return crc_finish(fold_128(fold_128(fold_128(x0, k128, x1), k128, x2), k128, x3), (const unsigned char *)v, n);
}

CRC_512 __attribute__((always_inline)) static inline __m512i fold_512(__m512i x, __m512i k, __m512i y) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), y, 0x96);
}

/* The state after p[0, n), n a multiple of 16 and at least 256: four 512-bit lanes folded 256 bytes at a time. */
CRC_512 static uint32_t crc_vclmul(uint32_t c, const unsigned char *p, size_t n) {
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    const __m512i k2048 = _mm512_broadcast_i32x4(CRC_K(0x11542778A, 0x1322D1430));
    const __m512i k512 = _mm512_broadcast_i32x4(CRC_K(0x154442BD4, 0x1C6E41596));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        x0 = fold_512(x0, k2048, _mm512_loadu_si512(p));
        x1 = fold_512(x1, k2048, _mm512_loadu_si512(p + 64));
        x2 = fold_512(x2, k2048, _mm512_loadu_si512(p + 128));
        x3 = fold_512(x3, k2048, _mm512_loadu_si512(p + 192));
    }
    x3 = fold_512(fold_512(fold_512(x0, k512, x1), k512, x2), k512, x3);
    for (; n >= 64; p += 64, n -= 64)
        x3 = fold_512(x3, k512, _mm512_loadu_si512(p));
    __m128i x = _mm512_extracti32x4_epi32(x3, 3);
    x = fold_128(_mm512_extracti32x4_epi32(x3, 2), CRC_K(0x1751997D0, 0x0CCAA009E), x);
    x = fold_128(_mm512_extracti32x4_epi32(x3, 1), CRC_K(0x0F1DA05AA, 0x15A546366), x);
    x = fold_128(_mm512_extracti32x4_epi32(x3, 0), CRC_K(0x03DB1ECDC, 0x174359406), x);
    return crc_finish(x, p, n);
}
#else
#define CRC_CLMUL 0
#endif

static int CRC_LEVEL; /* the widest loop the machine runs: 2 VPCLMULQDQ's, 1 PCLMULQDQ's, 0 the tables' */

static int crc_level(void) {
#if CRC_CLMUL
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("pclmul") || !__builtin_cpu_supports("sse4.1"))
        return 0;
    return __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")
               ? 2
               : 1;
#else
    return 0;
#endif
}

static uint32_t crc_run(uint32_t c, const unsigned char *p, size_t n, int level) {
#if CRC_CLMUL
    size_t whole = n & ~(size_t)15;
    if (level >= 2 && n >= 256)
        c = crc_vclmul(c, p, whole);
    else if (level >= 1 && n >= 64)
        c = crc_clmul(c, p, whole);
    else
        whole = 0;
    p += whole;
    n -= whole;
#endif
    return crc_bytes(c, p, n);
}

static PyObject *crc32(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long value = 0;
    int level = 2;
    if (!PyArg_ParseTuple(args, "O|ki", &obj, &value, &level))
        return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    level = level < CRC_LEVEL ? level : CRC_LEVEL;
    uint32_t c = ~(uint32_t)value;
    if (v.len >= 4096) {
        Py_BEGIN_ALLOW_THREADS
        c = crc_run(c, v.buf, (size_t)v.len, level);
        Py_END_ALLOW_THREADS
    } else
        c = crc_run(c, v.buf, (size_t)v.len, level);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(~c);
}

/* The module's one-time set-up: the CRC-32 tables, and the loop the machine runs (as CRC32_LEVEL). */
static int exec_module(PyObject *module) {
    crc_tables();
    CRC_LEVEL = crc_level();
    return PyModule_AddIntConstant(module, "CRC32_LEVEL", CRC_LEVEL);
}

static PyMethodDef methods[] = {
    {"row_dots", row_dots, METH_VARARGS, "row_dots(x, y, out): out[r] = the sum of row r of x * y (float64)."},
    {"square_sums", square_sums, METH_VARARGS,
     "square_sums(x, out, kind) -> peak: per row, the sum of squares; the largest magnitude."},
    {"pair_sums", pair_sums, METH_VARARGS,
     "pair_sums(a, b, out, kind_a, kind_b) -> (changed, top): per row, the sums of d*d, a*a, b*b and a*b "
     "(d = a - b); how many d are not 0, and the largest |d|."},
    {"stats_f32", stats_f32, METH_VARARGS,
     "stats_f32(x, out, errors, start, wide=True): counts, exact sums per exponent and cast counts of float32 "
     "values added into out (int64, STATS_LEN); per block, nine float64 sums into errors (see clipcli/_fused.c); "
     "wide=False: the generic loop alone, not AVX-512's (the same bits, for the tests)."},
    {"exact_columns", exact_columns, METH_VARARGS,
     "exact_columns(sums, cols) -> list: per column of non-negative float64 terms, its exact sum as (integer, "
     "exponent); None for a column spread over more than 50 binades (see clipcli/_fused.c)."},
    {"crc32", crc32, METH_VARARGS,
     "crc32(data, value=0, level=2) -> int: zlib.crc32(data, value), by carry-less multiplication where the "
     "machine has it; level caps the loop used: 2 VPCLMULQDQ's, 1 PCLMULQDQ's, 0 the tables' (for the tests)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
#ifdef Py_mod_gil /* the module keeps no state: free-threaded Pythons may run it without a GIL */
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fused", "Fused loops for clipcli's core.", 0, methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fused(void) { return PyModuleDef_Init(&module); }
