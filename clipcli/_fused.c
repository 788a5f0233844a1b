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
 * All release the GIL while they run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
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

/* A C-contiguous buffer of native `format` ('d', 'f' or 'H'); writable if asked. */
static int get_buffer(PyObject *obj, Py_buffer *view, const char *format, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format;
    if (f[0] == '@' || f[0] == '=')
        f++;
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

static PyMethodDef methods[] = {
    {"row_dots", row_dots, METH_VARARGS, "row_dots(x, y, out): out[r] = the sum of row r of x * y (float64)."},
    {"square_sums", square_sums, METH_VARARGS,
     "square_sums(x, out, kind) -> peak: per row, the sum of squares; the largest magnitude."},
    {"pair_sums", pair_sums, METH_VARARGS,
     "pair_sums(a, b, out, kind_a, kind_b) -> (changed, top): per row, the sums of d*d, a*a, b*b and a*b "
     "(d = a - b); how many d are not 0, and the largest |d|."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
#ifdef Py_mod_gil /* the module keeps no state: free-threaded Pythons may run it without a GIL */
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fused", "Fused loops for clipcli's core.", 0, methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fused(void) { return PyModuleDef_Init(&module); }
