/* Optional: the largest deficit rule of tarshards.plan.mixing (mixing by tokens) as one C loop.
 *
 * fill(deficits, weights, costs, pos, order, slots) -> None
 *
 *   deficits  float64 (V, k), C-contiguous, written: the tokens each source is owed per row
 *   weights   float64 (V, k): the shares of the slots filled here (rows sum to 1)
 *   costs     a tuple of k float64 (V, n_s) arrays: source s's costs for row v in delivery
 *             order
 *   pos       int64 (V, k), written: the next position of each source in each row
 *   order     int16 (V, slots), written: the source of each slot
 *
 * For every row v and slot t: the source with the largest deficit among those of weight > 0
 * (ties: the larger weight, then the first source) takes the slot; c = its next cost; then
 * deficits[v] += weights[v] * c and deficits[v, s] -= c. This is TokenDeficits.pick/take
 * (numpy, the reference) in the same float64 operations and order, with no contraction into
 * fused multiply-adds (setup.py builds this file with -ffp-contract=off): the same picks.
 * tests/test_mixing_tokens.py checks that both agree. A position past the end of costs raises
 * IndexError (the Python caller sizes costs so that this cannot happen).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int
get(PyObject *obj, Py_buffer *view, int writable, const char *fmt, Py_ssize_t ndim,
    const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->ndim != ndim || view->format == NULL || strcmp(view->format, fmt) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: a C-contiguous %zd-d array of '%s'", name, ndim, fmt);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#define MAX_SOURCES 1024

static PyObject *
fill(PyObject *self, PyObject *args)
{
    PyObject *od, *ow, *oc, *op, *oo;
    Py_ssize_t slots;
    if (!PyArg_ParseTuple(args, "OOO!OOn", &od, &ow, &PyTuple_Type, &oc, &op, &oo, &slots))
        return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(oc);
    if (k < 1 || k > MAX_SOURCES) {
        PyErr_SetString(PyExc_ValueError, "fill: 1 to 1024 sources");
        return NULL;
    }
    Py_buffer bd, bw, bp, bo;
    Py_buffer *bc = PyMem_Calloc((size_t)k, sizeof(Py_buffer));
    const double **costs = PyMem_Calloc((size_t)k, sizeof(double *));
    Py_ssize_t *width = PyMem_Calloc((size_t)k, sizeof(Py_ssize_t));
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    if (bc == NULL || costs == NULL || width == NULL) {
        PyErr_NoMemory();
        goto free_mem;
    }
    if (get(od, &bd, 1, "d", 2, "deficits") < 0)
        goto free_mem;
    if (get(ow, &bw, 0, "d", 2, "weights") < 0)
        goto fail_d;
    if (get(op, &bp, 1, "l", 2, "pos") < 0 && (PyErr_Clear(), get(op, &bp, 1, "q", 2, "pos") < 0))
        goto fail_w;
    if (get(oo, &bo, 1, "h", 2, "order") < 0)
        goto fail_p;
    for (; got < k; got++) {
        if (get(PyTuple_GET_ITEM(oc, got), &bc[got], 0, "d", 2, "costs") < 0)
            goto fail_c;
        costs[got] = (const double *)bc[got].buf;
        width[got] = bc[got].shape[1];
    }
    Py_ssize_t V = bd.shape[0];
    int shapes_ok = bd.shape[1] == k && bw.shape[0] == V && bw.shape[1] == k &&
                    bp.shape[0] == V && bp.shape[1] == k && bo.shape[0] == V &&
                    bo.shape[1] >= slots && slots >= 0;
    for (Py_ssize_t s = 0; s < k; s++)
        shapes_ok = shapes_ok && bc[s].shape[0] == V;
    if (!shapes_ok) {
        PyErr_SetString(PyExc_ValueError, "fill: the arrays' shapes do not agree");
        goto fail_c;
    }
    double *d = (double *)bd.buf;
    const double *w = (const double *)bw.buf;
    int64_t *pos = (int64_t *)bp.buf;
    int16_t *order = (int16_t *)bo.buf;
    Py_ssize_t ostride = bo.shape[1];
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t v = 0; v < V && !bad; v++) {
        double *dv = d + v * k;
        const double *wv = w + v * k;
        int64_t *pv = pos + v * k;
        for (Py_ssize_t t = 0; t < slots; t++) {
            Py_ssize_t best = -1;
            for (Py_ssize_t s = 0; s < k; s++) {
                if (!(wv[s] > 0))
                    continue;
                if (best < 0 || dv[s] > dv[best] || (dv[s] == dv[best] && wv[s] > wv[best]))
                    best = s;
            }
            if (best < 0 || pv[best] < 0 || pv[best] >= width[best]) {
                bad = 1;
                break;
            }
            double c = costs[best][v * width[best] + pv[best]];
            for (Py_ssize_t r = 0; r < k; r++) {
                double x = wv[r] * c;
                dv[r] = dv[r] + x;
            }
            dv[best] = dv[best] - c;
            pv[best] += 1;
            order[v * ostride + t] = (int16_t)best;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad)
        PyErr_SetString(PyExc_IndexError, "fill: a row has no weight or ran past its costs");
    else
        result = Py_NewRef(Py_None);
fail_c:
    while (got > 0)
        PyBuffer_Release(&bc[--got]);
    PyBuffer_Release(&bo);
fail_p:
    PyBuffer_Release(&bp);
fail_w:
    PyBuffer_Release(&bw);
fail_d:
    PyBuffer_Release(&bd);
free_mem:
    PyMem_Free(bc);
    PyMem_Free((void *)costs);
    PyMem_Free(width);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS,
     "fill(deficits, weights, costs, pos, order, slots): the largest deficit rule over slots"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_deficits",
    "The largest deficit rule of tarshards.plan.mixing as one C loop (optional).", -1, methods,
};

PyMODINIT_FUNC
PyInit__deficits(void)
{
    return PyModule_Create(&moduledef);
}
