/* The planes codec's split and merge in C (ckptstore/format/planes.py): an optional speed-up, built when the
 * package is installed where a C compiler and Python's headers exist (setup.py marks it optional), with the
 * numpy code in planes.py as the fallback and the reference the tests compare it with, byte for byte.
 *
 * split(src, dst, k, transform): the k byte planes of the m = len(src) / k elements of src into dst (k rows of m
 *     bytes: plane i = byte i of every element, little-endian), the top two regrouped for transform 1.
 * merge(dst, planes, transform): the inverse, from a sequence of k buffers of m bytes each (k = len(planes)).
 * diff(a, b, out, k) / undiff(out, key, k): the delta codec's zigzag-coded difference and its inverse
 *     (ckptstore/format/delta.py).
 * sample_stats(planes, k, piece): per plane, the sum of c log2 c over its sample's byte counts c, the largest
 *     count, the sum of c * c and how many bytes repeat the one before (planes.may_pay's entropy and runs tests).
 *
 * transform 1 (planes.EXPONENT): with T, U the top two bytes of an element, plane k-1 holds (T << 1 | U >> 7) &
 * 0xFF (the 8 bits after the sign: a float32 / bfloat16 exponent) and plane k-2 (U & 0x7F) | (T & 0x80).
 *
 * Why C: numpy does the split at 2-4 GB/s and the merge at 1.5-2 GB/s per core (a truncating cast or a strided
 * byte copy per plane, then the regrouping in extra passes), which alone kept the codec under its goals of 1 GB/s
 * to compress and 3 GB/s to decompress (issue 30). These loops are plain C that compilers vectorise with the
 * baseline instruction set (SSE2 on x86-64): 8 GB/s (float32) and 13 GB/s (bfloat16) per core, measured here
 * (benchmarks/README.md "bench_codec.py"). The GIL is released while they run: a writer encodes chunks on
 * several threads.
 *
 * Every length is checked before anything is read or written (a ValueError names it); buffers may not overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

static void split2(const uint8_t *a, uint8_t *out, size_t m, int transform) {
    uint8_t *p0 = out, *p1 = out + m;
    if (transform) {
        for (size_t i = 0; i < m; i++) {
            uint16_t x;
            memcpy(&x, a + 2 * i, 2);
            uint8_t t = (uint8_t)(x >> 8), u = (uint8_t)x;
            p1[i] = (uint8_t)((t << 1) | (u >> 7));
            p0[i] = (uint8_t)((u & 0x7F) | (t & 0x80));
        }
    } else {
        for (size_t i = 0; i < m; i++) {
            uint16_t x;
            memcpy(&x, a + 2 * i, 2);
            p1[i] = (uint8_t)(x >> 8);
            p0[i] = (uint8_t)x;
        }
    }
}

static void split4(const uint8_t *a, uint8_t *out, size_t m, int transform) {
    uint8_t *p0 = out, *p1 = out + m, *p2 = out + 2 * m, *p3 = out + 3 * m;
    if (transform) {
        for (size_t i = 0; i < m; i++) {
            uint32_t x;
            memcpy(&x, a + 4 * i, 4);
            uint8_t t = (uint8_t)(x >> 24), u = (uint8_t)(x >> 16);
            p0[i] = (uint8_t)x;
            p1[i] = (uint8_t)(x >> 8);
            p3[i] = (uint8_t)((t << 1) | (u >> 7));
            p2[i] = (uint8_t)((u & 0x7F) | (t & 0x80));
        }
    } else {
        for (size_t i = 0; i < m; i++) {
            uint32_t x;
            memcpy(&x, a + 4 * i, 4);
            p0[i] = (uint8_t)x;
            p1[i] = (uint8_t)(x >> 8);
            p2[i] = (uint8_t)(x >> 16);
            p3[i] = (uint8_t)(x >> 24);
        }
    }
}

static void split8(const uint8_t *a, uint8_t *out, size_t m, int transform) {
    for (size_t i = 0; i < m; i++) {
        uint64_t x;
        memcpy(&x, a + 8 * i, 8);
        for (int j = 0; j < 6; j++)
            out[j * m + i] = (uint8_t)(x >> (8 * j));
        uint8_t t = (uint8_t)(x >> 56), u = (uint8_t)(x >> 48);
        if (transform) {
            out[7 * m + i] = (uint8_t)((t << 1) | (u >> 7));
            out[6 * m + i] = (uint8_t)((u & 0x7F) | (t & 0x80));
        } else {
            out[7 * m + i] = t;
            out[6 * m + i] = u;
        }
    }
}

static void merge2(uint8_t *o, const uint8_t *const *src, size_t m, int transform) {
    const uint8_t *p0 = src[0], *p1 = src[1];
    if (transform) {
        for (size_t i = 0; i < m; i++) {
            uint32_t e = p1[i], s = p0[i];
            uint32_t t = (e >> 1) | (s & 0x80), u = ((e & 1) << 7) | (s & 0x7F);
            uint16_t x = (uint16_t)(u | (t << 8));
            memcpy(o + 2 * i, &x, 2);
        }
    } else {
        for (size_t i = 0; i < m; i++) {
            uint16_t x = (uint16_t)(p0[i] | ((uint32_t)p1[i] << 8));
            memcpy(o + 2 * i, &x, 2);
        }
    }
}

static void merge4(uint8_t *o, const uint8_t *const *src, size_t m, int transform) {
    const uint8_t *p0 = src[0], *p1 = src[1], *p2 = src[2], *p3 = src[3];
    if (transform) {
        for (size_t i = 0; i < m; i++) {
            uint32_t e = p3[i], s = p2[i];
            uint32_t t = (e >> 1) | (s & 0x80), u = ((e & 1) << 7) | (s & 0x7F);
            uint32_t x = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | (u << 16) | (t << 24);
            memcpy(o + 4 * i, &x, 4);
        }
    } else {
        for (size_t i = 0; i < m; i++) {
            uint32_t x = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
            memcpy(o + 4 * i, &x, 4);
        }
    }
}

static void merge8(uint8_t *o, const uint8_t *const *src, size_t m, int transform) {
    for (size_t i = 0; i < m; i++) {
        uint64_t x = 0;
        for (int j = 0; j < 6; j++)
            x |= (uint64_t)src[j][i] << (8 * j);
        uint64_t e = src[7][i], s = src[6][i], t = e, u = s;
        if (transform) {
            t = (e >> 1) | (s & 0x80);
            u = ((e & 1) << 7) | (s & 0x7F);
        }
        x |= (u << 48) | (t << 56);
        memcpy(o + 8 * i, &x, 8);
    }
}

static int overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *x = (const char *)a->buf, *y = (const char *)b->buf;
    return a->len && b->len && x < y + b->len && y < x + a->len;
}

static int check_kt(int k, int transform) {
    if (k != 2 && k != 4 && k != 8) {
        PyErr_Format(PyExc_ValueError, "planes: element size %d (the C split/merge take 2, 4 or 8)", k);
        return -1;
    }
    if (transform != 0 && transform != 1) {
        PyErr_Format(PyExc_ValueError, "planes: transform %d (0 or 1)", transform);
        return -1;
    }
    return 0;
}

static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int k, transform;
    if (!PyArg_ParseTuple(args, "y*w*ii:split", &src, &dst, &k, &transform))
        return NULL;
    PyObject *res = NULL;
    if (check_kt(k, transform) < 0)
        goto done;
    if (src.len % k || dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "planes split: %zd bytes of %d-byte elements into %zd bytes", src.len, k,
                     dst.len);
        goto done;
    }
    if (overlap(&src, &dst)) {
        PyErr_SetString(PyExc_ValueError, "planes split: source and destination overlap");
        goto done;
    }
    size_t m = (size_t)src.len / (size_t)k;
    Py_BEGIN_ALLOW_THREADS
    if (k == 2)
        split2((const uint8_t *)src.buf, (uint8_t *)dst.buf, m, transform);
    else if (k == 4)
        split4((const uint8_t *)src.buf, (uint8_t *)dst.buf, m, transform);
    else
        split8((const uint8_t *)src.buf, (uint8_t *)dst.buf, m, transform);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return res;
}

static PyObject *merge(PyObject *self, PyObject *args) {
    Py_buffer dst, planes[8];
    PyObject *seq, *fast = NULL, *res = NULL;
    int transform, got = 0;
    if (!PyArg_ParseTuple(args, "w*Oi:merge", &dst, &seq, &transform))
        return NULL;
    fast = PySequence_Fast(seq, "planes merge: planes must be a sequence of buffers");
    if (fast == NULL)
        goto done;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    if (k != 2 && k != 4 && k != 8) {
        PyErr_Format(PyExc_ValueError, "planes merge: %zd planes (the C merge takes 2, 4 or 8)", k);
        goto done;
    }
    if (check_kt((int)k, transform) < 0)
        goto done;
    size_t m = (size_t)dst.len / (size_t)k;
    if (dst.len % k) {
        PyErr_Format(PyExc_ValueError, "planes merge: %zd bytes are not %zd-byte elements", dst.len, k);
        goto done;
    }
    const uint8_t *ptrs[8];
    for (; got < k; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &planes[got], PyBUF_SIMPLE) < 0)
            goto done;
        if ((size_t)planes[got].len != m) {
            PyErr_Format(PyExc_ValueError, "planes merge: plane %d holds %zd bytes, %zu expected", got,
                         planes[got].len, m);
            got++;
            goto done;
        }
        if (overlap(&planes[got], &dst)) {
            PyErr_Format(PyExc_ValueError, "planes merge: plane %d overlaps the destination", got);
            got++;
            goto done;
        }
        ptrs[got] = (const uint8_t *)planes[got].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    if (k == 2)
        merge2((uint8_t *)dst.buf, ptrs, m, transform);
    else if (k == 4)
        merge4((uint8_t *)dst.buf, ptrs, m, transform);
    else
        merge8((uint8_t *)dst.buf, ptrs, m, transform);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&planes[i]);
    Py_XDECREF(fast);
    PyBuffer_Release(&dst);
    return res;
}

/* sample_stats(planes, k, piece): for each of the k rows of planes (k * m bytes), over the whole row when
 * m <= 4 * piece, else over 4 pieces of piece bytes starting at j * (m / 4), j = 0..3 (planes.may_pay's sample):
 * (sum over byte values of c * log2(c) for the values' counts c, the largest count, the sum of c * c, the number
 * of bytes equal to the one before them in their piece), as a tuple of k tuples. */
static PyObject *sample_stats(PyObject *self, PyObject *args) {
    Py_buffer src;
    int k;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "y*in:sample_stats", &src, &k, &piece))
        return NULL;
    PyObject *res = NULL;
    if (k < 1 || k > 8 || src.len % k || piece < 1) {
        PyErr_Format(PyExc_ValueError, "planes sample_stats: %zd bytes in %d planes, pieces of %zd", src.len, k,
                     piece);
        goto done;
    }
    uint32_t c[8][256];
    double xlogx[8], sumsq[8];
    uint32_t top[8], reps[8];
    memset(c, 0, sizeof(c));
    size_t m = (size_t)src.len / (size_t)k, p = (size_t)piece;
    const uint8_t *a = (const uint8_t *)src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < k; i++) {
        const uint8_t *row = a + (size_t)i * m;
        uint32_t *ci = c[i], r = 0;
        int pieces = m <= 4 * p ? 1 : 4;
        size_t len = m <= 4 * p ? m : p;
        for (int j = 0; j < pieces; j++) {
            const uint8_t *q = row + (size_t)j * (m / 4);
            for (size_t x = 0; x < len; x++) {
                ci[q[x]]++;
                r += x && q[x] == q[x - 1];
            }
        }
        double sum = 0.0, sq = 0.0;
        uint32_t best = 0;
        for (int v = 0; v < 256; v++) {
            if (ci[v] > 1)
                sum += (double)ci[v] * log2((double)ci[v]);
            sq += (double)ci[v] * (double)ci[v];
            if (ci[v] > best)
                best = ci[v];
        }
        xlogx[i] = sum;
        sumsq[i] = sq;
        top[i] = best;
        reps[i] = r;
    }
    Py_END_ALLOW_THREADS
    res = PyTuple_New(k);
    if (res == NULL)
        goto done;
    for (int i = 0; i < k; i++) {
        PyObject *t = Py_BuildValue("(dIdI)", xlogx[i], top[i], sumsq[i], reps[i]);
        if (t == NULL) {
            Py_CLEAR(res);
            goto done;
        }
        PyTuple_SET_ITEM(res, i, t);
    }
done:
    PyBuffer_Release(&src);
    return res;
}

/* diff(a, b, out, k): out = the zigzag-coded difference a - b of a and b read as k-byte little-endian integers
 * (k = 2, 4 or 8; modulo 2^(8k)), the last len mod k bytes XORed (delta.diff's). undiff(out, key, k): the inverse
 * in place, out = key + unzigzag(out). */
#define ZZ_LOOP(T, ST, BITS)                                                                                      \
    for (size_t i = 0; i < m; i++) {                                                                          \
        T x, y;                                                                                                \
        memcpy(&x, a + i * sizeof(T), sizeof(T));                                                              \
        memcpy(&y, b + i * sizeof(T), sizeof(T));                                                              \
        T d = (T)(x - y);                                                                                      \
        T z = (T)((T)(d << 1) ^ (T)(-(T)(d >> (BITS - 1))));                                                   \
        memcpy(o + i * sizeof(T), &z, sizeof(T));                                                              \
    }
#define UNZZ_LOOP(T, BITS)                                                                                        \
    for (size_t i = 0; i < m; i++) {                                                                          \
        T z, y;                                                                                                \
        memcpy(&z, o + i * sizeof(T), sizeof(T));                                                              \
        memcpy(&y, b + i * sizeof(T), sizeof(T));                                                              \
        T d = (T)((T)(z >> 1) ^ (T)(-(T)(z & 1)));                                                             \
        T x = (T)(y + d);                                                                                      \
        memcpy(o + i * sizeof(T), &x, sizeof(T));                                                              \
    }

static PyObject *zigzag(PyObject *args, int inverse) {
    Py_buffer A, B, O;
    int k;
    PyObject *res = NULL;
    if (inverse) {
        if (!PyArg_ParseTuple(args, "w*y*i:undiff", &O, &B, &k))
            return NULL;
        A.buf = NULL;
        A.obj = NULL;
        A.len = O.len;
    } else if (!PyArg_ParseTuple(args, "y*y*w*i:diff", &A, &B, &O, &k)) {
        return NULL;
    }
    if (k != 2 && k != 4 && k != 8) {
        PyErr_Format(PyExc_ValueError, "delta: element size %d (2, 4 or 8)", k);
        goto done;
    }
    if (A.len != B.len || O.len != B.len) {
        PyErr_Format(PyExc_ValueError, "delta: %zd, %zd and %zd bytes", A.len, B.len, O.len);
        goto done;
    }
    if ((!inverse && overlap(&A, &O)) || overlap(&B, &O)) {
        PyErr_SetString(PyExc_ValueError, "delta: the output overlaps an input");
        goto done;
    }
    size_t n = (size_t)O.len, m = n / (size_t)k, w = m * (size_t)k;
    const uint8_t *a = (const uint8_t *)A.buf, *b = (const uint8_t *)B.buf;
    uint8_t *o = (uint8_t *)O.buf;
    Py_BEGIN_ALLOW_THREADS
    if (inverse) {
        if (k == 2) { UNZZ_LOOP(uint16_t, 16) } else if (k == 4) { UNZZ_LOOP(uint32_t, 32) } else { UNZZ_LOOP(uint64_t, 64) }
        for (size_t i = w; i < n; i++)
            o[i] ^= b[i];
    } else {
        if (k == 2) { ZZ_LOOP(uint16_t, int16_t, 16) } else if (k == 4) { ZZ_LOOP(uint32_t, int32_t, 32) } else { ZZ_LOOP(uint64_t, int64_t, 64) }
        for (size_t i = w; i < n; i++)
            o[i] = a[i] ^ b[i];
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    if (!inverse)
        PyBuffer_Release(&A);
    PyBuffer_Release(&B);
    PyBuffer_Release(&O);
    return res;
}

static PyObject *diff(PyObject *self, PyObject *args) { return zigzag(args, 0); }
static PyObject *undiff(PyObject *self, PyObject *args) { return zigzag(args, 1); }

static PyMethodDef methods[] = {
    {"diff", diff, METH_VARARGS, "diff(a, b, out, k): the zigzag-coded k-byte integer difference a - b into out."},
    {"undiff", undiff, METH_VARARGS, "undiff(out, key, k): the inverse of diff, in place."},
    {"sample_stats", sample_stats, METH_VARARGS, "sample_stats(planes, k, piece): (sum c log2 c, top count, sum c*c, repeats) a plane."},
    {"split", split, METH_VARARGS, "split(src, dst, k, transform): the k byte planes of src's elements into dst."},
    {"merge", merge, METH_VARARGS, "merge(dst, planes, transform): the elements of k byte planes into dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes",
                                    "The planes codec's split and merge in C (see planes.py).", -1, methods};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
