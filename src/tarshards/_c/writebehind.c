/* Buffers written to a file and synced by a thread of its own (WriteBehind: an index's save). */
#include "speedups.h"

/* ---------------------------------------------------------------------------------------------
 * WriteBehind(fd, offset, parts, path): a pthread writes the buffers ``parts`` (bytes-like, held
 * as buffer views until wait()) to the open file ``fd`` from ``offset`` on (pwrite: the file's
 * own position is left alone), then fsyncs it; no GIL. wait() joins it (the GIL released),
 * gives the views back, and raises OSError naming ``path`` where a write or the fsync failed;
 * later calls return at once. The object must not outlive the fd (storage.atomic.AtomicOutput
 * waits before it closes the file).
 *
 * Why: saving a 5,000-sample index (805 KB) cost the writing thread 0.5 ms, mostly the kernel
 * allocating the new file's pages, 2 % of ShardWriter's rate on 4.5 KB samples; written behind,
 * it overlaps the next shard's samples.
 *
 * Not across fork: in a child the thread does not exist; wait() raises RuntimeError there and
 * the object is freed without joining (its views are not released: the parent's buffers).
 * --------------------------------------------------------------------------------------------- */
#include <errno.h>
#include <pthread.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started; /* the thread runs or ran, not joined yet */
    int joining; /* a wait() is joining it (the GIL released) */
    int fd;
    long long offset;
    Py_buffer *views;
    Py_ssize_t nviews;
    int err; /* errno of the failed write or fsync (the thread's; read after the join) */
    pid_t pid;
    PyObject *path;
} WriteBehindObject;

static void *
wb_main(void *arg)
{
    WriteBehindObject *w = (WriteBehindObject *)arg;
    long long at = w->offset;
    int err = 0;
    for (Py_ssize_t i = 0; i < w->nviews && !err; i++) {
        const char *p = (const char *)w->views[i].buf;
        Py_ssize_t left = w->views[i].len;
        while (left > 0) {
            ssize_t n = pwrite(w->fd, p, (size_t)left, (off_t)at);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                err = errno;
                break;
            }
            if (n == 0) {
                err = EIO;
                break;
            }
            p += n;
            left -= n;
            at += n;
        }
    }
    if (!err && fsync(w->fd) < 0)
        err = errno;
    w->err = err;
    return NULL;
}

static void
wb_release(WriteBehindObject *w)
{
    if (w->views != NULL) {
        for (Py_ssize_t i = 0; i < w->nviews; i++)
            PyBuffer_Release(&w->views[i]);
        PyMem_Free(w->views);
        w->views = NULL;
        w->nviews = 0;
    }
}

static int
wb_join(WriteBehindObject *w)
{
    if (!w->started)
        return 0;
    if (w->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "a write behind (an index being saved) cannot be waited for in a forked "
                        "child: its thread is in the parent");
        return -1;
    }
    if (w->joining) {
        PyErr_SetString(PyExc_RuntimeError, "WriteBehind.wait() is already running in another "
                                            "thread");
        return -1;
    }
    w->joining = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    w->joining = 0;
    w->started = 0;
    wb_release(w);
    return 0;
}

static PyObject *
WriteBehind_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    int fd;
    long long offset;
    PyObject *parts, *path;
    if (!PyArg_ParseTuple(args, "iLOO:WriteBehind", &fd, &offset, &parts, &path))
        return NULL;
    if (fd < 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "WriteBehind: fd and offset must be >= 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(parts, "WriteBehind: parts must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    WriteBehindObject *w = (WriteBehindObject *)type->tp_alloc(type, 0);
    if (w == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    w->fd = fd;
    w->offset = offset;
    w->pid = getpid();
    Py_INCREF(path);
    w->path = path;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    w->views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (w->views == NULL) {
        Py_DECREF(seq);
        Py_DECREF(w);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &w->views[i], PyBUF_SIMPLE) < 0) {
            Py_DECREF(seq);
            Py_DECREF(w);
            return NULL;
        }
        w->nviews = i + 1;
    }
    Py_DECREF(seq);
    int rc = pthread_create(&w->thread, NULL, wb_main, w);
    if (rc != 0) {
        Py_DECREF(w);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    w->started = 1;
    return (PyObject *)w;
}

static PyObject *
WriteBehind_wait(WriteBehindObject *w, PyObject *Py_UNUSED(ignored))
{
    if (wb_join(w) < 0)
        return NULL;
    if (w->err) {
        int err = w->err;
        w->err = 0; /* raised once */
        errno = err;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, w->path);
    }
    Py_RETURN_NONE;
}

static void
WriteBehind_dealloc(WriteBehindObject *w)
{
    if (w->started && w->pid == getpid()) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(w->thread, NULL);
        Py_END_ALLOW_THREADS
        w->started = 0;
    }
    if (!w->started) /* in a forked child the parent's views stay as they are */
        wb_release(w);
    Py_XDECREF(w->path);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef WriteBehind_methods[] = {
    {"wait", (PyCFunction)WriteBehind_wait, METH_NOARGS,
     "Wait until the parts are written and synced; OSError (naming the path) if they were not."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject WriteBehindType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.WriteBehind",
    .tp_basicsize = sizeof(WriteBehindObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "WriteBehind(fd, offset, parts, path): parts written to fd (pwrite from offset on) "
              "and synced by a thread of its own; wait() for it.",
    .tp_new = WriteBehind_new,
    .tp_dealloc = (destructor)WriteBehind_dealloc,
    .tp_methods = WriteBehind_methods,
};
