/* Counted: the base of a pipeline pass's iterator (tarshards.pipeline.iteration.StreamIterator),
 * which counts the items it hands out at C speed.
 *
 * Counted(iterable) iterates `iterable`; `position` is the items yielded so far and `finished`
 * turns true when the underlying iterator is exhausted (its StopIteration passes through). A
 * Python subclass that does not define __next__ keeps this type's tp_iternext: one C call an
 * item instead of a Python frame (measured: 0.10 us an item, 5% of a raw small-sample read).
 * iteration.py has the same class in Python, the reference, used where this is not built.
 */
#include "speedups.h"
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *it;          /* the underlying iterator; NULL once exhausted */
    Py_ssize_t position;   /* items yielded */
    char finished;
    PyObject *dict;        /* a subclass's attributes (epoch, info, ...) */
} CountedObject;

static int
counted_init(CountedObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *iterable;
    if (!PyArg_ParseTuple(args, "O:Counted", &iterable))
        return -1;
    PyObject *it = PyObject_GetIter(iterable);
    if (it == NULL)
        return -1;
    Py_XSETREF(self->it, it);
    self->position = 0;
    self->finished = 0;
    return 0;
}

static PyObject *
counted_next(CountedObject *self)
{
    if (self->it == NULL)
        return NULL;
    PyObject *item = (*Py_TYPE(self->it)->tp_iternext)(self->it);
    if (item == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_StopIteration))
            return NULL; /* an error of the pipeline: raised, the pass not finished */
        PyErr_Clear();
        self->finished = 1;
        Py_CLEAR(self->it);
        return NULL;
    }
    self->position++;
    return item;
}

static int
counted_traverse(CountedObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->it);
    Py_VISIT(self->dict);
    return 0;
}

static int
counted_clear(CountedObject *self)
{
    Py_CLEAR(self->it);
    Py_CLEAR(self->dict);
    return 0;
}

static void
counted_dealloc(CountedObject *self)
{
    PyObject_GC_UnTrack(self);
    counted_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef counted_members[] = {
    {"position", T_PYSSIZET, offsetof(CountedObject, position), 0, "items yielded"},
    {"finished", T_BOOL, offsetof(CountedObject, finished), 0, "the underlying iterator ended"},
    {NULL}};

PyTypeObject CountedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.Counted",
    .tp_basicsize = sizeof(CountedObject),
    .tp_dealloc = (destructor)counted_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Counted(iterable): iterates it, counting the items yielded (position, finished).",
    .tp_traverse = (traverseproc)counted_traverse,
    .tp_clear = (inquiry)counted_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)counted_next,
    .tp_members = counted_members,
    .tp_dictoffset = offsetof(CountedObject, dict),
    .tp_init = (initproc)counted_init,
    .tp_new = PyType_GenericNew,
};
