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
 * configure(...), encode(src, frame, k, transform, cctx, rctx), decode_into(frame, out, dctx): whole frames, one
 *     call per chunk (planes.encode / planes.decode_into; see "Whole frames in C" below).
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
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The split / merge loops stay functions of their own: inlined into a larger function, gcc 12 left merge2 a
 * scalar loop there (2x slower), where on its own it vectorises. */
#if defined(__GNUC__)
#define KERNEL static __attribute__((noinline)) void
#else
#define KERNEL static void
#endif

KERNEL split2(const uint8_t *a, uint8_t *out, size_t m, int transform) {
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

KERNEL split4(const uint8_t *a, uint8_t *out, size_t m, int transform) {
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

KERNEL split8(const uint8_t *a, uint8_t *out, size_t m, int transform) {
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

KERNEL merge2(uint8_t *o, const uint8_t *const *src, size_t m, int transform) {
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

KERNEL merge4(uint8_t *o, const uint8_t *const *src, size_t m, int transform) {
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

KERNEL merge8(uint8_t *o, const uint8_t *const *src, size_t m, int transform) {
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

/* The kernel for element size k (2, 4 or 8). */
static void split_k(const uint8_t *a, uint8_t *out, size_t m, int k, int transform) {
    if (k == 2)
        split2(a, out, m, transform);
    else if (k == 4)
        split4(a, out, m, transform);
    else
        split8(a, out, m, transform);
}

static void merge_k(uint8_t *o, const uint8_t *const *src, size_t m, int k, int transform) {
    if (k == 2)
        merge2(o, src, m, transform);
    else if (k == 4)
        merge4(o, src, m, transform);
    else
        merge8(o, src, m, transform);
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
    split_k((const uint8_t *)src.buf, (uint8_t *)dst.buf, m, k, transform);
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
    merge_k((uint8_t *)dst.buf, ptrs, m, (int)k, transform);
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

/* One row's sample statistics (planes.may_pay's sample: the whole row when m <= 4 * piece, else 4 pieces of
 * piece bytes starting at j * (m / 4)): sum of c log2 c over its byte counts c, the largest count, the sum of
 * c * c, the bytes equal to the one before them in their piece; returns the sample's length. */
static size_t row_stats(const uint8_t *row, size_t m, size_t p, double *xlogx, uint32_t *top, double *sumsq,
                        uint32_t *reps) {
    uint32_t c[256], r = 0, best = 0;
    memset(c, 0, sizeof(c));
    int pieces = m <= 4 * p ? 1 : 4;
    size_t len = m <= 4 * p ? m : p;
    for (int j = 0; j < pieces; j++) {
        const uint8_t *q = row + (size_t)j * (m / 4);
        for (size_t x = 0; x < len; x++) {
            c[q[x]]++;
            r += x && q[x] == q[x - 1];
        }
    }
    double sum = 0.0, sq = 0.0;
    for (int v = 0; v < 256; v++) {
        if (c[v] > 1)
            sum += (double)c[v] * log2((double)c[v]);
        sq += (double)c[v] * (double)c[v];
        if (c[v] > best)
            best = c[v];
    }
    *xlogx = sum;
    *top = best;
    *sumsq = sq;
    *reps = r;
    return len * (size_t)pieces;
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
    double xlogx[8], sumsq[8];
    uint32_t top[8], reps[8];
    size_t m = (size_t)src.len / (size_t)k, p = (size_t)piece;
    const uint8_t *a = (const uint8_t *)src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < k; i++)
        row_stats(a + (size_t)i * m, m, p, &xlogx[i], &top[i], &sumsq[i], &reps[i]);
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

/* ---- Whole frames in C: encode and decode_into of planes.py, one call per chunk with the GIL released. ----
 *
 * Why: in Python a chunk costs ~20-30 us besides its bytes (numpy views, a cffi call per plane, the header's
 * struct calls), which is the whole cost of a LayerNorm's 1 KiB chunk (a model has many) and which holds the GIL
 * while a writer's pool encodes on several threads. zstd is python-zstandard's own copy, called through the
 * function pointers planes.py hands over once (configure(); zstd's stable API: ZSTD_compress2,
 * ZSTD_decompressDCtx, ZSTD_isError, ZSTD_getErrorCode, ZSTD_getErrorName), with the caller's per-thread
 * contexts: no second zstd is linked. The frame is planes.py's (its module docstring and FORMAT.md "The planes
 * codec"); the decisions (may_pay) and every check of decode_into are the same, in the same order, with the same
 * messages (tests compare the frames and the errors with the Python code's). */
typedef size_t (*zstd_code_fn)(void *ctx, void *dst, size_t cap, const void *src, size_t n);
typedef unsigned (*zstd_is_error_fn)(size_t);
typedef int (*zstd_error_code_fn)(size_t);
typedef const char *(*zstd_error_name_fn)(size_t);

static struct {
    zstd_code_fn compress2, decompress_dctx;
    zstd_is_error_fn is_error;
    zstd_error_code_fn error_code;
    zstd_error_name_fn error_name;
    int dst_too_small;
    double min_gain, coder_bytes, runs_excess;
    Py_ssize_t hist_piece;
    int ready;
} Z;

/* configure(compress2, decompressDCtx, isError, getErrorCode, getErrorName, dstSize_tooSmall, min_gain,
 * coder_bytes, hist_piece, runs_excess): the zstd functions (addresses) and planes.py's constants. */
static PyObject *configure(PyObject *self, PyObject *args) {
    unsigned long long c, d, ie, ec, en;
    if (!PyArg_ParseTuple(args, "KKKKKiddnd:configure", &c, &d, &ie, &ec, &en, &Z.dst_too_small, &Z.min_gain,
                          &Z.coder_bytes, &Z.hist_piece, &Z.runs_excess))
        return NULL;
    if (!c || !d || !ie || !ec || !en || Z.hist_piece < 1) {
        PyErr_SetString(PyExc_ValueError, "planes configure: a null function or a sample piece < 1");
        return NULL;
    }
    Z.compress2 = (zstd_code_fn)(uintptr_t)c;
    Z.decompress_dctx = (zstd_code_fn)(uintptr_t)d;
    Z.is_error = (zstd_is_error_fn)(uintptr_t)ie;
    Z.error_code = (zstd_error_code_fn)(uintptr_t)ec;
    Z.error_name = (zstd_error_name_fn)(uintptr_t)en;
    Z.ready = 1;
    Py_RETURN_NONE;
}

/* Per-thread scratch for planes on their way (the encoder's two zstd outputs, the decoder's top two planes),
 * kept from call to call up to SCRATCH_MAX bytes each (a fresh buffer of a plane's size costs its page faults on
 * every chunk: malloc hands large blocks back to the system), freed when the thread ends. */
#define SCRATCH_MAX ((size_t)2 << 20)
typedef struct {
    uint8_t *p[4];
    size_t cap[4];
} scratch_t;
static pthread_key_t scratch_key;
static int scratch_ok;

static void scratch_free(void *v) {
    scratch_t *s = (scratch_t *)v;
    for (int i = 0; i < 4; i++)
        free(s->p[i]);
    free(s);
}

/* A buffer of size bytes: this thread's slot (0-3) when size <= SCRATCH_MAX (*owned = 0), else a new one the
 * caller frees (*owned = 1); NULL when out of memory. */
static uint8_t *scratch(int slot, size_t size, int *owned) {
    *owned = 1;
    if (size == 0)
        size = 1;
    if (size > SCRATCH_MAX || !scratch_ok)
        return (uint8_t *)malloc(size);
    scratch_t *s = (scratch_t *)pthread_getspecific(scratch_key);
    if (s == NULL) {
        if ((s = (scratch_t *)calloc(1, sizeof(*s))) == NULL || pthread_setspecific(scratch_key, s)) {
            free(s);
            return (uint8_t *)malloc(size);
        }
    }
    if (s->cap[slot] < size) {
        size_t cap = size < ((size_t)64 << 10) ? ((size_t)64 << 10) : size;
        uint8_t *p = (uint8_t *)realloc(s->p[slot], cap);
        if (p == NULL)
            return NULL;
        s->p[slot] = p;
        s->cap[slot] = cap;
    }
    *owned = 0;
    return s->p[slot];
}

static int need_z(void) {
    if (!Z.ready)
        PyErr_SetString(PyExc_RuntimeError, "planes: configure() was not called");
    return Z.ready ? 0 : -1;
}

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* planes.may_pay for one row of m bytes: *pays (0/1), *runs (0, 1, 2 = _RUNS_ONLY). */
static void row_decision(const uint8_t *row, size_t m, int *pays, int *runs) {
    double xlogx, sq;
    uint32_t top, r;
    size_t n = row_stats(row, m, (size_t)Z.hist_piece, &xlogx, &top, &sq, &r);
    int pieces = m <= 4 * (size_t)Z.hist_piece ? 1 : 4;
    double dn = (double)n, pairs = (double)(n > (size_t)pieces ? n - (size_t)pieces : 1);
    double bits = (n > 1 ? dn * log2(dn) : 0.0) - xlogx;
    *pays = bits / 8 + Z.coder_bytes * dn / (double)m <= Z.min_gain * dn;
    if ((size_t)top * 10 >= 9 * n) {
        *runs = 2;
    } else if ((size_t)top * 2 > n) {
        double f = (double)top / dn, need = 0.25 * f * (1 - f);
        *runs = (double)r / pairs - sq / (dn * dn) > (need > Z.runs_excess ? need : Z.runs_excess);
    } else {
        *runs = 0;
    }
}

/* One zstd frame of src (m bytes) into dst if it fits in limit bytes: its length, 0 when it does not fit,
 * (size_t)-1 on another zstd error (its name in *err). */
static size_t compress_plane(void *ctx, uint8_t *dst, size_t limit, const uint8_t *src, size_t m,
                             const char **err) {
    size_t r = Z.compress2(ctx, dst, limit, src, m);
    if (Z.is_error(r)) {
        if (Z.error_code(r) == Z.dst_too_small)
            return 0;
        *err = Z.error_name(r);
        return (size_t)-1;
    }
    return r;
}

/* encode(src, frame, k, transform, cctx, rctx) -> end: planes.encode's frame of src (k = 2, 4 or 8) written
 * into frame (a buffer of header_size(k) + len(src) bytes); returns its length (the caller truncates). cctx,
 * rctx: this thread's zstd contexts (addresses) for the skipping and the full match search. */
static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer src, fr;
    int k, transform;
    unsigned long long cctx, rctx;
    if (need_z() < 0 || !PyArg_ParseTuple(args, "y*w*iiKK:encode", &src, &fr, &k, &transform, &cctx, &rctx))
        return NULL;
    PyObject *res = NULL;
    size_t n = (size_t)src.len, m = n / (size_t)k, hs = 16 + 9 * (size_t)k, end = 0;
    if (check_kt(k, transform) < 0)
        goto done;
    if ((size_t)fr.len != hs + n || overlap(&src, &fr)) {
        PyErr_Format(PyExc_ValueError, "planes encode: a frame of %zd bytes for %zd bytes (%zu expected, apart)",
                     fr.len, src.len, hs + n);
        goto done;
    }
    const uint8_t *a = (const uint8_t *)src.buf;
    uint8_t *f = (uint8_t *)fr.buf, *cbuf = NULL, *rbuf = NULL;
    int cown = 0, rown = 0;
    const char *err = NULL;
    size_t limit = (size_t)(Z.min_gain * (double)m);
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    uint8_t *body = f + hs;
    if (m) {
        split_k(a, body, m, k, transform);
    }
    size_t pos = hs;
    for (int i = 0; i < k && !err && !nomem; i++) {
        uint8_t *plane = body + (size_t)i * m;
        int method = 0, pays = 0, runs = 0;
        size_t stored = m;
        if (m)
            row_decision(plane, m, &pays, &runs);
        if (pays) {
            size_t packed = 0, other = 0;
            uint8_t *best = NULL;
            if (runs != 2) {
                if (!cbuf && !(cbuf = scratch(0, limit, &cown))) { nomem = 1; break; }
                packed = compress_plane((void *)(uintptr_t)cctx, cbuf, limit, plane, m, &err);
                if (packed == (size_t)-1)
                    break;
                if (packed)
                    best = cbuf;
            }
            if (runs) {
                if (!rbuf && !(rbuf = scratch(1, limit, &rown))) { nomem = 1; break; }
                other = compress_plane((void *)(uintptr_t)rctx, rbuf, limit, plane, m, &err);
                if (other == (size_t)-1)
                    break;
                if (other && (!best || other < packed)) {
                    best = rbuf;
                    packed = other;
                }
            }
            if (best) {
                method = 1;
                stored = packed;
                memcpy(f + pos, best, stored);       /* ends at or before plane i + 1's raw bytes */
            }
        }
        if (!method && pos != hs + (size_t)i * m)
            memmove(f + pos, plane, m);
        f[16 + 9 * i] = (uint8_t)method;
        put_u64(f + 16 + 9 * i + 1, stored);
        pos += stored;
    }
    if (!err && !nomem) {
        size_t tail = n - m * (size_t)k;
        memcpy(f + pos, a + m * (size_t)k, tail);
        memcpy(f, "CKPL", 4);
        f[4] = 1;
        f[5] = (uint8_t)transform;
        f[6] = f[7] = (uint8_t)k;
        put_u64(f + 8, n);
        end = pos + tail;
    }
    if (cown)
        free(cbuf);
    if (rown)
        free(rbuf);
    Py_END_ALLOW_THREADS
    if (nomem)
        PyErr_NoMemory();
    else if (err)
        PyErr_Format(PyExc_RuntimeError, "zstd: %s", err);
    else
        res = PyLong_FromSize_t(end);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&fr);
    return res;
}

/* decode_into(frame, out, dctx): planes.decode_into in one call (dctx: this thread's zstd decompression context,
 * an address). Every check of the Python code, in its order, with its messages, as ValueError (the caller raises
 * FrameError). */
static PyObject *decode_into(PyObject *self, PyObject *args) {
    Py_buffer fr, out;
    unsigned long long dctx;
    if (need_z() < 0 || !PyArg_ParseTuple(args, "y*w*K:decode_into", &fr, &out, &dctx))
        return NULL;
    PyObject *res = NULL;
    const uint8_t *f = (const uint8_t *)fr.buf;
    size_t len = (size_t)fr.len;
    uint8_t *bufs[8] = {0};     /* the zstd planes' buffers this call owns (freed at the end) */
    if (overlap(&fr, &out)) {
        PyErr_SetString(PyExc_ValueError, "planes frame: the frame overlaps the destination");
        goto done;
    }
    if (len < 16) {
        PyErr_Format(PyExc_ValueError, "planes frame of %zu bytes is shorter than its header", len);
        goto done;
    }
    if (memcmp(f, "CKPL", 4)) {
        PyObject *magic = PyBytes_FromStringAndSize((const char *)f, 4);
        if (magic) {
            PyErr_Format(PyExc_ValueError, "not a planes frame (magic %R)", magic);
            Py_DECREF(magic);
        }
        goto done;
    }
    if (f[4] != 1) {
        PyErr_Format(PyExc_ValueError, "planes frame version %d (this ckptstore reads 1)", (int)f[4]);
        goto done;
    }
    int transform = f[5], k = f[6];
    if (transform > 1 || (k != 1 && k != 2 && k != 4 && k != 8) || f[7] != k) {
        PyErr_Format(PyExc_ValueError, "planes frame header: transform %d, element size %d, %d planes", transform,
                     k, (int)f[7]);
        goto done;
    }
    size_t hs = 16 + 9 * (size_t)k;
    if (len < hs) {
        PyErr_Format(PyExc_ValueError, "planes frame of %zu bytes is shorter than its header (%zu)", len, hs);
        goto done;
    }
    for (int i = 0; i < k; i++) {
        if (f[16 + 9 * i] > 1) {
            PyErr_Format(PyExc_ValueError, "planes frame: unknown plane method %d", (int)f[16 + 9 * i]);
            goto done;
        }
    }
    uint64_t n = get_u64(f + 8);
    if (n != (uint64_t)out.len) {
        PyErr_Format(PyExc_ValueError, "planes frame holds %llu bytes, expected %zd", (unsigned long long)n,
                     out.len);
        goto done;
    }
    size_t m = (size_t)n / (size_t)k, tail = (size_t)n - m * (size_t)k, total = hs + tail;
    uint64_t stored[8];
    for (int i = 0; i < k; i++) {
        int method = f[16 + 9 * i];
        stored[i] = get_u64(f + 16 + 9 * i + 1);
        if ((method == 0 && stored[i] != m) || (method == 1 && !(stored[i] > 0 && stored[i] <= len))) {
            PyErr_Format(PyExc_ValueError, "planes frame: a plane stores %llu bytes for %zu",
                         (unsigned long long)stored[i], m);
            goto done;
        }
        total += (size_t)stored[i];
    }
    if (total != len) {
        PyErr_Format(PyExc_ValueError, "planes frame is %zu bytes, its header adds up to %zu", len, total);
        goto done;
    }
    uint8_t *o = (uint8_t *)out.buf;
    const uint8_t *srcs[8];
    const char *zerr = NULL;
    int bad = -1, big = 0, nomem = 0;
    size_t got = 0;
    Py_BEGIN_ALLOW_THREADS
    size_t pos = hs;
    for (int i = 0; i < k; i++) {
        srcs[i] = f + pos;
        if (f[16 + 9 * i] == 1) {
            uint8_t *dst = o;
            if (k > 1) {                              /* the top two planes in this thread's scratch */
                int owned = 1;
                dst = i >= k - 2 ? scratch(2 + k - 1 - i, m, &owned) : (uint8_t *)malloc(m ? m : 1);
                if (dst == NULL) {
                    nomem = 1;
                    break;
                }
                if (owned)
                    bufs[i] = dst;
            }
            size_t r = Z.decompress_dctx((void *)(uintptr_t)dctx, dst, m, f + pos, (size_t)stored[i]);
            if (Z.is_error(r)) {
                bad = i;
                if (Z.error_code(r) == Z.dst_too_small)
                    big = 1;
                else
                    zerr = Z.error_name(r);
                break;
            }
            if (r != m) {
                bad = i;
                got = r;
                break;
            }
            srcs[i] = dst;
        }
        pos += (size_t)stored[i];
    }
    if (bad < 0 && !nomem) {
        if (k == 1) {
            if (f[16] == 0)
                memcpy(o, srcs[0], m);
        } else if (m) {
            merge_k(o, srcs, m, k, transform);
        }
        memcpy(o + m * (size_t)k, f + pos, tail);
    }
    Py_END_ALLOW_THREADS
    (void)got;
    if (nomem)
        PyErr_NoMemory();
    else if (bad >= 0 && big)
        PyErr_Format(PyExc_ValueError, "planes frame: a plane holds more than its %zu bytes", m);
    else if (bad >= 0 && zerr)
        PyErr_Format(PyExc_ValueError, "planes frame: a plane does not decode (%s)", zerr);
    else if (bad >= 0)
        PyErr_Format(PyExc_ValueError, "planes frame: plane %d decodes to fewer than its %zu bytes", bad, m);
    else {
        res = Py_None;
        Py_INCREF(res);
    }
done:
    for (int i = 0; i < 8; i++)
        free(bufs[i]);
    PyBuffer_Release(&fr);
    PyBuffer_Release(&out);
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
    {"configure", configure, METH_VARARGS, "configure(compress2, decompressDCtx, isError, getErrorCode, getErrorName, dstSize_tooSmall, min_gain, coder_bytes, hist_piece, runs_excess)."},
    {"encode", encode, METH_VARARGS, "encode(src, frame, k, transform, cctx, rctx) -> end: a whole planes frame."},
    {"decode_into", decode_into, METH_VARARGS, "decode_into(frame, out, dctx): a whole planes frame into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes",
                                    "The planes codec's split and merge in C (see planes.py).", -1, methods};

PyMODINIT_FUNC PyInit__planes(void) {
    scratch_ok = pthread_key_create(&scratch_key, scratch_free) == 0;
    return PyModule_Create(&module);
}
