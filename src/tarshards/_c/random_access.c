/* Random access through an index: a header checked at its offset (header_ok), one sample read
 * from a local plain shard (read_sample). */
#include "speedups.h"

/* header_ok(data, at, size) -> bool
 * Whether data[at:at + 512] is a tar header whose checksum (unsigned, six octal digits as the
 * usual writers put them) is right and which, when it is a regular member's ('0' or NUL),
 * stores size (canonical 11 octal digits). False means only "not shown here": the Python check
 * (indexed._check_header) decides and words the error. */
PyObject *
header_ok(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t at;
    long long size;
    if (!PyArg_ParseTuple(args, "y*nL", &view, &at, &size))
        return NULL;
    int ok = 0;
    if (at >= 0 && view.len - at >= BLOCK)
        ok = tar_header_ok((const unsigned char *)view.buf + at, size);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* read_sample(fd, start, end, base, first, data_offsets, sizes, exts, m0, m1, key, url)
 *   -> dict or None
 * IndexedDataset's ds[i] for a local plain shard: bytes start:end of the file (one pread, no
 * GIL), the first member's header (at tar offset first) checked as header_ok does, and the
 * sample dict {"__key__": key, "__url__": url, "__offset__": base, exts[m]: its bytes} of
 * members m0:m1, whose data lie at data_offsets[m] (tar offsets; the sample's first header is at
 * base, file offset start) with sizes[m]. None where the read comes short or the header does not
 * fit (the Python path then says why). */
PyObject *
read_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12 || !PyList_Check(args[5]) || !PyList_Check(args[6]) ||
        !PyList_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError,
                        "read_sample(fd, start, end, base, first, data_offsets: list, sizes: "
                        "list, exts: list, m0, m1, key, url)");
        return NULL;
    }
    int fd = PyLong_AsLong(args[0]);
    long long start = PyLong_AsLongLong(args[1]), end = PyLong_AsLongLong(args[2]);
    long long base = PyLong_AsLongLong(args[3]), first = PyLong_AsLongLong(args[4]);
    Py_ssize_t m0 = PyLong_AsSsize_t(args[8]), m1 = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *doffs = args[5], *sizes = args[6], *exts = args[7];
    if (end < start || m0 < 0 || m1 < m0 || m1 > PyList_GET_SIZE(doffs) ||
        m1 > PyList_GET_SIZE(sizes) || m1 > PyList_GET_SIZE(exts))
        Py_RETURN_NONE;
    size_t n = (size_t)(end - start);
    char stack[16384];
    char *buf = n <= sizeof stack ? stack : (char *)PyMem_Malloc(n ? n : 1);
    if (buf == NULL)
        return PyErr_NoMemory();
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    got = pread(fd, buf, n, (off_t)start);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    long long at = first - base;
    if (got != (ssize_t)n || at < 0 || at + BLOCK > (long long)n)
        goto none;
    PyObject *size0 = PyList_GET_ITEM(sizes, m0 < m1 ? m0 : 0);
    if (m0 < m1 && !tar_header_ok((const unsigned char *)buf + at, PyLong_AsLongLong(size0)))
        goto none;
    out = PyDict_New();
    if (out == NULL)
        goto done;
    PyObject *offset = PyLong_FromLongLong(base);
    if (offset == NULL || PyDict_SetItem(out, KEY_STR, args[10]) < 0 ||
        PyDict_SetItem(out, URL_STR, args[11]) < 0 || PyDict_SetItem(out, OFFSET_STR, offset) < 0) {
        Py_XDECREF(offset);
        goto fail;
    }
    Py_DECREF(offset);
    for (Py_ssize_t m = m0; m < m1; m++) {
        long long a = PyLong_AsLongLong(PyList_GET_ITEM(doffs, m)) - base;
        long long size = PyLong_AsLongLong(PyList_GET_ITEM(sizes, m));
        if (PyErr_Occurred())
            goto fail;
        if (a < 0 || size < 0 || a + size > (long long)n) { /* an index of another file */
            Py_CLEAR(out);
            goto none;
        }
        PyObject *v = PyBytes_FromStringAndSize(buf + a, (Py_ssize_t)size);
        if (v == NULL)
            goto fail;
        int rc = PyDict_SetItem(out, PyList_GET_ITEM(exts, m), v);
        Py_DECREF(v);
        if (rc < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
    goto done;
none:
    out = Py_None;
    Py_INCREF(out);
done:
    if (buf != stack)
        PyMem_Free(buf);
    return out;
}
