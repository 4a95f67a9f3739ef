/* Optional: the largest deficit rule of tarshards.plan.mixing (mixing by tokens) as one C loop,
 * and the packing rule of tarshards.plan.packing (plan_packs, below).
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

/* plan_packs(costs, budget, k) -> (unit_of, key): the packing rule of tarshards.packing
 * (_OpenPacks, _plan_packs_py: the reference) as one loop.
 *
 *   costs   float64 (n,), C-contiguous: the samples' costs in stream order
 *   budget  the pack's budget; a sample costing more is a pack of its own, out at once
 *   k       the most packs open at once (slots)
 *
 * Returns two bytes objects of int64: each sample's pack (packs numbered as opened) and each
 * pack's order key (2 i: out when sample i arrives; 2 n + 1: still open at the end). A sample
 * goes into the pack of the sample placed before it where it fits, else into the open pack with
 * the least room that fits it (ties: the lowest slot); where none fits, a new pack opens in the
 * lowest free slot, or, every slot taken, in the slot of the fullest open pack (the least room;
 * ties: the lowest slot), which is closed. room = budget; room -= c: the same float64
 * operations as the Python rule.
 */
static PyObject *
plan_packs(PyObject *self, PyObject *args)
{
    PyObject *costs_obj;
    double budget;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "Odn:plan_packs", &costs_obj, &budget, &k))
        return NULL;
    if (k < 1) {
        PyErr_SetString(PyExc_ValueError, "plan_packs: k must be >= 1");
        return NULL;
    }
    Py_buffer bc;
    if (get(costs_obj, &bc, 0, "d", 1, "costs") < 0)
        return NULL;
    Py_ssize_t n = bc.shape[0];
    const double *costs = (const double *)bc.buf;
    PyObject *unit_obj = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    int64_t *key = PyMem_Malloc((n ? n : 1) * sizeof(int64_t));
    double *room = PyMem_Malloc(k * sizeof(double));
    int64_t *ids = PyMem_Malloc(k * sizeof(int64_t));
    PyObject *result = NULL;
    if (unit_obj == NULL || key == NULL || room == NULL || ids == NULL) {
        if (unit_obj != NULL)
            PyErr_NoMemory();
        goto done;
    }
    int64_t *unit_of = (int64_t *)PyBytes_AS_STRING(unit_obj);
    int64_t next_id = 0, end = 2 * (int64_t)n + 1;
    Py_ssize_t open = 0, prev = -1; /* slots open; the slot of the last sample placed */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        double c = costs[i];
        if (c > budget) { /* a pack of its own, out at once */
            unit_of[i] = next_id;
            key[next_id++] = 2 * (int64_t)i;
            continue;
        }
        Py_ssize_t best = -1;
        if (prev >= 0 && room[prev] >= c) {
            best = prev; /* the previous sample's pack, where it fits */
        } else {
            double least = 0.0;
            for (Py_ssize_t s = 0; s < open; s++) {
                if (room[s] >= c && (best < 0 || room[s] < least)) {
                    best = s;
                    least = room[s];
                }
            }
        }
        if (best < 0) {
            if (open < k) {
                best = open++;
            } else { /* close the fullest open pack; the new one takes its slot */
                best = 0;
                for (Py_ssize_t s = 1; s < k; s++)
                    if (room[s] < room[best])
                        best = s;
                key[ids[best]] = 2 * (int64_t)i;
            }
            room[best] = budget;
            ids[best] = next_id;
            key[next_id++] = end;
        }
        room[best] -= c;
        unit_of[i] = ids[best];
        prev = best;
    }
    Py_END_ALLOW_THREADS
    PyObject *key_obj = PyBytes_FromStringAndSize((const char *)key,
                                                  (Py_ssize_t)next_id * (Py_ssize_t)sizeof(int64_t));
    if (key_obj != NULL) {
        result = PyTuple_Pack(2, unit_obj, key_obj);
        Py_DECREF(key_obj);
    }
done:
    Py_XDECREF(unit_obj);
    PyMem_Free(key);
    PyMem_Free(room);
    PyMem_Free(ids);
    PyBuffer_Release(&bc);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS,
     "fill(deficits, weights, costs, pos, order, slots): the largest deficit rule over slots"},
    {"plan_packs", plan_packs, METH_VARARGS,
     "plan_packs(costs, budget, k) -> (unit_of, key): the packing rule of tarshards.packing"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_deficits",
    "The largest deficit rule of tarshards.plan.mixing and the packing rule of "
    "tarshards.plan.packing as C loops (optional).", -1, methods,
};

PyMODINIT_FUNC
PyInit__deficits(void)
{
    return PyModule_Create(&moduledef);
}
