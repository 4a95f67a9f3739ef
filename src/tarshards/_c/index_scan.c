/* Indexing existing shards while reading them (index_members). */
#include "speedups.h"

/* index_members(buf, pos, base, end, last_dot, codes, keys, samples, members, key, checksum)
 *     -> (pos, key)
 * index.IndexBuilder.add for a run of plain ustar members lying wholly in buf[:end] (the
 * conditions of scan_members, and ASCII names), without copying their data: appends to the
 * bytearray samples (tar offset, end, flags: three i64 per new sample), to the list keys (its
 * key), to the bytearray members (sample, extension code, header offset, data offset, size,
 * checksum(data): six 64-bit values per member; data: a read-only memoryview over buf, released
 * after the call) and extends the current sample's end. key is the current sample's key (str or
 * None). Stops at anything else; Python takes over there. */
PyObject *
index_members(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, n;
    long long base;
    int last_dot;
    PyObject *codes, *keys, *samples, *members, *key, *checksum;
    if (!PyArg_ParseTuple(args, "y*nLnpO!O!O!O!OO", &view, &pos, &base, &n, &last_dot,
                          &PyDict_Type, &codes, &PyList_Type, &keys, &PyByteArray_Type,
                          &samples, &PyByteArray_Type, &members, &key, &checksum))
        return NULL;
    if (!(PyCallable_Check(checksum) || PyCapsule_CheckExact(checksum))) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "index_members: checksum must be callable or a capsule");
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)view.buf;
    if (n > view.len || n < 0)
        n = view.len;
    Py_INCREF(key);
    const char *kdata = NULL; /* the current key's bytes, when it is ASCII */
    Py_ssize_t kl = -1;
    if (key != Py_None && PyUnicode_Check(key) && PyUnicode_IS_ASCII(key)) {
        kdata = (const char *)PyUnicode_DATA(key);
        kl = PyUnicode_GET_LENGTH(key);
    }
    PyObject *last_ext = NULL; /* a one-entry cache of (extension bytes -> code) */
    long long last_code = -1;
    while (n - pos >= BLOCK) {
        const unsigned char *h = buf + pos;
        long long size;
        if (!tar_plain_header(h, &size))
            break;
        if (tar_padded(size) > n - pos - BLOCK)
            break; /* data and padding wholly in buf: pos never passes end */
        Py_ssize_t len = (Py_ssize_t)tar_name_len(h);
        int ascii = 1;
        for (Py_ssize_t i = 0; i < len; i++)
            if (h[i] >= 0x80) {
                ascii = 0;
                break;
            }
        if (!ascii)
            break;
        long long hoff = base + pos, doff = hoff + BLOCK;
        long long endoff = doff + tar_padded(size);
        pos += BLOCK + (Py_ssize_t)tar_padded(size);
        size_t skip, split; /* the reader's naming rules (IndexBuilder.add, names.h) */
        if (!name_split(h, (size_t)len, last_dot, &skip, &split))
            continue;
        const char *name = (const char *)h + skip;
        int dot_slash = skip != 0;
        len -= (Py_ssize_t)skip;
        Py_ssize_t dot = (Py_ssize_t)split;
        uint64_t sum; /* before any record changes: a failing call leaves them whole */
        if (call_checksum_mem(checksum, h + BLOCK, (Py_ssize_t)size, &sum) < 0)
            goto fail;
        if (!(kdata != NULL && kl == dot && memcmp(kdata, name, (size_t)dot) == 0)) {
            PyObject *k = PyUnicode_DecodeASCII(name, dot, NULL);
            if (k == NULL)
                goto fail;
            if (PyList_Append(keys, k) < 0) {
                Py_DECREF(k);
                goto fail;
            }
            Py_DECREF(key);
            key = k;
            kdata = (const char *)PyUnicode_DATA(k);
            kl = dot;
            Py_ssize_t old = PyByteArray_GET_SIZE(samples);
            if (PyByteArray_Resize(samples, old + 24) < 0)
                goto fail;
            unsigned char *r = (unsigned char *)PyByteArray_AS_STRING(samples) + old;
            put_u64(r, (uint64_t)hoff);
            put_u64(r + 8, (uint64_t)endoff);
            put_u64(r + 16, dot_slash ? 1 : 0);
        } else {
            Py_ssize_t sz = PyByteArray_GET_SIZE(samples);
            if (sz < 24) { /* a key without its sample record: not ours to fix */
                PyErr_SetString(PyExc_ValueError, "index_members: key given without samples");
                goto fail;
            }
            put_u64((unsigned char *)PyByteArray_AS_STRING(samples) + sz - 16, (uint64_t)endoff);
        }
        Py_ssize_t elen = len - dot - 1;
        long long code;
        if (last_ext != NULL && PyBytes_GET_SIZE(last_ext) == elen &&
            memcmp(PyBytes_AS_STRING(last_ext), name + dot + 1, (size_t)elen) == 0) {
            code = last_code;
        } else {
            PyObject *ext = PyUnicode_DecodeASCII(name + dot + 1, elen, NULL);
            if (ext == NULL)
                goto fail;
            code = ext_code(codes, ext);
            Py_DECREF(ext);
            if (code < 0)
                goto fail;
            Py_XDECREF(last_ext);
            last_ext = PyBytes_FromStringAndSize(name + dot + 1, elen);
            if (last_ext == NULL)
                goto fail;
            last_code = code;
        }
        Py_ssize_t nsamples = PyList_GET_SIZE(keys);
        Py_ssize_t old = PyByteArray_GET_SIZE(members);
        if (PyByteArray_Resize(members, old + 48) < 0)
            goto fail;
        unsigned char *r = (unsigned char *)PyByteArray_AS_STRING(members) + old;
        put_u64(r, (uint64_t)(nsamples - 1));
        put_u64(r + 8, (uint64_t)code);
        put_u64(r + 16, (uint64_t)hoff);
        put_u64(r + 24, (uint64_t)doff);
        put_u64(r + 32, (uint64_t)size);
        put_u64(r + 40, sum);
    }
    Py_XDECREF(last_ext);
    PyBuffer_Release(&view);
    return Py_BuildValue("(nN)", pos, key);
fail:
    Py_XDECREF(last_ext);
    Py_DECREF(key);
    PyBuffer_Release(&view);
    return NULL;
}
