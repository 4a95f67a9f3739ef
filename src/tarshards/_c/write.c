/* The writer's per-sample paths: a sample's members (sample_members), their size in the tar
 * stream (members_size), their tar bytes (ustar_parts, tar_sample). */
#include "speedups.h"

/* ustar_parts(parts, members, start, mtime, mode) -> (nbytes, stop)
 * Appends header, data and padding of members[start:] to the list parts, as
 * tario.TarMemberWriter.add_all does for plain members. Stops (stop = index) at a member the
 * Python path must write (name not ASCII, longer than 100 bytes or holding a NUL, size >= 8**11,
 * data not bytes); stop = -1 when all were written. An mtime or mode that does not fit its
 * header field stops at the first member, so the Python path raises (never a truncated field). */

PyObject *
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
    tar_template(head, mode, mtime);
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
        tar_header(h, head, (const char *)PyUnicode_DATA(name),
                   (size_t)PyUnicode_GET_LENGTH(name), size);
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


/* sample_members(sample, encoder, encode_value) -> list or None: writer.sample_members' list of
 * (KEY.EXT, bytes) members, sorted by extension, in one call, for the samples it takes: a dict
 * whose __key__ is a non-empty str with a base name that neither holds a dot nor starts with "__",
 * whose fields are str extensions (fields starting with "__" and None values left out), none
 * empty or holding '/'. Values: bytes as they are; str as UTF-8 (not for a .gz extension, whose
 * text the encoder compresses); with encoder, anything else through encode_value(value, ext),
 * called once, what it returns taken as it is (its errors raised); without, a bytearray or
 * memoryview copied into bytes. None where the
 * Python function decides (and raises): anything else, or no member at all. */
static int
gz_extension(PyObject *ext)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(ext);
    if (n < 2)
        return 0;
    Py_UCS4 a = PyUnicode_READ_CHAR(ext, n - 2), b = PyUnicode_READ_CHAR(ext, n - 1);
    if ((a != 'g' && a != 'G') || (b != 'z' && b != 'Z'))
        return 0;
    return n == 2 || PyUnicode_READ_CHAR(ext, n - 3) == '.';
}

PyObject *
sample_members_c(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sample_members(sample, encoder, encode_value)");
        return NULL;
    }
    PyObject *sample = args[0], *encode = args[2];
    int encoder = PyObject_IsTrue(args[1]);
    if (encoder < 0)
        return NULL;
    if (!PyDict_CheckExact(sample))
        Py_RETURN_NONE;
    PyObject *key = PyDict_GetItemString(sample, "__key__"); /* borrowed */
    if (key == NULL || !PyUnicode_CheckExact(key) || PyUnicode_GET_LENGTH(key) == 0)
        Py_RETURN_NONE;
    Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
    int ok = key_base_ok(key, klen);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_NONE;
    PyObject *exts = PyDict_Keys(sample);
    if (exts == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(exts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(exts, i))) {
            Py_DECREF(exts);
            Py_RETURN_NONE;
        }
    if (PyList_Sort(exts) < 0) {
        Py_DECREF(exts);
        return NULL;
    }
    /* "KEY.", made now: key is borrowed from the sample, which an encoder may change */
    PyObject *prefix = NULL, *dot_s = PyUnicode_FromOrdinal('.');
    if (dot_s != NULL) {
        prefix = PyUnicode_Concat(key, dot_s);
        Py_DECREF(dot_s);
    }
    PyObject *out = prefix == NULL ? NULL : PyList_New(0);
    if (out == NULL) {
        Py_XDECREF(prefix);
        Py_DECREF(exts);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ext = PyList_GET_ITEM(exts, i);
        Py_ssize_t elen = PyUnicode_GET_LENGTH(ext);
        if (elen >= 2 && PyUnicode_READ_CHAR(ext, 0) == '_' && PyUnicode_READ_CHAR(ext, 1) == '_')
            continue;
        PyObject *value = PyDict_GetItemWithError(sample, ext); /* borrowed */
        if (value == NULL) {
            if (PyErr_Occurred())
                goto error;
            goto python; /* changed behind our back */
        }
        if (value == Py_None)
            continue;
        if (elen == 0 || PyUnicode_FindChar(ext, '/', 0, elen, 1) != -1)
            goto python;
        PyObject *data;
        if (PyBytes_CheckExact(value)) {
            Py_INCREF(value);
            data = value;
        }
        else if (PyUnicode_CheckExact(value) && !(encoder && gz_extension(ext))) {
            data = PyUnicode_AsUTF8String(value);
            if (data == NULL) { /* lone surrogates: the Python function raises */
                PyErr_Clear();
                goto python;
            }
        }
        else if (encoder) {
            Py_INCREF(value); /* held through the call (the encoder may change the sample) */
            PyObject *argv[2] = {value, ext};
            data = PyObject_Vectorcall(encode, argv, 2, NULL); /* taken as it is, as there */
            Py_DECREF(value);
            if (data == NULL)
                goto error;
        }
        else if (PyByteArray_CheckExact(value) || PyMemoryView_Check(value)) {
            data = PyBytes_FromObject(value);
            if (data == NULL)
                goto error;
        }
        else
            goto python;
        PyObject *name = PyUnicode_Concat(prefix, ext);
        if (name == NULL) {
            Py_DECREF(data);
            goto error;
        }
        PyObject *member = PyTuple_New(2);
        if (member == NULL) {
            Py_DECREF(name);
            Py_DECREF(data);
            goto error;
        }
        PyTuple_SET_ITEM(member, 0, name);
        PyTuple_SET_ITEM(member, 1, data);
        int rc = PyList_Append(out, member);
        Py_DECREF(member);
        if (rc < 0)
            goto error;
    }
    if (PyList_GET_SIZE(out) == 0)
        goto python;
    Py_DECREF(prefix);
    Py_DECREF(exts);
    return out;
error:
    Py_XDECREF(prefix);
    Py_DECREF(exts);
    Py_DECREF(out);
    return NULL;
python:
    Py_XDECREF(prefix);
    Py_DECREF(exts);
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* members_size(members, header_size) -> int: the bytes a write of (name, data) members takes in
 * the tar stream (headers, data, padding to 512), as ShardWriter needs it before the write to
 * decide on a new shard: 512 for a member whose name and size fit a ustar header as they are,
 * header_size(name, size) (a pax header, the Python rule) for any other; data anything with a
 * length. */
PyObject *
members_size(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "members_size(members, header_size)");
        return NULL;
    }
    /* a tuple of its own: the callbacks (header_size, a value's __len__) cannot change it */
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL)
        return NULL;
    long long total = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(m, 0))) {
            PyErr_SetString(PyExc_TypeError, "members are (name: str, data) pairs");
            goto error;
        }
        PyObject *name = PyTuple_GET_ITEM(m, 0), *data = PyTuple_GET_ITEM(m, 1);
        Py_ssize_t size = PyBytes_CheckExact(data) ? PyBytes_GET_SIZE(data) : PyObject_Size(data);
        if (size < 0)
            goto error;
        long long hsize = member_header_size(name, size, args[1]);
        if (hsize < 0)
            goto error;
        total += hsize + (long long)size + ((-(long long)size) & (BLOCK - 1));
    }
    Py_DECREF(seq);
    return PyLong_FromLongLong(total);
error:
    Py_DECREF(seq);
    return NULL;
}

/* tar_sample(members, mtime, mode, max_size[, recorder, key]) -> bytes or None
 * One write of (name, bytes) members as its tar bytes, built in one buffer: each member's ustar
 * header (as ustar_parts makes it), data and padding, back to back (one allocation and one copy
 * of the data, no header or padding objects, no join). With a Recorder, the write is recorded
 * there too (Recorder.record). None, having written and recorded nothing, where the sample needs
 * more than this: a member that is not a plain ustar member (a pax header, not bytes), more than
 * max_size bytes in all, mtime or mode out of range, or a write the recorder does not take. */
PyObject *
tar_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "tar_sample(members, mtime, mode, max_size[, recorder, key])");
        return NULL;
    }
    PyObject *recorder = NULL, *key = NULL;
    long long mtime = PyLong_AsLongLong(args[1]), mode = PyLong_AsLongLong(args[2]);
    Py_ssize_t max_size = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (nargs == 6) {
        if (!PyObject_TypeCheck(args[4], &RecorderType)) {
            PyErr_SetString(PyExc_TypeError, "tar_sample: recorder must be a Recorder");
            return NULL;
        }
        recorder = args[4];
        key = args[5];
        if (key == Py_None) /* a write without a key: the general path records it */
            Py_RETURN_NONE;
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "tar_sample: the key must be a str");
            return NULL;
        }
    }
    if (mtime < 0 || mtime >= (1LL << 33) || mode < 0 || mode >= (1LL << 21))
        Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(args[0], "members must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2)
            goto none;
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        PyObject *data = PyTuple_GET_ITEM(m, 1);
        if (!PyUnicode_Check(name) || !PyUnicode_IS_ASCII(name) ||
            PyUnicode_GET_LENGTH(name) > 100 || !PyBytes_CheckExact(data) ||
            memchr(PyUnicode_DATA(name), 0, PyUnicode_GET_LENGTH(name)) != NULL)
            goto none;
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        total += BLOCK + size + (BLOCK - size % BLOCK) % BLOCK;
        if (total > max_size)
            goto none;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        goto error;
    if (recorder != NULL) {
        int rc = PyUnicode_IS_ASCII(key)
                     ? recorder_record_plain((RecorderObject *)recorder, seq, key)
                     : recorder_record_seq((RecorderObject *)recorder, seq, key);
        if (rc <= 0) {
            Py_DECREF(out);
            if (rc < 0)
                goto error;
            goto none;
        }
    }
    char head[BLOCK];
    tar_template(head, mode, mtime);
    char *o = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        PyObject *data = PyTuple_GET_ITEM(m, 1);
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        tar_header(o, head, (const char *)PyUnicode_DATA(name),
                   (size_t)PyUnicode_GET_LENGTH(name), size);
        o += BLOCK;
        memcpy(o, PyBytes_AS_STRING(data), (size_t)size);
        o += size;
        Py_ssize_t pad = (BLOCK - size % BLOCK) % BLOCK;
        memset(o, 0, (size_t)pad);
        o += pad;
    }
    Py_DECREF(seq);
    return out;
none:
    Py_DECREF(seq);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    return NULL;
}
