/* Optional C accelerator for the two per-member hot loops of tarshards.
 *
 * scan_members: the fast path of tario.iter_tar_batches (plain ustar members lying wholly in a
 *               buffer, header checksums verified exactly).
 * group_members: the loop of format.group_samples over one batch of members.
 *
 * Both stop (rather than raise) at anything unusual, and the pure Python code takes over from
 * there, so the Python implementation stays the single definition of behaviour and of errors.
 * tests/test_speedups.py checks that both paths agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define BLOCK 512

static int
parse_octal(const unsigned char *p, Py_ssize_t len, long long *out)
{
    /* canonical field: optional leading spaces, octal digits to the end of the field */
    Py_ssize_t i = 0;
    long long v = 0;
    while (i < len && p[i] == ' ')
        i++;
    if (i == len)
        return 0;
    for (; i < len; i++) {
        unsigned char c = p[i];
        if (c < '0' || c > '7')
            return 0;
        v = v * 8 + (c - '0');
    }
    *out = v;
    return 1;
}

/* scan_members(buf, pos, base, end) -> (members, pos)
 * members: list of (name, data, offset) for consecutive plain members; stops at the first header
 * that is not a canonical '0' member fully inside buf, or whose checksum does not match. */
static PyObject *
scan_members(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, n;
    long long base;
    if (!PyArg_ParseTuple(args, "y*nLn", &view, &pos, &base, &n))
        return NULL;
    const unsigned char *buf = (const unsigned char *)view.buf;
    if (n > view.len || n < 0)
        n = view.len;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    while (n - pos >= BLOCK) {
        const unsigned char *h = buf + pos;
        long long size, stored;
        if (h[156] != '0' || h[135] != 0 || h[345] != 0)
            break;
        if (!parse_octal(h + 124, 11, &size))
            break;
        if (size > n - pos - BLOCK)
            break;
        if (h[154] != 0 && h[154] != ' ')
            break;
        if (!parse_octal(h + 148, 6, &stored))
            break;
        unsigned long sum = 0;
        for (int i = 0; i < BLOCK; i++)
            sum += h[i];
        for (int i = 148; i < 156; i++)
            sum -= h[i];
        sum += 8 * ' ';
        if ((long long)sum != stored)
            break; /* the Python path decides (and raises) */
        const unsigned char *nul = memchr(h, 0, 100);
        Py_ssize_t namelen = nul ? (Py_ssize_t)(nul - h) : 100;
        PyObject *name = PyUnicode_DecodeUTF8((const char *)h, namelen, "surrogateescape");
        if (name == NULL)
            goto fail;
        PyObject *data = PyBytes_FromStringAndSize((const char *)h + BLOCK, (Py_ssize_t)size);
        if (data == NULL) {
            Py_DECREF(name);
            goto fail;
        }
        PyObject *off = PyLong_FromLongLong(base + pos);
        if (off == NULL) {
            Py_DECREF(name);
            Py_DECREF(data);
            goto fail;
        }
        PyObject *t = PyTuple_Pack(3, name, data, off);
        Py_DECREF(name);
        Py_DECREF(data);
        Py_DECREF(off);
        if (t == NULL)
            goto fail;
        int rc = PyList_Append(out, t);
        Py_DECREF(t);
        if (rc < 0)
            goto fail;
        pos += BLOCK + ((size + 511) & ~(long long)511);
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(Nn)", out, pos);
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *KEY_STR, *URL_STR;

/* group_members(batch, start, url, last_dot, sample, key) -> (samples, sample, key, stop)
 * Groups batch[start:] like format.group_samples. stop is the index of a member that repeats an
 * extension of the current sample (not consumed), or -1. */
static PyObject *
group_members(PyObject *self, PyObject *args)
{
    PyObject *batch, *url, *sample, *key;
    Py_ssize_t start;
    int last_dot;
    if (!PyArg_ParseTuple(args, "O!nOpOO", &PyList_Type, &batch, &start, &url, &last_dot,
                          &sample, &key))
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_INCREF(sample);
    Py_INCREF(key);
    Py_ssize_t stop = -1;
    Py_ssize_t count = PyList_GET_SIZE(batch);
    for (Py_ssize_t i = start; i < count; i++) {
        PyObject *member = PyList_GET_ITEM(batch, i);
        if (!PyTuple_Check(member) || PyTuple_GET_SIZE(member) != 3) {
            PyErr_SetString(PyExc_TypeError, "members are (name, data, offset) tuples");
            goto fail;
        }
        PyObject *nameobj = PyTuple_GET_ITEM(member, 0);
        PyObject *data = PyTuple_GET_ITEM(member, 1);
        if (!PyUnicode_Check(nameobj)) {
            PyErr_SetString(PyExc_TypeError, "member names are str");
            goto fail;
        }
        Py_ssize_t len = PyUnicode_GET_LENGTH(nameobj);
        Py_ssize_t s0 = 0;
        if (len >= 2 && PyUnicode_READ_CHAR(nameobj, 0) == '.' &&
            PyUnicode_READ_CHAR(nameobj, 1) == '/')
            s0 = 2;
        Py_ssize_t slash = PyUnicode_FindChar(nameobj, '/', s0, len, -1);
        if (slash == -2)
            goto fail;
        Py_ssize_t b = slash >= 0 ? slash + 1 : s0;
        if (len - b >= 2 && PyUnicode_READ_CHAR(nameobj, b) == '_' &&
            PyUnicode_READ_CHAR(nameobj, b + 1) == '_')
            continue;
        Py_ssize_t dot = PyUnicode_FindChar(nameobj, '.', b, len, last_dot ? -1 : 1);
        if (dot == -2)
            goto fail;
        if (dot <= b || dot == len - 1)
            continue;
        PyObject *k = PyUnicode_Substring(nameobj, s0, dot);
        if (k == NULL)
            goto fail;
        PyObject *ext = PyUnicode_Substring(nameobj, dot + 1, len);
        if (ext == NULL) {
            Py_DECREF(k);
            goto fail;
        }
        /* lower-case the extension unless it already is */
        int needs_lower = 0;
        Py_ssize_t elen = PyUnicode_GET_LENGTH(ext);
        for (Py_ssize_t j = 0; j < elen; j++) {
            Py_UCS4 c = PyUnicode_READ_CHAR(ext, j);
            if (c >= 128 || (c >= 'A' && c <= 'Z')) {
                needs_lower = 1;
                break;
            }
        }
        if (needs_lower) {
            PyObject *low = PyObject_CallMethod(ext, "lower", NULL);
            Py_DECREF(ext);
            if (low == NULL) {
                Py_DECREF(k);
                goto fail;
            }
            ext = low;
        }
        int same = 0;
        if (key != Py_None) {
            same = PyUnicode_Compare(k, key) == 0;
            if (PyErr_Occurred()) {
                Py_DECREF(k);
                Py_DECREF(ext);
                goto fail;
            }
        }
        if (same) {
            int has = PyDict_Contains(sample, ext);
            if (has != 0) {
                Py_DECREF(k);
                Py_DECREF(ext);
                if (has < 0)
                    goto fail;
                stop = i;
                break;
            }
            int rc = PyDict_SetItem(sample, ext, data);
            Py_DECREF(k);
            Py_DECREF(ext);
            if (rc < 0)
                goto fail;
        } else {
            if (sample != Py_None && PyList_Append(out, sample) < 0) {
                Py_DECREF(k);
                Py_DECREF(ext);
                goto fail;
            }
            PyObject *d = PyDict_New();
            if (d == NULL || PyDict_SetItem(d, KEY_STR, k) < 0 ||
                PyDict_SetItem(d, URL_STR, url) < 0 || PyDict_SetItem(d, ext, data) < 0) {
                Py_XDECREF(d);
                Py_DECREF(k);
                Py_DECREF(ext);
                goto fail;
            }
            Py_DECREF(ext);
            Py_DECREF(sample);
            sample = d;
            Py_DECREF(key);
            key = k;
        }
    }
    return Py_BuildValue("(NNNn)", out, sample, key, stop);
fail:
    Py_DECREF(out);
    Py_DECREF(sample);
    Py_DECREF(key);
    return NULL;
}

/* ustar_parts(parts, members, start, mtime, mode) -> (nbytes, stop)
 * Appends header, data and padding of members[start:] to the list parts, as
 * tario.TarMemberWriter.add_all does for plain members. Stops (stop = index) at a member the
 * Python path must write (name not ASCII, longer than 100 bytes or holding a NUL, size >= 8**11,
 * data not bytes); stop = -1 when all were written. An mtime or mode that does not fit its
 * header field stops at the first member, so the Python path raises (never a truncated field). */
static PyObject *ZERO_PAD;

static PyObject *
ustar_parts(PyObject *self, PyObject *args)
{
    PyObject *parts, *members;
    Py_ssize_t start;
    long long mtime, mode;
    if (!PyArg_ParseTuple(args, "O!OnLL", &PyList_Type, &parts, &members, &start, &mtime, &mode))
        return NULL;
    PyObject *seq = PySequence_Fast(members, "members must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    long long total = 0;
    Py_ssize_t stop = -1;
    if (mtime < 0 || mtime >= (1LL << 33) || mode < 0 || mode >= (1LL << 21)) {
        Py_DECREF(seq);
        return Py_BuildValue("(Ln)", 0LL, start < count ? start : (Py_ssize_t)-1);
    }
    char head[BLOCK];
    memset(head, 0, BLOCK);
    snprintf(head + 100, 8, "%07llo", mode);
    memcpy(head + 108, "0000000", 8);
    memcpy(head + 116, "0000000", 8);
    snprintf(head + 136, 12, "%011llo", mtime);
    head[156] = '0';
    memcpy(head + 257, "ustar", 6);
    memcpy(head + 263, "00", 2);
    memcpy(head + 329, "0000000", 8);
    memcpy(head + 337, "0000000", 8);
    for (Py_ssize_t i = start; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2) {
            stop = i;
            break;
        }
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        PyObject *data = PyTuple_GET_ITEM(m, 1);
        if (!PyUnicode_Check(name) || !PyUnicode_IS_ASCII(name) ||
            PyUnicode_GET_LENGTH(name) > 100 || !PyBytes_CheckExact(data) ||
            memchr(PyUnicode_DATA(name), 0, PyUnicode_GET_LENGTH(name)) != NULL) {
            stop = i;
            break;
        }
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        if ((long long)size >= (1LL << 33)) {
            stop = i;
            break;
        }
        char h[BLOCK];
        memcpy(h, head, BLOCK);
        Py_ssize_t nlen = PyUnicode_GET_LENGTH(name);
        memcpy(h, PyUnicode_DATA(name), nlen);
        snprintf(h + 124, 12, "%011llo", (long long)size);
        memset(h + 148, ' ', 8);
        unsigned long sum = 0;
        for (int j = 0; j < BLOCK; j++)
            sum += (unsigned char)h[j];
        snprintf(h + 148, 7, "%06lo", sum);
        h[154] = 0;
        h[155] = ' ';
        PyObject *hdr = PyBytes_FromStringAndSize(h, BLOCK);
        if (hdr == NULL)
            goto fail;
        int rc = PyList_Append(parts, hdr);
        Py_DECREF(hdr);
        if (rc < 0 || PyList_Append(parts, data) < 0)
            goto fail;
        Py_ssize_t pad = (BLOCK - size % BLOCK) % BLOCK;
        if (pad) {
            PyObject *p = PyBytes_FromStringAndSize(PyBytes_AS_STRING(ZERO_PAD), pad);
            if (p == NULL)
                goto fail;
            rc = PyList_Append(parts, p);
            Py_DECREF(p);
            if (rc < 0)
                goto fail;
        }
        total += BLOCK + size + pad;
    }
    Py_DECREF(seq);
    return Py_BuildValue("(Ln)", total, stop);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"scan_members", scan_members, METH_VARARGS,
     "scan_members(buf, pos, base, end) -> (members, pos): plain members wholly in buf[:end]."},
    {"ustar_parts", ustar_parts, METH_VARARGS,
     "ustar_parts(parts, members, start, mtime, mode) -> (nbytes, stop)."},
    {"group_members", group_members, METH_VARARGS,
     "group_members(batch, start, url, last_dot, sample, key) -> (samples, sample, key, stop)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speedups",
                                    "C accelerator for tarshards' reader hot loops.", -1,
                                    methods};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    KEY_STR = PyUnicode_InternFromString("__key__");
    URL_STR = PyUnicode_InternFromString("__url__");
    ZERO_PAD = PyBytes_FromStringAndSize(NULL, BLOCK);
    if (ZERO_PAD != NULL)
        memset(PyBytes_AS_STRING(ZERO_PAD), 0, BLOCK);
    if (KEY_STR == NULL || URL_STR == NULL || ZERO_PAD == NULL)
        return NULL;
    return PyModule_Create(&module);
}
