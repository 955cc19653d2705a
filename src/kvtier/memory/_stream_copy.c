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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>

static void copy_streaming(char *dst, const char *src, size_t n) {
    /* Streaming stores need a 16-byte aligned destination: copy the head plainly. */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence();
}
#define STREAMING 1
#else
static void copy_streaming(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#define STREAMING 0
#endif

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

static PyMethodDef methods[] = {
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src): copy src's bytes into dst (both contiguous, equal sizes) with\n"
     "streaming stores, without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvtier.memory._stream_copy",
    "Large copies with streaming stores, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__stream_copy(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddIntConstant(module, "STREAMING", STREAMING) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
