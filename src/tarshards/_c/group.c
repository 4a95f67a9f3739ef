/* Grouping members into samples (group_members): the loop of format.group_samples. */
#include "speedups.h"

/* group_members(batch, start, url, last_dot, sample, key) -> (samples, sample, key, stop)
 * Groups batch[start:] like format.group_samples. stop is the index of a member that repeats an
 * extension of the current sample (not consumed), or -1. */
/* the extensions group_members saw last (ASCII, lower-case: as a sample's key uses them), so
 * that a member whose extension is one of them takes that str (its hash known) instead of a
 * new one (a substring, a case check and a hash per member); the GIL guards them */
#define EXT_CACHE 8
static PyObject *ext_cache[EXT_CACHE];
static int ext_cache_next;

static PyObject *
cached_ext(const char *p, Py_ssize_t n)
{
    for (int i = 0; i < EXT_CACHE; i++) {
        PyObject *e = ext_cache[i];
        if (e != NULL && PyUnicode_GET_LENGTH(e) == n &&
            memcmp(PyUnicode_DATA(e), p, (size_t)n) == 0) {
            Py_INCREF(e);
            return e;
        }
    }
    return NULL;
}

static void
remember_ext(PyObject *e)
{
    if (!PyUnicode_IS_ASCII(e) || PyUnicode_GET_LENGTH(e) > 32)
        return;
    Py_INCREF(e);
    Py_XSETREF(ext_cache[ext_cache_next], e);
    ext_cache_next = (ext_cache_next + 1) % EXT_CACHE;
}

PyObject *
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
        PyObject *offset = PyTuple_GET_ITEM(member, 2);
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
        /* the key: compared with the sample's in place where both are ASCII (the usual
         * case: no substring for the members after a sample's first) */
        int ascii = PyUnicode_IS_ASCII(nameobj);
        const char *nd = ascii ? (const char *)PyUnicode_DATA(nameobj) : NULL;
        int same = 0;
        PyObject *k = NULL;
        if (ascii && key != Py_None && PyUnicode_IS_ASCII(key))
            same = PyUnicode_GET_LENGTH(key) == dot - s0 &&
                   memcmp(PyUnicode_DATA(key), nd + s0, (size_t)(dot - s0)) == 0;
        else if (key != Py_None) {
            k = PyUnicode_Substring(nameobj, s0, dot);
            if (k == NULL)
                goto fail;
            same = PyUnicode_Compare(k, key) == 0;
            if (PyErr_Occurred()) {
                Py_DECREF(k);
                goto fail;
            }
        }
        if (!same && k == NULL) {
            k = PyUnicode_Substring(nameobj, s0, dot);
            if (k == NULL)
                goto fail;
        }
        PyObject *ext = ascii ? cached_ext(nd + dot + 1, len - dot - 1) : NULL;
        if (ext == NULL) {
            ext = PyUnicode_Substring(nameobj, dot + 1, len);
            if (ext == NULL) {
                Py_XDECREF(k);
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
                    Py_XDECREF(k);
                    goto fail;
                }
                ext = low;
            }
            /* one str a process per extension (as samples.c's): equal samples pickle alike
             * whichever loop read them */
            PyUnicode_InternInPlace(&ext);
            if (!needs_lower)
                remember_ext(ext);
        }
        if (same) {
            int has = PyDict_Contains(sample, ext);
            if (has != 0) {
                Py_XDECREF(k);
                Py_DECREF(ext);
                if (has < 0)
                    goto fail;
                stop = i;
                break;
            }
            int rc = PyDict_SetItem(sample, ext, data);
            Py_XDECREF(k);
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
                PyDict_SetItem(d, URL_STR, url) < 0 || PyDict_SetItem(d, OFFSET_STR, offset) < 0 ||
                PyDict_SetItem(d, ext, data) < 0) {
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
