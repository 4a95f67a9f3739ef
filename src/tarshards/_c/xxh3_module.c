/* The _xxh3 module: hashing (this file: the functions below, its method table and init) and, in
 * readback.c, the tar read-back thread (Background), which parses the stream with tar.h.
 *
 * Optional: xxh3_64 through the system's libxxhash (Debian: libxxhash-dev), whose
 * XXH3_*_dispatch entry points pick the widest vector unit at run time (AVX2 where the CPU has it:
 * about twice the speed of the SSE2 build inside the xxhash package), and release the GIL while
 * hashing large buffers, so that threads hash in parallel.
 *
 * The values are the xxh3_64 of the xxhash package (the algorithm does not depend on the vector
 * unit); tests/test_hashing.py checks that both agree. Where this module is missing (no
 * libxxhash headers at build time), tarshards.format.hashing uses the xxhash package.
 *
 * xxh3_64_intdigest(buffer) -> int          one-shot, as xxhash.xxh3_64_intdigest
 * checksum64                                a capsule "tarshards.checksum64": the same as a C
 *                                           function uint64_t (*)(const void *, size_t), which
 *                                           _speedups' loops call directly
 * hash_rows(blob, offsets) -> bytes         the xxh3_64 of each row blob[offsets[i]:offsets[i+1]]
 *                                           (offsets: native int64, n + 1 of them), n native
 *                                           uint64 values (the index's key blob and offsets:
 *                                           the key table hashes a shard's keys in one call)
 * Xxh3()                                    streaming: update(buffer),
 *                                           intdigest(), hexdigest(), digest(), copy()
 * Xxh3.tee(writelines)                      a callable f(parts): hashes each buffer of the list
 *                                           parts in order, then calls writelines(parts) (the
 *                                           writer's plain shards: hashed on their way out, one
 *                                           C call per sample, no joined copy)
 * Background(path, members=True, index=False) a thread that reads a shard back while it is
 *                                           written: its xxh3_64 and its members' (and its
 *                                           index rows; see the comment above BackgroundObject
 *                                           in readback.c)
 */
#include "xxh3.h"

/* below this many bytes the GIL is kept (releasing it costs more than hashing) */
#define GIL_FREE_MIN (64 * 1024)

/* After the vectorised hash, the upper halves of the vector registers are zeroed (vzeroupper).
 * The dispatched AVX2/AVX-512 code of the system's libxxhash returns with them dirty (Debian's
 * build holds two vzeroupper in all), and every legacy SSE instruction after it (the C loops of
 * _speedups, libc's, the interpreter's) then pays for merging them: on an AVX-512 host the
 * writer's header checksum loop ran 3x slower beside the hashing, and recording the index cost
 * 16-22 % of ShardWriter's rate instead of 9-12 %. */
#if defined(__x86_64__) && defined(__GNUC__)
int HAVE_AVX; /* set once, at import */
#endif

static PyObject *
xxh3_64_intdigest(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    XXH64_hash_t h;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len >= GIL_FREE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        h = XXH3_64bits_dispatch(view.buf, (size_t)view.len);
        clear_upper();
        Py_END_ALLOW_THREADS
    }
    else {
        h = XXH3_64bits_dispatch(view.buf, (size_t)view.len);
        clear_upper();
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

/* hash_rows(blob, offsets): see the header comment; without the GIL */
static PyObject *
hash_rows(PyObject *self, PyObject *args)
{
    Py_buffer blob, offs;
    if (!PyArg_ParseTuple(args, "y*y*", &blob, &offs))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = offs.len / (Py_ssize_t)sizeof(int64_t) - 1;
    if (offs.len % (Py_ssize_t)sizeof(int64_t) || n < 0) {
        PyErr_SetString(PyExc_ValueError, "hash_rows: offsets hold n + 1 int64 values");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL)
        goto done;
    const unsigned char *data = (const unsigned char *)blob.buf;
    uint64_t *hashes = (uint64_t *)PyBytes_AS_STRING(out);
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a, b;
        memcpy(&a, (const char *)offs.buf + i * 8, 8);
        memcpy(&b, (const char *)offs.buf + (i + 1) * 8, 8);
        if (a < 0 || b < a || b > (int64_t)blob.len) {
            bad = 1;
            break;
        }
        hashes[i] = (uint64_t)XXH3_64bits(data + a, (size_t)(b - a));
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        Py_CLEAR(out);
        PyErr_SetString(PyExc_ValueError, "hash_rows: offsets out of order or past the blob");
    }
done:
    PyBuffer_Release(&blob);
    PyBuffer_Release(&offs);
    return out;
}

/* the member checksum as a C function, for the C loops of _speedups (direct_checksum there) */
static uint64_t
xxh3_checksum64(const void *p, size_t n)
{
    uint64_t h = (uint64_t)XXH3_64bits_dispatch(p, n);
    clear_upper();
    return h;
}

typedef struct {
    PyObject_HEAD
    XXH3_state_t *state;
    /* made at the first update that hashes without the GIL, and taken by every use of the state
     * from then on (as hashlib does): before that, the GIL alone guards the state */
    PyThread_type_lock lock;
} Xxh3Object;

static PyTypeObject Xxh3Type;

static Xxh3Object *
xxh3_new_object(void)
{
    Xxh3Object *self = PyObject_New(Xxh3Object, &Xxh3Type);
    if (self == NULL)
        return NULL;
    self->lock = NULL;
    self->state = XXH3_createState();
    if (self->state == NULL) {
        Py_DECREF(self);
        PyErr_NoMemory();
        return NULL;
    }
    return self;
}

static PyObject *
xxh3_type_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Xxh3() takes no arguments");
        return NULL;
    }
    Xxh3Object *self = xxh3_new_object();
    if (self == NULL)
        return NULL;
    XXH3_64bits_reset(self->state);
    return (PyObject *)self;
}

static void
xxh3_dealloc(Xxh3Object *self)
{
    if (self->state != NULL)
        XXH3_freeState(self->state);
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    PyObject_Free(self);
}

/* take the lock (if there is one yet) without blocking the other threads */
static void
xxh3_acquire(Xxh3Object *self)
{
    if (self->lock != NULL && !PyThread_acquire_lock(self->lock, 0)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, 1);
        Py_END_ALLOW_THREADS
    }
}

static void
xxh3_release(Xxh3Object *self)
{
    if (self->lock != NULL)
        PyThread_release_lock(self->lock);
}

/* hash one buffer; the caller holds the lock (xxh3_acquire) */
static int
xxh3_feed(Xxh3Object *self, PyObject *data)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view.len >= GIL_FREE_MIN) {
        if (self->lock == NULL) { /* from now on every use takes the lock */
            self->lock = PyThread_allocate_lock();
            if (self->lock == NULL) {
                PyBuffer_Release(&view);
                PyErr_NoMemory();
                return -1;
            }
            PyThread_acquire_lock(self->lock, 1);
        }
        Py_BEGIN_ALLOW_THREADS
        XXH3_64bits_update_dispatch(self->state, view.buf, (size_t)view.len);
        clear_upper();
        Py_END_ALLOW_THREADS
    }
    else {
        XXH3_64bits_update_dispatch(self->state, view.buf, (size_t)view.len);
        clear_upper();
    }
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *
xxh3_update(Xxh3Object *self, PyObject *data)
{
    xxh3_acquire(self);
    int rc = xxh3_feed(self, data);
    xxh3_release(self);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static XXH64_hash_t
xxh3_value(Xxh3Object *self)
{
    xxh3_acquire(self);
    XXH64_hash_t h = XXH3_64bits_digest(self->state);
    xxh3_release(self);
    return h;
}

static PyObject *
xxh3_intdigest(Xxh3Object *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)xxh3_value(self));
}

static PyObject *
xxh3_hexdigest(Xxh3Object *self, PyObject *unused)
{
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)xxh3_value(self));
    return PyUnicode_FromStringAndSize(hex, 16);
}

static PyObject *
xxh3_digest(Xxh3Object *self, PyObject *unused)
{
    XXH64_canonical_t c;
    XXH64_canonicalFromHash(&c, xxh3_value(self));
    return PyBytes_FromStringAndSize((const char *)c.digest, sizeof c.digest);
}

static PyObject *
xxh3_copy(Xxh3Object *self, PyObject *unused)
{
    Xxh3Object *other = xxh3_new_object();
    if (other == NULL)
        return NULL;
    xxh3_acquire(self);
    XXH3_copyState(other->state, self->state);
    xxh3_release(self);
    return (PyObject *)other;
}

/* Xxh3.tee(writelines): see the top of the file */
typedef struct {
    PyObject_HEAD
    Xxh3Object *hasher;
    PyObject *writelines;
} TeeObject;

static PyTypeObject TeeType;

static PyObject *
xxh3_tee(Xxh3Object *self, PyObject *writelines)
{
    if (!PyCallable_Check(writelines)) {
        PyErr_SetString(PyExc_TypeError, "tee(writelines): writelines must be callable");
        return NULL;
    }
    TeeObject *t = PyObject_New(TeeObject, &TeeType);
    if (t == NULL)
        return NULL;
    Py_INCREF(self);
    t->hasher = self;
    Py_INCREF(writelines);
    t->writelines = writelines;
    return (PyObject *)t;
}

static void
tee_dealloc(TeeObject *self)
{
    Py_DECREF(self->hasher);
    Py_DECREF(self->writelines);
    PyObject_Free(self);
}

static PyObject *
tee_call(TeeObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *parts;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "a tee takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O", &parts))
        return NULL;
    PyObject *seq = PySequence_Fast(parts, "a tee takes a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int rc = 0;
    xxh3_acquire(self->hasher);
    for (Py_ssize_t i = 0; i < n && rc == 0; i++)
        rc = xxh3_feed(self->hasher, PySequence_Fast_GET_ITEM(seq, i));
    xxh3_release(self->hasher);
    if (rc < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *r = PyObject_CallOneArg(self->writelines, seq);
    Py_DECREF(seq);
    return r;
}

static PyTypeObject TeeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._xxh3.Tee",
    .tp_basicsize = sizeof(TeeObject),
    .tp_dealloc = (destructor)tee_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "f(parts): hash each buffer of parts, then writelines(parts) (Xxh3.tee).",
    .tp_call = (ternaryfunc)tee_call,
};

static PyMethodDef xxh3_methods[] = {
    {"update", (PyCFunction)xxh3_update, METH_O, "update(buffer): hash more bytes."},
    {"intdigest", (PyCFunction)xxh3_intdigest, METH_NOARGS, "The hash so far, an int."},
    {"hexdigest", (PyCFunction)xxh3_hexdigest, METH_NOARGS, "The hash so far, 16 hex digits."},
    {"digest", (PyCFunction)xxh3_digest, METH_NOARGS, "The hash so far, 8 bytes, big-endian."},
    {"copy", (PyCFunction)xxh3_copy, METH_NOARGS, "A copy of this hash's state."},
    {"tee", (PyCFunction)xxh3_tee, METH_O,
     "tee(writelines) -> f(parts): hash each buffer of parts, then writelines(parts)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Xxh3Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._xxh3.Xxh3",
    .tp_basicsize = sizeof(Xxh3Object),
    .tp_dealloc = (destructor)xxh3_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Streaming xxh3_64 (the xxhash package's xxh3_64, through libxxhash).",
    .tp_methods = xxh3_methods,
    .tp_new = xxh3_type_new,
};

static PyMethodDef methods[] = {
    {"xxh3_64_intdigest", xxh3_64_intdigest, METH_O,
     "xxh3_64_intdigest(buffer) -> int: as xxhash.xxh3_64_intdigest."},
    {"hash_rows", hash_rows, METH_VARARGS,
     "hash_rows(blob, offsets) -> bytes: the xxh3_64 of each row, native uint64 values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_xxh3", "xxh3_64 through the system's libxxhash (optional).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__xxh3(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    HAVE_AVX = __builtin_cpu_supports("avx");
#endif
    if (PyType_Ready(&Xxh3Type) < 0 || PyType_Ready(&TeeType) < 0 ||
        PyType_Ready(&BackgroundType) < 0 || PyType_Ready(&OwnedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    PyObject *cap = PyCapsule_New((void *)xxh3_checksum64, "tarshards.checksum64", NULL);
    if (cap == NULL || PyModule_AddObject(m, "checksum64", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&Xxh3Type);
    if (PyModule_AddObject(m, "Xxh3", (PyObject *)&Xxh3Type) < 0) {
        Py_DECREF(&Xxh3Type);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&BackgroundType);
    if (PyModule_AddObject(m, "Background", (PyObject *)&BackgroundType) < 0) {
        Py_DECREF(&BackgroundType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
