/* The shuffle buffer's sample loop (ShuffleRun). */
#include "speedups.h"

/* ------------------------------------------------------------------------------------------
 * ShuffleRun: the sample loop of source.ShuffleCore.run, with the held samples prefetched.
 *
 * A shuffle buffer of a thousand samples per reader (a dozen readers in one process) holds tens
 * of megabytes of objects that have long left the CPU caches when they are picked; handing a
 * pick on, collating it and freeing it then waits on memory several times per sample. Here each
 * pick (once the buffer is full) is handed on DELAY outputs after it was drawn, and meanwhile its objects are
 * fetched into the cache in three steps (the object, then a dict's table or a sequence's items,
 * then the values they point to), each step one output apart, so the loads overlap the work of
 * the outputs in between. The outputs are the Python loop's, in the same order, from the same
 * random draws: randrange(n) is random.Random's getrandbits(k) rejection loop (for k <= 32,
 * getrandbits(k) is the top k bits of one 32-bit output, getrandbits(32) >> (32 - k)), and the
 * last shuffle of the buffer is the generator's own shuffle(), called after every draw of the
 * picks (as the Python loop calls it). tests/test_source.py checks both loops agree.
 * ---------------------------------------------------------------------------------------- */

/* outputs between a pick's draw and its hand-on, and the steps after the draw at which its
 * table and its values are fetched: a batch is taken at C speed (tens of outputs in a row, each
 * a fraction of a memory latency), so the steps lie a few outputs apart */
#ifndef SHUFFLE_DELAY
#define SHUFFLE_DELAY 8
#endif
#define SHUFFLE_STEP2 (SHUFFLE_DELAY / 3)
#define SHUFFLE_STEP3 (2 * SHUFFLE_DELAY / 3)

typedef struct {
    PyObject_HEAD
    PyObject *buf;         /* list: the buffer (the core's own list) */
    PyObject *it;          /* the input iterator, NULL once it ended */
    PyObject *getrandbits; /* rng.getrandbits */
    PyObject *shuffle;     /* rng.shuffle */
    Py_ssize_t bufsize, initial, emitted, tail;
    int done;
    int npend;
    PyObject *pend[SHUFFLE_DELAY + 1]; /* picks not yet handed on, oldest first */
} ShuffleRun;


static inline void
prefetch_lines(const void *p, int lines)
{
    const char *c = (const char *)p;
    for (int i = 0; i < lines; i++)
        __builtin_prefetch(c + 64 * i);
}

/* step 1: the object itself (and the allocator's word before it) */
static inline void
prefetch_object(PyObject *o)
{
    __builtin_prefetch((const char *)o - 16);
    prefetch_lines(o, 2);
}

/* step 2: what the object points to (a dict's table, a list's or tuple's items) */
static inline void
prefetch_table(PyObject *o)
{
    if (PyDict_CheckExact(o)) {
        PyDictObject *d = (PyDictObject *)o;
        if (d->ma_keys != NULL)
            prefetch_lines(d->ma_keys, 6);
        if (d->ma_values != NULL)
            prefetch_lines(d->ma_values, 2);
    }
    else if (PyTuple_CheckExact(o)) {
        /* the items are in the object */
    }
    else if (PyList_CheckExact(o)) {
        PyObject **items = ((PyListObject *)o)->ob_item;
        if (items != NULL)
            prefetch_lines(items, 2);
    }
}

/* step 3: the values */
static inline void
prefetch_values(PyObject *o)
{
    if (PyDict_CheckExact(o)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(o, &pos, &k, &v))
            prefetch_object(v);
    }
    else if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        PyObject **items = PySequence_Fast_ITEMS(o);
        for (Py_ssize_t i = 0; i < n && i < 16; i++)
            prefetch_object(items[i]);
    }
}

static int
shuffle_randbelow(ShuffleRun *self, Py_ssize_t n, Py_ssize_t *out)
{
    int k = 0;
    while (k < 32 && ((Py_ssize_t)1 << k) <= n)
        k++;
    for (;;) {
        PyObject *r = PyObject_CallOneArg(self->getrandbits, THIRTY_TWO);
        if (r == NULL)
            return -1;
        unsigned long w = PyLong_AsUnsignedLong(r);
        Py_DECREF(r);
        if (w == (unsigned long)-1 && PyErr_Occurred())
            return -1;
        Py_ssize_t v = (Py_ssize_t)((w & 0xffffffffUL) >> (32 - k));
        if (v < n) {
            *out = v;
            return 0;
        }
    }
}

/* a new pick: steps 1-3 move along the picks not yet handed on */
static void
shuffle_push(ShuffleRun *self, PyObject *o)
{
    int n = self->npend;
    self->pend[n] = o;
    self->npend = n + 1;
    prefetch_object(o);
    if (n >= SHUFFLE_STEP2)
        prefetch_table(self->pend[n - SHUFFLE_STEP2]);
    if (n >= SHUFFLE_STEP3)
        prefetch_values(self->pend[n - SHUFFLE_STEP3]);
}

static PyObject *
shuffle_pop(ShuffleRun *self)
{
    PyObject *o = self->pend[0];
    self->npend--;
    memmove(self->pend, self->pend + 1, sizeof(PyObject *) * self->npend);
    self->pend[self->npend] = NULL;
    self->emitted++;
    return o;
}

/* the input's next sample: 1, 0 at its end (it is let go), -1 on an error */
static int
shuffle_next_input(ShuffleRun *self, PyObject **out)
{
    if (self->it == NULL)
        return 0;
    PyObject *x = PyIter_Next(self->it);
    if (x != NULL) {
        *out = x;
        return 1;
    }
    if (PyErr_Occurred())
        return -1;
    Py_CLEAR(self->it);
    return 0;
}

static PyObject *
shuffle_fail(ShuffleRun *self)
{
    self->done = 1;
    Py_CLEAR(self->it);
    return NULL;
}

static PyObject *
ShuffleRun_next(ShuffleRun *self)
{
    if (self->done)
        return NULL;
    PyObject *buf = self->buf;
    while (self->tail < 0) {
        /* while the buffer fills, picks go on at once (output starts as soon as `initial`
         * samples are held, as in Python); once it is full, DELAY outputs after their draw */
        if (self->npend > SHUFFLE_DELAY ||
            (self->npend && PyList_GET_SIZE(buf) < self->bufsize - 1))
            return shuffle_pop(self);
        PyObject *x;
        int got = shuffle_next_input(self, &x);
        if (got < 0)
            return shuffle_fail(self);
        if (got == 0) { /* the input ended: the rest of the buffer shuffled, after the picks */
            PyObject *r = PyObject_CallOneArg(self->shuffle, buf);
            if (r == NULL)
                return shuffle_fail(self);
            Py_DECREF(r);
            self->tail = 0;
            break;
        }
        int ok = PyList_Append(buf, x);
        Py_DECREF(x);
        if (ok < 0)
            return shuffle_fail(self);
        if (PyList_GET_SIZE(buf) < self->bufsize) { /* grow two at a time while filling */
            got = shuffle_next_input(self, &x);
            if (got < 0)
                return shuffle_fail(self);
            if (got) {
                ok = PyList_Append(buf, x);
                Py_DECREF(x);
                if (ok < 0)
                    return shuffle_fail(self);
            }
        }
        Py_ssize_t n = PyList_GET_SIZE(buf);
        if (n >= self->initial) {
            Py_ssize_t i;
            if (shuffle_randbelow(self, n, &i) < 0)
                return shuffle_fail(self);
            PyObject **items = ((PyListObject *)buf)->ob_item;
            PyObject *pick = items[i];
            items[i] = items[n - 1];
            items[n - 1] = NULL;
            Py_SET_SIZE(buf, n - 1); /* the pick's reference moves to pend */
            shuffle_push(self, pick);
        }
    }
    if (self->npend)
        return shuffle_pop(self);
    Py_ssize_t n = PyList_GET_SIZE(buf);
    if (self->tail < n) {
        PyObject **items = ((PyListObject *)buf)->ob_item;
        Py_ssize_t t = self->tail;
        PyObject *x = items[t];
        Py_INCREF(Py_None);
        items[t] = Py_None;
        if (t + SHUFFLE_DELAY < n)
            prefetch_object(items[t + SHUFFLE_DELAY]);
        if (t + SHUFFLE_DELAY - SHUFFLE_STEP2 < n)
            prefetch_table(items[t + SHUFFLE_DELAY - SHUFFLE_STEP2]);
        if (t + SHUFFLE_DELAY - SHUFFLE_STEP3 < n)
            prefetch_values(items[t + SHUFFLE_DELAY - SHUFFLE_STEP3]);
        self->tail = t + 1;
        self->emitted++;
        return x;
    }
    self->done = 1;
    return NULL;
}

static int
ShuffleRun_traverse(ShuffleRun *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buf);
    Py_VISIT(self->it);
    Py_VISIT(self->getrandbits);
    Py_VISIT(self->shuffle);
    for (int i = 0; i < self->npend; i++)
        Py_VISIT(self->pend[i]);
    return 0;
}

static int
ShuffleRun_clear(ShuffleRun *self)
{
    Py_CLEAR(self->buf);
    Py_CLEAR(self->it);
    Py_CLEAR(self->getrandbits);
    Py_CLEAR(self->shuffle);
    for (int i = 0; i < self->npend; i++)
        Py_CLEAR(self->pend[i]);
    self->npend = 0;
    return 0;
}

static void
ShuffleRun_dealloc(ShuffleRun *self)
{
    PyObject_GC_UnTrack(self);
    ShuffleRun_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
ShuffleRun_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *buf, *it, *getrandbits, *shuffle;
    Py_ssize_t bufsize, initial, emitted, tail;
    if (!PyArg_ParseTuple(args, "O!OOOnnnn:ShuffleRun", &PyList_Type, &buf, &it, &getrandbits,
                          &shuffle, &bufsize, &initial, &emitted, &tail))
        return NULL;
    if (bufsize < 1 || bufsize > ((Py_ssize_t)1 << 31) || initial < 1) {
        PyErr_SetString(PyExc_ValueError, "ShuffleRun: bufsize in 1..2**31, initial >= 1");
        return NULL;
    }
    PyObject *iter = PyObject_GetIter(it);
    if (iter == NULL)
        return NULL;
    ShuffleRun *self = (ShuffleRun *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(iter);
        return NULL;
    }
    Py_INCREF(buf);
    self->buf = buf;
    self->it = iter;
    Py_INCREF(getrandbits);
    self->getrandbits = getrandbits;
    Py_INCREF(shuffle);
    self->shuffle = shuffle;
    self->bufsize = bufsize;
    self->initial = initial;
    self->emitted = emitted;
    self->tail = tail;
    return (PyObject *)self;
}

static PyObject *
ShuffleRun_close(ShuffleRun *self, PyObject *Py_UNUSED(ignored))
{
    self->done = 1;
    Py_CLEAR(self->it);
    for (int i = 0; i < self->npend; i++)
        Py_CLEAR(self->pend[i]);
    self->npend = 0;
    Py_RETURN_NONE;
}

static PyMethodDef ShuffleRun_methods[] = {
    {"close", (PyCFunction)ShuffleRun_close, METH_NOARGS,
     "Stop: the input and the picks not handed on are let go (as a generator's close)."},
    {NULL}};

static PyMemberDef ShuffleRun_members[] = {
    {"emitted", T_PYSSIZET, offsetof(ShuffleRun, emitted), READONLY, "outputs handed on"},
    {"tail", T_PYSSIZET, offsetof(ShuffleRun, tail), READONLY,
     "-1 while the input lasts; then the next output's place in buf"},
    {"held", T_INT, offsetof(ShuffleRun, npend), READONLY, "picks drawn, not yet handed on"},
    {NULL}};

PyTypeObject ShuffleRunType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.ShuffleRun",
    .tp_basicsize = sizeof(ShuffleRun),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ShuffleRun(buf, it, getrandbits, shuffle, bufsize, initial, emitted, tail): "
              "ShuffleCore.run's sample loop (see the comment above it in _c/shuffle.c).",
    .tp_new = ShuffleRun_new,
    .tp_dealloc = (destructor)ShuffleRun_dealloc,
    .tp_traverse = (traverseproc)ShuffleRun_traverse,
    .tp_clear = (inquiry)ShuffleRun_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)ShuffleRun_next,
    .tp_members = ShuffleRun_members,
    .tp_methods = ShuffleRun_methods,
};
