/* The _speedups module: its method table and init. Optional C paths of tarshards' hot loops,
 * one concern per file of src/tarshards/_c/:
 *
 * members.c        scan_members: the fast path of tario.iter_tar_batches (plain ustar members
 *                  lying wholly in a buffer, header checksums verified exactly)
 * group.c          group_members: the loop of format.group_samples over one batch of members
 *                  (samples carry __key__, __url__ and __offset__, their first member's offset)
 * samples.c        SampleScan: the samples of a local plain file read with pread and grouped as
 *                  they are read, one a call (the fast path of read.reading.shard_samples)
 * write.c          the writer's per-sample paths: sample_members, members_size, ustar_parts,
 *                  tar_sample
 * recorder.c       Recorder: the index rows recorded while writing; index_columns
 * index_scan.c     index_members: index rows of an existing shard while reading it
 * random_access.c  header_ok, read_sample: a sample read through an index
 * shuffle.c        ShuffleRun: the sample loop of source.ShuffleCore.run, its picks prefetched
 * writebehind.c    WriteBehind: buffers written to a file and synced by a thread of its own
 * tar.h            the one tar header parser (reading) and the one header builder (writing)
 * names.h          the reader's rule for a member's sample key and field
 *
 * All stop (rather than raise) at anything unusual, and the pure Python code takes over from
 * there, so the Python implementation stays the single definition of behaviour and of errors.
 * tests/test_speedups.py checks that both paths agree.
 */
#include "speedups.h"

PyObject *KEY_STR, *URL_STR, *OFFSET_STR, *ZERO_PAD, *THIRTY_TWO;

static PyMethodDef methods[] = {
    {"scan_members", scan_members, METH_VARARGS,
     "scan_members(buf, pos, base, end[, limit[, view[, pax[, layout]]]]) -> (members, pos): plain members "
     "wholly in buf[:end] whose headers start before limit (data: bytes, or slices of view)."},
    {"ustar_parts", ustar_parts, METH_VARARGS,
     "ustar_parts(parts, members, start, mtime, mode) -> (nbytes, stop)."},
    {"group_members", group_members, METH_VARARGS,
     "group_members(batch, start, url, last_dot, sample, key) -> (samples, sample, key, stop)."},
    {"header_ok", header_ok, METH_VARARGS,
     "header_ok(data, at, size) -> bool: a sound header storing size (else: ask Python)."},
    {"index_columns", (PyCFunction)(void (*)(void))index_columns, METH_FASTCALL,
     "index_columns(samples, members) -> 9 bytes: the index's columns of the packed rows."},
    {"sample_members", (PyCFunction)(void (*)(void))sample_members_c, METH_FASTCALL,
     "sample_members(sample, encoder, encode_value) -> list or None: writer.sample_members' "
     "members (None: the Python function decides)."},
    {"members_size", (PyCFunction)(void (*)(void))members_size, METH_FASTCALL,
     "members_size(members, header_size) -> int: a write's bytes in the tar stream."},
    {"tar_sample", (PyCFunction)(void (*)(void))tar_sample, METH_FASTCALL,
     "tar_sample(members, mtime, mode, max_size[, recorder, key]) -> bytes or None: one write's "
     "tar bytes (recorded by the recorder too)."},
    {"read_sample", (PyCFunction)(void (*)(void))read_sample, METH_FASTCALL,
     "read_sample(fd, start, end, base, first, data_offsets, sizes, exts, m0, m1, key, url) -> "
     "dict or None: IndexedDataset's sample of a local plain shard."},
    {"index_members", index_members, METH_VARARGS,
     "index_members(buf, pos, base, end, last_dot, codes, keys, samples, members, key, "
     "checksum) -> (pos, key)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speedups",
                                    "C accelerator for tarshards' reader hot loops.", -1,
                                    methods};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    KEY_STR = PyUnicode_InternFromString("__key__");
    URL_STR = PyUnicode_InternFromString("__url__");
    OFFSET_STR = PyUnicode_InternFromString("__offset__");
    ZERO_PAD = PyBytes_FromStringAndSize(NULL, BLOCK);
    if (ZERO_PAD != NULL)
        memset(PyBytes_AS_STRING(ZERO_PAD), 0, BLOCK);
    if (KEY_STR == NULL || URL_STR == NULL || OFFSET_STR == NULL || ZERO_PAD == NULL)
        return NULL;
    THIRTY_TWO = PyLong_FromLong(32);
    if (THIRTY_TWO == NULL || PyType_Ready(&ShuffleRunType) < 0 ||
        PyType_Ready(&RecorderType) < 0 || PyType_Ready(&WriteBehindType) < 0 ||
        PyType_Ready(&CountedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ShuffleRunType);
    if (PyModule_AddObject(m, "ShuffleRun", (PyObject *)&ShuffleRunType) < 0) {
        Py_DECREF(&ShuffleRunType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RecorderType);
    if (PyModule_AddObject(m, "Recorder", (PyObject *)&RecorderType) < 0) {
        Py_DECREF(&RecorderType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CountedType);
    if (PyModule_AddObject(m, "Counted", (PyObject *)&CountedType) < 0) {
        Py_DECREF(&CountedType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&WriteBehindType);
    if (PyModule_AddObject(m, "WriteBehind", (PyObject *)&WriteBehindType) < 0) {
        Py_DECREF(&WriteBehindType);
        Py_DECREF(m);
        return NULL;
    }
#ifdef HAVE_PREAD
    /* scan_members takes fd, fpos, fstop, min (reads members straight into their bytes) */
    if (PyModule_AddIntConstant(m, "SCAN_DIRECT", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyType_Ready(&SampleScanType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SampleScanType);
    if (PyModule_AddObject(m, "SampleScan", (PyObject *)&SampleScanType) < 0) {
        Py_DECREF(&SampleScanType);
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
