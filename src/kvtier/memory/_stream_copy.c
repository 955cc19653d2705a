/* kvtier.memory._stream_copy: copy a large buffer with streaming (non-temporal) stores.
 *
 * Why: a plain memcpy of a piece that fits in cache writes through the cache, so every
 * destination line is first read from memory (read-for-ownership) and later written back:
 * three memory transfers per byte moved. Streaming stores write the destination straight to
 * memory: two transfers, the least a copy can do. kvtier copies chunks of tens of MiB that
 * nobody reads again soon (the PD receive buffer, a page served out of it), so keeping them
 * out of the cache costs nothing.
 *
 * The GIL is released for the copy, so two Python threads copy in parallel. The stores are
 * fenced before returning: another process that learns of the copy afterwards (a message on
 * a socket) sees every byte.
 *
 * Where SSE2 is missing (not x86-64) this is memcpy.
 *
 * copy_hash copies and hashes in the same pass (the kernel and its why: _copy_hash.h), also
 * without the GIL: the PD chunk checksum of kvtier.pd.checksum, computed where the bytes are
 * copied, so two threads copy and hash at once. Built only where xxhash.h is found.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KVT_COPY_HASH_NAME kvt_copy_hash_default
#include "_copy_hash.h"


static void copy_streaming(char *dst, const char *src, size_t n) {
    kvt_copy_streaming(dst, src, n);
    kvt_store_fence();
}

static PyObject *stream_copy(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:stream_copy", &dst, &src)) {
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError,
                     "stream_copy: destination has %zd bytes, source %zd; they must be equal",
                     dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_streaming((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

#ifdef KVT_HAVE_XXHASH
/* The kernels this CPU can run, best first: copy_hash uses the first unless told another. */
typedef struct {
    const char *isa;
    kvt_copy_hash_fn fn;
} kernel_entry;

static kernel_entry kernels[3];
static int kernel_count = 0;

static void find_kernels(void) {
#ifdef KVT_X86_ISAS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        kernels[kernel_count++] = (kernel_entry){"avx512", kvt_copy_hash_avx512};
    }
    if (__builtin_cpu_supports("avx2")) {
        kernels[kernel_count++] = (kernel_entry){"avx2", kvt_copy_hash_avx2};
    }
#endif
    kernels[kernel_count++] = (kernel_entry){"default", kvt_copy_hash_default};
}

static kvt_copy_hash_fn kernel_named(const char *isa) {
    for (int i = 0; i < kernel_count; i++) {
        if (isa == NULL || strcmp(isa, kernels[i].isa) == 0) {
            return kernels[i].fn;
        }
    }
    PyErr_Format(PyExc_ValueError, "copy_hash: isa '%s' is not one this CPU runs (HASH_ISAS)",
                 isa);
    return NULL;
}

/* The buffers of one copy_hash call, taken under the GIL and released together. */
typedef struct {
    Py_buffer *views; /* sources, then destinations */
    Py_ssize_t taken;
    kvt_piece *pieces;
} held_pieces;

static void release_pieces(held_pieces *held) {
    for (Py_ssize_t i = 0; i < held->taken; i++) {
        PyBuffer_Release(&held->views[i]);
    }
    PyMem_Free(held->views);
    PyMem_Free(held->pieces);
}

/* Takes every buffer and fills held->pieces; on an error releases what it took. */
static int take_pieces(PyObject *dsts, PyObject *srcs, Py_ssize_t count, held_pieces *held) {
    held->views = PyMem_Calloc((size_t)(2 * count + 1), sizeof(Py_buffer));
    held->pieces = PyMem_Calloc((size_t)(count + 1), sizeof(kvt_piece));
    held->taken = 0;
    if (held->views == NULL || held->pieces == NULL) {
        release_pieces(held);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_buffer *src = &held->views[held->taken];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(srcs, i), src, PyBUF_SIMPLE) < 0) {
            goto fail;
        }
        held->taken++;
        held->pieces[i].src = src->buf;
        held->pieces[i].len = (size_t)src->len;
        if (dsts == NULL) {
            continue;
        }
        Py_buffer *dst = &held->views[held->taken];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dsts, i), dst, PyBUF_WRITABLE) < 0) {
            goto fail;
        }
        held->taken++;
        held->pieces[i].dst = dst->buf;
        if (dst->len != src->len) {
            PyErr_Format(PyExc_ValueError,
                         "copy_hash: piece %zd: destination has %zd bytes, source %zd; they "
                         "must be equal", i, dst->len, src->len);
            goto fail;
        }
    }
    return 0;
fail:
    release_pieces(held);
    return -1;
}

static PyObject *digests_bytes(const uint64_t *digests, size_t n) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * n));
    if (out == NULL) {
        return NULL;
    }
    unsigned char *bytes = (unsigned char *)PyBytes_AS_STRING(out);
    for (size_t i = 0; i < n; i++) {
        for (int b = 0; b < 8; b++) { /* little-endian, whatever the host */
            bytes[8 * i + b] = (unsigned char)(digests[i] >> (8 * b));
        }
    }
    return out;
}

static PyObject *copy_hash(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *dst_arg, *src_arg;
    Py_ssize_t block, stream_min;
    const char *isa = NULL;
    if (!PyArg_ParseTuple(args, "OOnn|s:copy_hash", &dst_arg, &src_arg, &block, &stream_min,
                          &isa)) {
        return NULL;
    }
    kvt_copy_hash_fn kernel = kernel_named(isa);
    if (kernel == NULL) {
        return NULL;
    }
    if (block <= 0 || stream_min < 0) {
        PyErr_Format(PyExc_ValueError,
                     "copy_hash: block_bytes must be > 0 and stream_min >= 0, got %zd and %zd",
                     block, stream_min);
        return NULL;
    }
    PyObject *srcs = PySequence_Fast(src_arg, "copy_hash: srcs must be a sequence of buffers");
    PyObject *dsts = NULL;
    PyObject *result = NULL;
    if (srcs == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(srcs);
    if (dst_arg != Py_None) {
        dsts = PySequence_Fast(dst_arg, "copy_hash: dsts must be None or a sequence of buffers");
        if (dsts == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(dsts) != count) {
            PyErr_Format(PyExc_ValueError, "copy_hash: %zd destinations for %zd sources",
                         PySequence_Fast_GET_SIZE(dsts), count);
            goto done;
        }
    }
    held_pieces held;
    if (take_pieces(dsts, srcs, count, &held) < 0) {
        goto done;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        total += held.pieces[i].len;
    }
    size_t blocks = (total + (size_t)block - 1) / (size_t)block;
    uint64_t *digests = PyMem_Malloc((blocks + 1) * sizeof(uint64_t));
    if (digests == NULL) {
        PyErr_NoMemory();
    } else {
        size_t n;
        Py_BEGIN_ALLOW_THREADS
        n = kernel(held.pieces, (size_t)count, (size_t)block, (size_t)stream_min,
                             digests);
        Py_END_ALLOW_THREADS
        result = digests_bytes(digests, n);
        PyMem_Free(digests);
    }
    release_pieces(&held);
done:
    Py_XDECREF(dsts);
    Py_DECREF(srcs);
    return result;
}
#endif /* KVT_HAVE_XXHASH */

static PyMethodDef methods[] = {
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src): copy src's bytes into dst (both contiguous, equal sizes) with\n"
     "streaming stores, without the GIL."},
#ifdef KVT_HAVE_XXHASH
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(dsts, srcs, block_bytes, stream_min[, isa]) -> bytes: the pieces srcs, as one\n"
     "stream cut into blocks of block_bytes, hashed (xxh3-64 per block, 8 little-endian bytes\n"
     "each) and, unless dsts is None, copied into dsts (equal sizes; pieces of stream_min bytes\n"
     "or more with streaming stores), in one pass without the GIL. isa: one of HASH_ISAS\n"
     "(default: HASH_ISA, the first)."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvtier.memory._stream_copy",
    "Large copies with streaming stores, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__stream_copy(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "STREAMING", STREAMING) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#ifdef KVT_HAVE_XXHASH
    find_kernels();
    PyObject *isas = PyTuple_New(kernel_count);
    for (int i = 0; isas != NULL && i < kernel_count; i++) {
        PyTuple_SET_ITEM(isas, i, PyUnicode_FromString(kernels[i].isa));
    }
    if (PyModule_AddStringConstant(module, "HASH_ISA", kernels[0].isa) < 0 ||
        PyModule_AddObject(module, "HASH_ISAS", isas) < 0) {
        Py_XDECREF(isas);
        Py_DECREF(module);
        return NULL;
    }
#endif
    return module;
}
