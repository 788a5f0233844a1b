/* Fused loops for clipcli's core: the sums of a block of values in one fixed order, at any vector width.
 *
 * Every sum here is taken in eight lanes: lane j adds the terms j, j + 8, j + 16, ... in turn (a row's last
 * terms, past a multiple of 8, go to the lanes 0, 1, ... as they come), then the lanes are added as
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). That order is all there is to the bits of a sum: the
 * same whether a build's vectors hold 2 or 4 doubles, and what `clipcli.core._row_dots` computes with NumPy
 * when this module is not built. Contracting a * b + c into one fused multiply-add would change the bits;
 * the build turns it off (-ffp-contract=off).
 *
 * row_dots(x, y, out): out[r] = sum of x[r, i] * y[r, i], for float64 rows (x.size / out.size values each).
 * pair_sums(a, b, out) -> (changed, top, bottom): for float32 rows of A and B (a.size / (out.size / 4)
 *   values each, a multiple of 8), writes out[r] = (sum d*d, sum a*a, sum b*b, sum a*b) with d = a - b in
 *   float64 (exact: float32 values widened), and returns how many d are not 0 and the largest and smallest
 *   d (0 when none is above / below 0). For finite values only: NaN in a row makes its sums NaN, and the
 *   counts are then of no use.
 * Both release the GIL while they run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int64_t v4i __attribute__((vector_size(32)));

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

static inline v4d load32(const float *p) {
    v4f f;
    memcpy(&f, p, sizeof f);
    return __builtin_convertvector(f, v4d);
}

static inline v4d larger(v4d a, v4d b) {
    v4i m = a > b;
    return (v4d)((m & (v4i)a) | (~m & (v4i)b));
}

static inline v4d smaller(v4d a, v4d b) {
    v4i m = a < b;
    return (v4d)((m & (v4i)a) | (~m & (v4i)b));
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
            double t = a[i] * b[i];
            if (i - main < 4)
                p[i - main] += t;
            else
                q[i - main - 4] += t;
        }
        out[r] = lanes_sum(p, q);
    }
}

CLONES static int64_t pair_rows(const float *x, const float *y, double *out, Py_ssize_t rows, Py_ssize_t cols,
                                double *top, double *bottom) {
    v4i changed = {0};
    v4d hi = {0}, lo = {0};
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *a = x + r * cols, *b = y + r * cols;
        v4d dd0 = {0}, dd1 = {0}, aa0 = {0}, aa1 = {0}, bb0 = {0}, bb1 = {0}, ab0 = {0}, ab1 = {0};
        for (Py_ssize_t i = 0; i < cols; i += 8) {
            v4d u0 = load32(a + i), u1 = load32(a + i + 4), v0 = load32(b + i), v1 = load32(b + i + 4);
            v4d d0 = u0 - v0, d1 = u1 - v1;
            dd0 += d0 * d0;
            dd1 += d1 * d1;
            aa0 += u0 * u0;
            aa1 += u1 * u1;
            bb0 += v0 * v0;
            bb1 += v1 * v1;
            ab0 += u0 * v0;
            ab1 += u1 * v1;
            hi = larger(larger(d0, d1), hi);
            lo = smaller(smaller(d0, d1), lo);
            changed -= d0 != 0; /* a true comparison is -1 */
            changed -= d1 != 0;
        }
        out[4 * r] = lanes_sum(dd0, dd1);
        out[4 * r + 1] = lanes_sum(aa0, aa1);
        out[4 * r + 2] = lanes_sum(bb0, bb1);
        out[4 * r + 3] = lanes_sum(ab0, ab1);
    }
    double h = 0.0, l = 0.0;
    int64_t count = 0;
    for (int j = 0; j < 4; j++) {
        h = hi[j] > h ? hi[j] : h;
        l = lo[j] < l ? lo[j] : l;
        count += changed[j];
    }
    *top = h;
    *bottom = l;
    return count;
}

/* A C-contiguous buffer of native `format` ('d' or 'f'); writable if asked. */
static int get_buffer(PyObject *obj, Py_buffer *view, const char *format, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format;
    if (f[0] == '@' || f[0] == '=')
        f++;
    if (strcmp(f, format) != 0 || view->itemsize != (format[0] == 'd' ? 8 : 4)) {
        PyErr_Format(PyExc_TypeError, "expected a contiguous buffer of format '%s', got '%s'", format, view->format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Checks that x and y hold `per_row` values for each of `rows` rows; sets *cols. */
static int row_shape(Py_buffer *x, Py_buffer *y, Py_ssize_t rows, Py_ssize_t *cols) {
    Py_ssize_t n = x->len / x->itemsize;
    if (y->len / y->itemsize != n || (rows == 0 ? n != 0 : n % rows != 0)) {
        PyErr_SetString(PyExc_ValueError, "the inputs must hold the same number of values, a row for each output");
        return -1;
    }
    *cols = rows ? n / rows : 0;
    return 0;
}

static PyObject *row_dots(PyObject *self, PyObject *args) {
    PyObject *ox, *oy, *oout;
    if (!PyArg_ParseTuple(args, "OOO", &ox, &oy, &oout))
        return NULL;
    Py_buffer x, y, out;
    if (get_buffer(ox, &x, "d", 0) < 0)
        return NULL;
    if (get_buffer(oy, &y, "d", 0) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (get_buffer(oout, &out, "d", 1) < 0) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&y);
        return NULL;
    }
    Py_ssize_t rows = out.len / 8, cols;
    PyObject *result = NULL;
    if (row_shape(&x, &y, rows, &cols) == 0) {
        Py_BEGIN_ALLOW_THREADS dot_rows(x.buf, y.buf, out.buf, rows, cols);
        Py_END_ALLOW_THREADS result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *pair_sums(PyObject *self, PyObject *args) {
    PyObject *oa, *ob, *oout;
    if (!PyArg_ParseTuple(args, "OOO", &oa, &ob, &oout))
        return NULL;
    Py_buffer a, b, out;
    if (get_buffer(oa, &a, "f", 0) < 0)
        return NULL;
    if (get_buffer(ob, &b, "f", 0) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    if (get_buffer(oout, &out, "d", 1) < 0) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_ssize_t rows = out.len / 32, cols;
    PyObject *result = NULL;
    if (out.len % 32 != 0)
        PyErr_SetString(PyExc_ValueError, "the output must hold four sums a row");
    else if (row_shape(&a, &b, rows, &cols) == 0) {
        if (cols % 8 != 0)
            PyErr_SetString(PyExc_ValueError, "rows must hold a multiple of 8 values");
        else {
            double top, bottom;
            int64_t changed;
            Py_BEGIN_ALLOW_THREADS changed = pair_rows(a.buf, b.buf, out.buf, rows, cols, &top, &bottom);
            Py_END_ALLOW_THREADS result = Py_BuildValue("Ldd", (long long)changed, top, bottom);
        }
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"row_dots", row_dots, METH_VARARGS, "row_dots(x, y, out): out[r] = the sum of row r of x * y (float64)."},
    {"pair_sums", pair_sums, METH_VARARGS,
     "pair_sums(a, b, out) -> (changed, top, bottom): per float32 row, the sums of d*d, a*a, b*b, a*b (d = a - b)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", "Fused loops for clipcli's core.", -1, methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
