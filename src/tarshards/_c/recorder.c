/* Index recording while writing (Recorder), the member checksums it and the indexer call, and
 * the index's columns out of its packed rows (index_columns). */
#include "speedups.h"

/* ---- the index: member checksums, recording while writing, indexing while reading ----------
 *
 * The member checksum is a Python callable handed in by the caller (hashing.member_checksum_fn:
 * xxhash's xxh3_64_intdigest, or zlib.crc32 without xxhash), called once per member from the
 * loops below with PyObject_Vectorcall: on the user's bytes object (writer) or on a read-only
 * memoryview over the read buffer (indexer; no copy). */

/* checksum(data) as an unsigned 64-bit value into *out; -1 with an exception set on error */
/* A member checksum given as a C function (a capsule named "tarshards.checksum64" holding a
 * uint64_t (*)(const void *, size_t), as tarshards._xxh3.checksum64): called directly, without
 * the GIL for large members (the buffer stays alive: the caller holds it). */
#define CHECKSUM_GIL_FREE_MIN (64 * 1024)

static int
direct_checksum_fn(checksum64_fn fn, const void *p, Py_ssize_t n, uint64_t *out)
{
    if (n >= CHECKSUM_GIL_FREE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        *out = fn(p, (size_t)n);
        Py_END_ALLOW_THREADS
    }
    else {
        *out = fn(p, (size_t)n);
    }
    return 0;
}

static int
direct_checksum(PyObject *capsule, const void *p, Py_ssize_t n, uint64_t *out)
{
    checksum64_fn fn = (checksum64_fn)PyCapsule_GetPointer(capsule, "tarshards.checksum64");
    if (fn == NULL)
        return -1;
    return direct_checksum_fn(fn, p, n, out);
}

static int
call_checksum(PyObject *fn, PyObject *data, uint64_t *out)
{
    if (PyCapsule_CheckExact(fn)) {
        if (PyBytes_CheckExact(data))
            return direct_checksum(fn, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), out);
        Py_buffer view;
        if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
            return -1;
        int rc = direct_checksum(fn, view.buf, view.len, out);
        PyBuffer_Release(&view);
        return rc;
    }
    PyObject *r = PyObject_Vectorcall(fn, &data, 1, NULL);
    if (r == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

/* checksum(memoryview of p[:n]) without copying p; the view is released after the call, so a
 * callable that kept it holds a released view, never one over memory that may go away */
int
call_checksum_mem(PyObject *fn, const unsigned char *p, Py_ssize_t n, uint64_t *out)
{
    if (PyCapsule_CheckExact(fn))
        return direct_checksum(fn, p, n, out);
    PyObject *mv = PyMemoryView_FromMemory((char *)p, n, PyBUF_READ);
    if (mv == NULL)
        return -1;
    int rc = call_checksum(fn, mv, out);
    if (Py_REFCNT(mv) > 1) { /* kept (by the callable, or by a traceback's frame) */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb); /* the call's own error, if any, comes first */
        PyObject *gone = PyObject_CallMethod(mv, "release", NULL);
        if (gone == NULL) {
            rc = -1;
            if (type != NULL)
                PyErr_Clear();
        }
        Py_XDECREF(gone);
        if (type != NULL)
            PyErr_Restore(type, value, tb);
    }
    Py_DECREF(mv);
    return rc;
}


/* the code of extension ext in the dict codes (a new one numbered len(codes)); -1 on error */
long long
ext_code(PyObject *codes, PyObject *ext)
{
    PyObject *code = PyDict_GetItemWithError(codes, ext);
    if (code != NULL)
        return PyLong_AsLongLong(code);
    if (PyErr_Occurred())
        return -1;
    Py_ssize_t n = PyDict_GET_SIZE(codes);
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL)
        return -1;
    int rc = PyDict_SetItem(codes, ext, v);
    Py_DECREF(v);
    return rc < 0 ? -1 : (long long)n;
}

/* the bytes of the header blocks of a member named name (a str) of size bytes: 512 where the
 * name and size fit a ustar header as they are, else header_size(name, size) (the Python rule:
 * a pax header); -1 with an exception set on error */
long long
member_header_size(PyObject *name, Py_ssize_t size, PyObject *header_size)
{
    Py_ssize_t len = PyUnicode_GET_LENGTH(name);
    if (PyUnicode_IS_ASCII(name) && len <= 100 && (long long)size < (1LL << 33) &&
        memchr(PyUnicode_DATA(name), 0, (size_t)len) == NULL)
        return BLOCK;
    PyObject *n = PyLong_FromSsize_t(size);
    if (n == NULL)
        return -1;
    PyObject *argv[2] = {name, n};
    PyObject *h = PyObject_Vectorcall(header_size, argv, 2, NULL);
    Py_DECREF(n);
    if (h == NULL)
        return -1;
    long long hsize = PyLong_AsLongLong(h);
    Py_DECREF(h);
    if (hsize < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "header_size returned a negative size");
    return hsize < 0 ? -1 : hsize;
}

/* Recorder(keys, codes, checksum, header_size): what writer._Recorder keeps of the writes whose
 * member names are KEY.EXT, laid out as the index stores it, in bytearrays that the index builder
 * takes as they are (closing a shard copies nothing and computes nothing per member):
 *   members      per member six little-endian 64-bit fields (index._MEMBER_DTYPE): its sample's
 *                number in keys, its extension's code in the dict codes, its header's offset in
 *                the tar stream, its data's offset, its size, checksum(data);
 *   samples      per sample three (the C scanner's layout): the first header's offset, the end
 *                of its last member (padding included), flags (0);
 *   key_blob     the samples' keys in UTF-8, back to back; key_offsets: little-endian i8, one
 *                more than there are samples (key i is key_blob[key_offsets[i]:key_offsets[i+1]])
 *   keys         the samples' keys (a write whose key is keys[-1] adds to that sample, as the
 *                reader groups consecutive members of one key).
 * Offsets count from 0, each member taking its header (512 bytes, or header_size(name, size)
 * where the name needs a pax header), its data and the padding to 512, back to back, as
 * TarMemberWriter writes them. checksum: a callable, or a capsule "tarshards.checksum64" (called
 * directly). (A plain shard written to a file gets its rows from the thread that reads it back,
 * _xxh3.Background: this recorder serves compressed, aligned and streamed shards.)
 * record(members, key) -> bool: False, recording nothing, when a name or the key does not follow
 * the rules the reader groups by, or the key is not valid UTF-8 (the writer's general path takes
 * those). */
static PyObject *
recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"keys", "codes", "checksum", "header_size", NULL};
    PyObject *keys, *codes, *checksum, *header_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO", kwlist, &PyList_Type, &keys,
                                     &PyDict_Type, &codes, &checksum, &header_size))
        return NULL;
    int kind = 0;
    checksum64_fn fn = NULL;
    if (PyCapsule_IsValid(checksum, "tarshards.checksum64")) {
        kind = 1;
        fn = (checksum64_fn)PyCapsule_GetPointer(checksum, "tarshards.checksum64");
    }
    else if (!PyCallable_Check(checksum)) {
        PyErr_SetString(PyExc_TypeError,
                        "Recorder: checksum must be a callable, a capsule or None");
        return NULL;
    }
    if (!PyCallable_Check(header_size)) {
        PyErr_SetString(PyExc_TypeError, "Recorder: header_size must be callable");
        return NULL;
    }
    if (PyList_GET_SIZE(keys)) {
        PyErr_SetString(PyExc_ValueError, "Recorder: keys must start empty");
        return NULL;
    }
    RecorderObject *r = (RecorderObject *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    Py_INCREF(keys);
    r->keys = keys;
    Py_INCREF(codes);
    r->codes = codes;
    Py_INCREF(checksum);
    r->checksum = checksum;
    Py_INCREF(header_size);
    r->header_size = header_size;
    r->kind = kind;
    r->fn = fn;
    r->members = PyByteArray_FromStringAndSize(NULL, 0);
    r->samples = PyByteArray_FromStringAndSize(NULL, 0);
    r->key_blob = PyByteArray_FromStringAndSize(NULL, 0);
    r->key_offsets = PyByteArray_FromStringAndSize(NULL, 8);
    if (r->members == NULL || r->samples == NULL || r->key_blob == NULL ||
        r->key_offsets == NULL) {
        Py_DECREF(r);
        return NULL;
    }
    memset(PyByteArray_AS_STRING(r->key_offsets), 0, 8);
    r->ko_used = 8;
    return (PyObject *)r;
}

/* room for `more` bytes after the `used` ones of the bytearray ba (its size doubled as needed) */
static int
reserve(PyObject *ba, Py_ssize_t used, Py_ssize_t more)
{
    Py_ssize_t size = PyByteArray_GET_SIZE(ba), need = used + more;
    if (need <= size)
        return 0;
    Py_ssize_t cap = size < 4096 ? 4096 : 2 * size;
    while (cap < need)
        cap *= 2;
    return PyByteArray_Resize(ba, cap);
}

static void
recorder_dealloc(RecorderObject *r)
{
    Py_XDECREF(r->keys);
    Py_XDECREF(r->codes);
    Py_XDECREF(r->checksum);
    Py_XDECREF(r->header_size);
    Py_XDECREF(r->members);
    Py_XDECREF(r->samples);
    Py_XDECREF(r->key_blob);
    Py_XDECREF(r->key_offsets);
    for (int i = 0; i < HINTS; i++)
        Py_XDECREF(r->hint[i]);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* whether n bytes at a and b are equal: memcmp for the short strings of keys and extensions,
 * inline (libc's memcmp is a call per key and per member; eight bytes at a time here) */
static inline int
same_bytes(const char *a, const char *b, Py_ssize_t n)
{
    while (n >= 8) {
        uint64_t x, y;
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        if (x != y)
            return 0;
        a += 8;
        b += 8;
        n -= 8;
    }
    while (n > 0) {
        if (*a++ != *b++)
            return 0;
        n--;
    }
    return 1;
}

/* the extension name[start:]'s code: the hint for this position first, then the dict */
static long long
recorder_ext(RecorderObject *r, Py_ssize_t i, PyObject *name, Py_ssize_t start)
{
    Py_ssize_t len = PyUnicode_GET_LENGTH(name) - start;
    PyObject *h = i < HINTS ? r->hint[i] : NULL;
    if (h != NULL && PyUnicode_IS_ASCII(name) && PyUnicode_GET_LENGTH(h) == len &&
        same_bytes((const char *)PyUnicode_DATA(h), (const char *)PyUnicode_DATA(name) + start,
                   len))
        return r->hint_code[i];
    PyObject *ext = PyUnicode_Substring(name, start, start + len);
    if (ext == NULL)
        return -1;
    long long code = ext_code(r->codes, ext);
    if (code >= 0 && i < HINTS && PyUnicode_IS_ASCII(ext)) {
        Py_XSETREF(r->hint[i], ext);
        r->hint_code[i] = code;
    }
    else
        Py_DECREF(ext);
    return code;
}

/* a sample key's base name (after its last '/') as the reader keeps it: not empty, not starting
 * with "__", without a dot: 1, else 0; -1 with an exception set */
int
key_base_ok(PyObject *key, Py_ssize_t klen)
{
    if (PyUnicode_IS_ASCII(key)) { /* one backward pass over the bytes (the writer's keys) */
        const char *kd = (const char *)PyUnicode_DATA(key);
        Py_ssize_t b = klen;
        int dot = 0;
        while (b > 0 && kd[b - 1] != '/') {
            dot |= kd[b - 1] == '.';
            b--;
        }
        return !dot && b < klen && !(klen - b >= 2 && kd[b] == '_' && kd[b + 1] == '_');
    }
    Py_ssize_t slash = PyUnicode_FindChar(key, '/', 0, klen, -1);
    if (slash == -2)
        return -1;
    Py_ssize_t b = slash + 1;
    if (b >= klen || (klen - b >= 2 && PyUnicode_READ_CHAR(key, b) == '_' &&
                      PyUnicode_READ_CHAR(key, b + 1) == '_'))
        return 0;
    Py_ssize_t dot = PyUnicode_FindChar(key, '.', b, klen, 1);
    if (dot == -2)
        return -1;
    return dot < 0;
}

static int recorder_append(RecorderObject *r, PyObject *seq, PyObject *key, int plain);

/* record the write seq (a sequence from PySequence_Fast) of key: 1 recorded, 0 not (nothing
 * recorded: the general path's), -1 an error */
int
recorder_record_seq(RecorderObject *r, PyObject *seq, PyObject *key)
{
    Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
    if (klen == 0)
        return 0;
    /* the key: not "./...", its base name neither empty, nor "__...", nor holding a dot */
    int ok = key_base_ok(key, klen);
    if (ok <= 0)
        return ok;
    if (klen >= 2 && PyUnicode_READ_CHAR(key, 0) == '.' && PyUnicode_READ_CHAR(key, 1) == '/')
        return 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    int key_ascii = PyUnicode_IS_ASCII(key);
    for (Py_ssize_t i = 0; i < count; i++) { /* check them all before recording any */
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2)
            goto python;
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        if (!PyUnicode_Check(name) || !PyBytes_CheckExact(PyTuple_GET_ITEM(m, 1)))
            goto python;
        Py_ssize_t len = PyUnicode_GET_LENGTH(name);
        if (len < klen + 2 || PyUnicode_READ_CHAR(name, klen) != '.')
            goto python;
        if (key_ascii && PyUnicode_IS_ASCII(name)) { /* the usual case */
            const char *nd = (const char *)PyUnicode_DATA(name);
            if (memcmp(nd, PyUnicode_DATA(key), (size_t)klen) != 0 ||
                memchr(nd + klen + 1, '/', (size_t)(len - klen - 1)) != NULL)
                goto python;
            continue;
        }
        Py_ssize_t t = PyUnicode_Tailmatch(name, key, 0, klen, -1);
        if (t < 0)
            goto error;
        if (t == 0)
            goto python;
        Py_ssize_t sl = PyUnicode_FindChar(name, '/', klen + 1, len, 1);
        if (sl == -2)
            goto error;
        if (sl >= 0)
            goto python;
    }
    return recorder_append(r, seq, key, 0);
error:
    return -1;
python:
    return 0;
}

/* recorder_record_seq for tar_sample's writes of an ASCII key, whose members tar_sample has
 * checked (each a 2-tuple of an ASCII str of at most 100 characters without NUL and a bytes: a
 * plain ustar member, one 512-byte header): the same rules on the key and the names, and the
 * same rows, in fewer steps (measured: about half recorder_record_seq's time a sample) */
int
recorder_record_plain(RecorderObject *r, PyObject *seq, PyObject *key)
{
    Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
    const char *kd = (const char *)PyUnicode_DATA(key);
    if (klen == 0 || (klen >= 2 && kd[0] == '.' && kd[1] == '/') || !key_base_ok(key, klen))
        return 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) { /* each name KEY.EXT, EXT without a '/' */
        PyObject *name = PyTuple_GET_ITEM(items[i], 0);
        Py_ssize_t len = PyUnicode_GET_LENGTH(name);
        const char *nd = (const char *)PyUnicode_DATA(name);
        if (len < klen + 2 || nd[klen] != '.' || !same_bytes(nd, kd, klen))
            return 0;
        for (Py_ssize_t j = klen + 1; j < len; j++)
            if (nd[j] == '/')
                return 0;
    }
    return recorder_append(r, seq, key, 1);
}

/* the rows of a write whose key and names passed the rules (plain: each member takes one
 * 512-byte header, an ASCII name): 1, or -1 on an error */
static int
recorder_append(RecorderObject *r, PyObject *seq, PyObject *key, int plain)
{
    PyObject *keys = r->keys;
    Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    int key_ascii = PyUnicode_IS_ASCII(key);
    if (count == 0) /* nothing written, nothing recorded */
        return 1;
    Py_ssize_t nkeys = PyList_GET_SIZE(keys);
    int new_sample = 1;
    if (nkeys > 0 && key_ascii && r->ko_used == 8 * (nkeys + 1)) {
        /* the last key's UTF-8 bytes, at the end of key_blob: equal bytes, equal keys */
        const int64_t *ko = (const int64_t *)PyByteArray_AS_STRING(r->key_offsets);
        int64_t from = ko[nkeys - 1], to = ko[nkeys];
        new_sample = to - from != (int64_t)klen ||
                     !same_bytes(PyByteArray_AS_STRING(r->key_blob) + from,
                                 (const char *)PyUnicode_DATA(key), klen);
    }
    else if (nkeys > 0) {
        PyObject *last = PyList_GET_ITEM(keys, nkeys - 1);
        if (last == key)
            new_sample = 0;
        else if (PyUnicode_Check(last)) {
            int ne = PyUnicode_Compare(last, key);
            if (ne == -1 && PyErr_Occurred())
                goto error;
            new_sample = ne != 0;
        }
    }
    Py_ssize_t nsamples = r->s_used / (Py_ssize_t)sizeof(SampleRow);
    if (nkeys != nsamples) {
        PyErr_SetString(PyExc_RuntimeError, "Recorder: its keys changed behind its back");
        goto error;
    }
    const char *kdata = NULL;
    Py_ssize_t kbytes = 0;
    if (new_sample) {
        if (key_ascii) {
            kdata = (const char *)PyUnicode_DATA(key);
            kbytes = klen;
        }
        else {
            kdata = PyUnicode_AsUTF8AndSize(key, &kbytes);
            if (kdata == NULL) { /* lone surrogates: the general path encodes those */
                PyErr_Clear();
                goto python;
            }
        }
    }
    Py_ssize_t old = r->m_used;
    if (reserve(r->members, old, count * (Py_ssize_t)sizeof(MemberRow)) < 0 ||
        (new_sample && (reserve(r->samples, r->s_used, (Py_ssize_t)sizeof(SampleRow)) < 0 ||
                        reserve(r->key_blob, r->kb_used, kbytes) < 0 ||
                        reserve(r->key_offsets, r->ko_used, 8) < 0)))
        goto error;
    int64_t start = r->offset, offset = r->offset;
    int64_t sample = new_sample ? (int64_t)nkeys : (int64_t)nkeys - 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        PyObject *data = PyTuple_GET_ITEM(m, 1);
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        long long code = recorder_ext(r, i, name, klen + 1);
        if (code < 0)
            goto error;
        int64_t hsize = plain ? BLOCK : (int64_t)member_header_size(name, size, r->header_size);
        if (hsize < 0)
            goto error;
        uint64_t sum = 0;
        if (r->kind == 1) {
            if (direct_checksum_fn(r->fn, PyBytes_AS_STRING(data), size, &sum) < 0)
                goto error;
        }
        else if (r->kind == 0 && call_checksum(r->checksum, data, &sum) < 0)
            goto error;
        MemberRow *row = (MemberRow *)(PyByteArray_AS_STRING(r->members) + old) + i;
        row->sample = sample;
        row->ext = (int64_t)code;
        row->offset = offset;
        row->data = offset + hsize;
        row->size = (int64_t)size;
        row->checksum = sum;
        offset += hsize + (int64_t)size + ((-(int64_t)size) & (BLOCK - 1));
    }
    if (new_sample) {
        if (PyList_Append(keys, key) < 0)
            goto error;
        SampleRow *srow = (SampleRow *)(PyByteArray_AS_STRING(r->samples) + r->s_used);
        srow->offset = start;
        srow->flags = 0;
        r->s_used += (Py_ssize_t)sizeof(SampleRow);
        memcpy(PyByteArray_AS_STRING(r->key_blob) + r->kb_used, kdata, (size_t)kbytes);
        r->kb_used += kbytes;
        int64_t end = (int64_t)r->kb_used;
        memcpy(PyByteArray_AS_STRING(r->key_offsets) + r->ko_used, &end, 8);
        r->ko_used += 8;
    }
    ((SampleRow *)(PyByteArray_AS_STRING(r->samples) + r->s_used) - 1)->end = offset;
    r->offset = offset;
    r->m_used = old + count * (Py_ssize_t)sizeof(MemberRow);
    return 1;
error:
    return -1;
python:
    return 0;
}

static PyObject *
recorder_record(RecorderObject *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "record(members, key: str)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "members must be a sequence");
    if (seq == NULL)
        return NULL;
    int rc = recorder_record_seq(r, seq, args[1]);
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    return PyBool_FromLong(rc);
}

static PyObject *
recorder_get_count(RecorderObject *r, void *unused)
{
    return PyLong_FromSsize_t(r->m_used / (Py_ssize_t)sizeof(MemberRow));
}

/* a bytearray trimmed to the bytes in use (the next record grows it again) */
static PyObject *
trimmed(PyObject *ba, Py_ssize_t used)
{
    if (PyByteArray_GET_SIZE(ba) != used && PyByteArray_Resize(ba, used) < 0)
        return NULL;
    Py_INCREF(ba);
    return ba;
}

static PyObject *
recorder_get_members(RecorderObject *r, void *unused)
{
    return trimmed(r->members, r->m_used);
}

static PyObject *
recorder_get_samples(RecorderObject *r, void *unused)
{
    return trimmed(r->samples, r->s_used);
}

static PyObject *
recorder_get_key_blob(RecorderObject *r, void *unused)
{
    return trimmed(r->key_blob, r->kb_used);
}

static PyObject *
recorder_get_key_offsets(RecorderObject *r, void *unused)
{
    return trimmed(r->key_offsets, r->ko_used);
}

static PyMethodDef recorder_methods[] = {
    {"record", (PyCFunction)(void (*)(void))recorder_record, METH_FASTCALL,
     "record(members, key) -> bool: record one write (False: the general path's)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef recorder_getset[] = {
    {"count", (getter)recorder_get_count, NULL, "The members recorded.", NULL},
    {"members", (getter)recorder_get_members, NULL,
     "The member rows (index._MEMBER_DTYPE), a bytearray.", NULL},
    {"samples", (getter)recorder_get_samples, NULL,
     "The sample rows (offset, end, flags; little-endian i8), a bytearray.", NULL},
    {"key_blob", (getter)recorder_get_key_blob, NULL,
     "The keys in UTF-8, back to back, a bytearray.", NULL},
    {"key_offsets", (getter)recorder_get_key_offsets, NULL,
     "Where each key starts in key_blob, and the end (little-endian i8), a bytearray.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* index_columns(samples, members) -> 9 bytes: the index's columns cut out of the packed rows
 * (Recorder's and the C scanner's layout: per sample three int64, per member six), little-endian
 * as the index file stores them: the samples' tar offsets, ends (int64) and flags (uint8); the
 * members' sample numbers (uint32), extension codes (uint16), header offsets, data offsets,
 * sizes (int64) and checksums (uint64). Narrower fields keep their low bytes (numpy's astype). */
PyObject *
index_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "index_columns(samples, members)");
        return NULL;
    }
    Py_buffer sv, mv;
    if (PyObject_GetBuffer(args[0], &sv, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &mv, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *cols[9] = {NULL};
    PyObject *out = NULL;
    if (sv.len % (Py_ssize_t)sizeof(SampleRow) || mv.len % (Py_ssize_t)sizeof(MemberRow)) {
        PyErr_SetString(PyExc_ValueError, "index_columns: not whole rows");
        goto done;
    }
    Py_ssize_t ns = sv.len / (Py_ssize_t)sizeof(SampleRow);
    Py_ssize_t nm = mv.len / (Py_ssize_t)sizeof(MemberRow);
    static const int width[9] = {8, 8, 1, 4, 2, 8, 8, 8, 8};
    for (int c = 0; c < 9; c++) {
        cols[c] = PyBytes_FromStringAndSize(NULL, (c < 3 ? ns : nm) * width[c]);
        if (cols[c] == NULL)
            goto done;
    }
    int64_t *off = (int64_t *)PyBytes_AS_STRING(cols[0]), *end = (int64_t *)PyBytes_AS_STRING(cols[1]);
    uint8_t *flags = (uint8_t *)PyBytes_AS_STRING(cols[2]);
    SampleRow srow;
    for (Py_ssize_t i = 0; i < ns; i++) {
        memcpy(&srow, (const char *)sv.buf + i * (Py_ssize_t)sizeof(SampleRow), sizeof srow);
        off[i] = srow.offset;
        end[i] = srow.end;
        flags[i] = (uint8_t)srow.flags;
    }
    uint32_t *sample = (uint32_t *)PyBytes_AS_STRING(cols[3]);
    uint16_t *ext = (uint16_t *)PyBytes_AS_STRING(cols[4]);
    int64_t *hdr = (int64_t *)PyBytes_AS_STRING(cols[5]), *data = (int64_t *)PyBytes_AS_STRING(cols[6]);
    int64_t *size = (int64_t *)PyBytes_AS_STRING(cols[7]);
    uint64_t *sum = (uint64_t *)PyBytes_AS_STRING(cols[8]);
    MemberRow row;
    for (Py_ssize_t i = 0; i < nm; i++) {
        memcpy(&row, (const char *)mv.buf + i * (Py_ssize_t)sizeof(MemberRow), sizeof row);
        sample[i] = (uint32_t)row.sample;
        ext[i] = (uint16_t)row.ext;
        hdr[i] = row.offset;
        data[i] = row.data;
        size[i] = row.size;
        sum[i] = row.checksum;
    }
    out = PyTuple_New(9);
    if (out != NULL)
        for (int c = 0; c < 9; c++) {
            PyTuple_SET_ITEM(out, c, cols[c]);
            cols[c] = NULL;
        }
done:
    for (int c = 0; c < 9; c++)
        Py_XDECREF(cols[c]);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&mv);
    return out;
}

PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.Recorder",
    .tp_basicsize = sizeof(RecorderObject),
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Recorder(keys, codes, checksum, header_size): the writer's index rows.",
    .tp_methods = recorder_methods,
    .tp_getset = recorder_getset,
    .tp_new = recorder_new,
};

