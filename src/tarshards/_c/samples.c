/* SampleScan: the samples of a local plain tar file, read with pread and grouped as they are
 * read: the fast path of read.reading.shard_samples for bytes values (and of the planned
 * readers' runs, and of plan.epoch.scan_shards for offsets).
 *
 * SampleScan(fd, start, stop, url, last_dot, delta[, size[, data]]) iterates sample dicts
 * ({"__key__", "__url__", "__offset__", ext: bytes, ...}, as format.group_samples makes them)
 * from file offset start (a header) up to stop; a sample's "__offset__" is its first header's
 * file offset plus delta (its offset in the tar stream). One sample a call: the consumer frees
 * a sample before it asks for the next, whose large member is then read into memory still in
 * the CPU's cache (the reader's batches of members, about 1 MiB each, wrote to memory out of
 * L2: measured ~10% of a raw read of 100 KB samples). A member whose data runs past the scan's
 * buffer by at least SCAN_DIRECT_MIN bytes is read from the file straight into its bytes object
 * (one copy from the page cache), and the padding and next headers after it by the same call
 * (preadv). The buffer of headers and small members starts at 16 KiB and grows, where small
 * members are copied out of it, up to size bytes (256 KiB; a reader among many passes less).
 * With data false, only where the samples are: their fields map to None, the data is skipped
 * and never read (the headers are read SCAN_SKIP bytes at a time).
 *
 * It ends at the end-of-archive marker (two zero blocks, or one that ends the file), or where
 * the input ends at a header's place (a tar without the marker, as the reader takes it; a byte
 * range cut where a sample ends): `done` turns true. It stops (StopIteration, no error) at
 * anything else it does not take, as every C path here declines: a header that is neither a
 * plain member nor a directory of size 0 (alone or behind a harmless pax or GNU long name
 * header), a bad checksum, a repeated extension, a lone zero block, the end of the file
 * elsewhere, a member larger than the file. `resume` is then the file offset of the first
 * header of the sample it was reading (a sample boundary: every sample before it was handed out
 * whole), where the Python reader goes on and decides (and raises, naming member and offset).
 * OS errors are raised. */
#include "speedups.h"

#ifdef HAVE_PREAD

#define SCAN_CAP (256 << 10) /* the most the buffer of headers and small members grows to */
#define SCAN_START (16 << 10) /* what it starts at (it grows where small members are copied) */
#define SCAN_CHUNK (64 << 10) /* a refill with nothing known of the layout */
#define SCAN_SKIP (8 << 10) /* a refill where members' data is skipped (headers only) */
#define SCAN_DIRECT_MIN (16 << 10) /* read straight into a member: at least this much */
#define SCAN_SLACK 1024 /* a refill sized by the layout asks for this much more (see members.c) */
#define SCAN_KEY_MAX 4096 /* a longer key: declined */
#define SCAN_EXTS 8 /* extensions remembered (their str, lower-cased) */
#define SCAN_EXT_MAX 32

typedef struct {
    PyObject_HEAD
    int fd;
    long long fpos;  /* the file offset of buf[end] */
    long long fstop; /* where the input stops */
    long long delta; /* a stream offset is a file offset plus delta */
    long long origin; /* where the input starts */
    unsigned char *buf;
    Py_ssize_t cap, max; /* the buffer's size; the most it grows to */
    /* unread: buf[pos:end]; pos > end: the bytes up to pos (padding) are skipped first */
    Py_ssize_t pos, end;
    PyObject *url;
    int last_dot;
    int data;           /* read the members' data (else only where the samples are) */
    Py_ssize_t chunk;   /* a refill's size with nothing known of the layout */
    int stopped;
    int busy;           /* a call is reading (another thread's next() is refused) */
    int done;           /* the archive's end-of-archive marker was read: nothing is left */
    long long resume;   /* where the Python reader goes on (once stopped) */
    long long gap;      /* the bytes between the last two members read straight in (-1: none) */
    long long last_end; /* where the last member read straight in ends (padded; -1: none) */
    Py_ssize_t nexts;
    unsigned char ext_raw[SCAN_EXTS][SCAN_EXT_MAX];
    Py_ssize_t ext_len[SCAN_EXTS];
    PyObject *ext_str[SCAN_EXTS];
    unsigned char key[SCAN_KEY_MAX];
} SampleScanObject;

static int
scan_init(SampleScanObject *s, PyObject *args, PyObject *kwds)
{
    int fd, last_dot;
    long long start, stop, delta;
    Py_ssize_t max = SCAN_CAP;
    int data = 1;
    PyObject *url;
    if (!PyArg_ParseTuple(args, "iLLOpL|np:SampleScan", &fd, &start, &stop, &url, &last_dot,
                          &delta, &max, &data))
        return -1;
    if (start < 0 || stop < start) {
        PyErr_SetString(PyExc_ValueError, "SampleScan: 0 <= start <= stop");
        return -1;
    }
    if (max < 4 * BLOCK)
        max = 4 * BLOCK;
    PyMem_Free(s->buf);
    s->cap = max < SCAN_START ? max : SCAN_START;
    s->max = max;
    s->buf = PyMem_Malloc((size_t)s->cap);
    if (s->buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->fd = fd;
    s->fpos = start;
    s->origin = start;
    s->fstop = stop;
    s->delta = delta;
    s->pos = s->end = 0;
    Py_INCREF(url);
    Py_XSETREF(s->url, url);
    s->last_dot = last_dot;
    s->data = data;
    s->chunk = data ? SCAN_CHUNK : SCAN_SKIP;
    s->stopped = 0;
    s->done = 0;
    s->resume = start;
    s->gap = s->last_end = -1;
    return 0;
}

/* the buffer grown to at least n bytes (twice its size or more, at most max; its bytes kept):
 * 0, or -1 with MemoryError */
static int
scan_grow(SampleScanObject *s, Py_ssize_t n)
{
    Py_ssize_t cap = s->cap * 2 > n ? s->cap * 2 : n;
    if (cap > s->max)
        cap = s->max;
    if (cap <= s->cap)
        return 0;
    unsigned char *buf = PyMem_Realloc(s->buf, (size_t)cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->buf = buf;
    s->cap = cap;
    return 0;
}

/* the file offset of buf[pos] */
static inline long long
scan_at(SampleScanObject *s)
{
    return s->fpos - s->end + s->pos;
}

/* at least n bytes at buf[pos] (the unread bytes moved to the front, then read, hint bytes a
 * call or more): 1; 0 where the input ends first or n does not fit the buffer; -1 with OSError */
static int
scan_fill(SampleScanObject *s, Py_ssize_t n, Py_ssize_t hint)
{
    if (s->end - s->pos >= n)
        return 1;
    if (n > s->max)
        return 0;
    long long at = scan_at(s);
    Py_ssize_t keep = s->end > s->pos ? s->end - s->pos : 0;
    if (keep > 0 && s->pos > 0)
        memmove(s->buf, s->buf + s->pos, (size_t)keep);
    s->pos = 0;
    s->end = keep;
    s->fpos = at + keep;
    if (n > s->cap && scan_grow(s, n) < 0)
        return -1;
    while (s->end < n) {
        long long want = n - s->end > hint ? n - s->end : hint;
        if (want > s->cap - s->end)
            want = s->cap - s->end;
        if (want > s->fstop - s->fpos)
            want = s->fstop - s->fpos;
        if (want <= 0)
            return 0;
        ssize_t got;
        int fd = s->fd;
        unsigned char *dst = s->buf + s->end;
        off_t off = (off_t)s->fpos;
        Py_BEGIN_ALLOW_THREADS
        do {
            got = pread(fd, dst, (size_t)want, off);
        } while (got < 0 && errno == EINTR);
        Py_END_ALLOW_THREADS
        if (got < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (got == 0)
            return 0;
        s->end += got;
        s->fpos += got;
    }
    return 1;
}

/* a directory's header ('5', canonical, size 0): the reader skips it and reads on from the next
 * block (a directory's size is never data there: one that declares some is the reader's) */
static inline int
scan_directory(const unsigned char *h)
{
    long long size;
    return h[TAR_TYPE] == '5' && tar_canonical_header(h, &size) && size == 0;
}

/* a directory's pax records: each well formed, none that the reader would read a value of
 * (size, GNU.sparse); its path, whatever it is, names nothing the reader keeps */
static int
scan_directory_pax(const unsigned char *p, ptrdiff_t n)
{
    ptrdiff_t pos = 0, keylen, vallen;
    const unsigned char *key, *val;
    int rc;
    while ((rc = tar_pax_record(p, n, TAR_EXACT, &pos, &key, &keylen, &val, &vallen)) == 1)
        if ((keylen == 4 && memcmp(key, "size", 4) == 0) ||
            (keylen >= 10 && memcmp(key, "GNU.sparse", 10) == 0))
            return 0;
    return rc == 0;
}

/* the extension's str, lower-cased as format.names lower-cases it (remembered by its bytes) */
static PyObject *
scan_ext(SampleScanObject *s, const unsigned char *p, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < s->nexts; i++)
        if (s->ext_len[i] == n && memcmp(s->ext_raw[i], p, (size_t)n) == 0) {
            Py_INCREF(s->ext_str[i]);
            return s->ext_str[i];
        }
    PyObject *e = PyUnicode_DecodeUTF8((const char *)p, n, "surrogateescape");
    if (e == NULL)
        return NULL;
    int lower = 0;
    for (Py_ssize_t j = 0; j < n; j++)
        if (p[j] >= 128 || (p[j] >= 'A' && p[j] <= 'Z')) {
            lower = 1;
            break;
        }
    if (lower) {
        PyObject *low = PyObject_CallMethod(e, "lower", NULL);
        Py_DECREF(e);
        if (low == NULL)
            return NULL;
        e = low;
    }
    PyUnicode_InternInPlace(&e); /* one str a process for each extension, as group.c's */
    if (n <= SCAN_EXT_MAX) {
        Py_ssize_t i = s->nexts < SCAN_EXTS ? s->nexts++ : (Py_ssize_t)(p[0] % SCAN_EXTS);
        memcpy(s->ext_raw[i], p, (size_t)n);
        s->ext_len[i] = n;
        Py_INCREF(e);
        Py_XSETREF(s->ext_str[i], e);
    }
    return e;
}

/* a new sample dict: its key, url and offset */
static PyObject *
scan_new_sample(SampleScanObject *s, const unsigned char *key, Py_ssize_t keylen, long long at)
{
    PyObject *k = PyUnicode_DecodeUTF8((const char *)key, keylen, "surrogateescape");
    PyObject *off = k == NULL ? NULL : PyLong_FromLongLong(at + s->delta);
    PyObject *d = off == NULL ? NULL : PyDict_New();
    if (d != NULL && (PyDict_SetItem(d, KEY_STR, k) < 0 || PyDict_SetItem(d, URL_STR, s->url) < 0 ||
                      PyDict_SetItem(d, OFFSET_STR, off) < 0))
        Py_CLEAR(d);
    Py_XDECREF(k);
    Py_XDECREF(off);
    return d;
}

static PyObject *
scan_step(SampleScanObject *s)
{
    if (s->stopped || s->buf == NULL)
        return NULL;
    const long long call_at = scan_at(s); /* a header: this call's sample starts here */
    PyObject *sample = NULL;
    Py_ssize_t keylen = 0;
    int rc;
    for (;;) {
        rc = scan_fill(s, BLOCK, s->chunk);
        if (rc == 0 && s->pos == s->end && scan_at(s) == s->fstop && s->fstop > s->origin) {
            /* the input ends where a header would start: a tar without its end-of-archive
             * marker, or a byte range that ends where a sample does (as the reader takes it) */
            s->stopped = s->done = 1;
            s->resume = s->fstop;
            return sample;
        }
        if (rc <= 0)
            goto stop;
        const unsigned char *h = s->buf + s->pos;
        long long hoff = scan_at(s);
        long long size;
        ptrdiff_t at = 0;
        const unsigned char *path = NULL;
        ptrdiff_t pathlen = 0;
        if (tar_zero_block(h)) {
            /* the end-of-archive marker: two zero blocks, or one that ends the file (a lone
             * zero block before more headers, or bytes after one that do not make a block,
             * are the Python reader's) */
            if (hoff + BLOCK < s->fstop) {
                rc = scan_fill(s, 2 * BLOCK, 2 * BLOCK);
                if (rc < 0)
                    goto stop;
                h = s->buf + s->pos;
                if (rc == 0 || !tar_zero_block(h + BLOCK)) {
                    rc = 0;
                    goto stop;
                }
            }
            s->stopped = s->done = 1;
            s->resume = s->fstop;
            return sample; /* the last sample (NULL: none, the iteration ends) */
        }
        if (scan_directory(h)) {
            s->pos += BLOCK; /* a directory (GNU tar's "./" first): nothing to read */
            continue;
        }
        if (!tar_plain_header(h, &size)) {
            long long psize;
            if ((h[TAR_TYPE] != 'x' && h[TAR_TYPE] != 'L') || !tar_canonical_header(h, &psize) ||
                psize > MAX_META) {
                rc = 0;
                goto stop;
            }
            Py_ssize_t member = BLOCK + (Py_ssize_t)tar_padded(psize);
            rc = scan_fill(s, member + BLOCK, s->chunk);
            if (rc <= 0)
                goto stop;
            h = s->buf + s->pos;
            if (scan_directory(h + member) &&
                (h[TAR_TYPE] == 'L' || scan_directory_pax(h + BLOCK, (ptrdiff_t)psize))) {
                s->pos += member + BLOCK; /* a directory behind its pax or long name header */
                continue;
            }
            /* the headers are in the buffer (the data need not be: room is not checked here) */
            if (!tar_pax_member(h, PTRDIFF_MAX / 4, &at, &size, &path, &pathlen)) {
                rc = 0;
                goto stop;
            }
        }
        const unsigned char *name = path != NULL ? path : h + at;
        size_t namelen = path != NULL ? (size_t)pathlen : tar_name_len(h + at);
        size_t skip, dot;
        Py_ssize_t data_at = s->pos + at + BLOCK;
        if (size > s->fstop - (s->fpos - s->end + data_at)) {
            rc = 0; /* the member runs past the input: the Python reader says where it ends */
            goto stop;
        }
        if (!name_split(name, namelen, s->last_dot, &skip, &dot)) {
            s->pos = data_at + (Py_ssize_t)tar_padded(size); /* a member grouping skips */
            continue;
        }
        const unsigned char *key = name + skip;
        const unsigned char *ext = key + dot + 1;
        Py_ssize_t extlen = (Py_ssize_t)(namelen - skip - dot - 1);
        if (sample != NULL &&
            (keylen != (Py_ssize_t)dot || memcmp(s->key, key, (size_t)keylen) != 0))
            return sample; /* the next sample's first member: this one is whole */
        if (sample == NULL) {
            if (dot > SCAN_KEY_MAX) {
                rc = 0;
                goto stop;
            }
            memcpy(s->key, key, dot);
            keylen = (Py_ssize_t)dot;
            sample = scan_new_sample(s, key, keylen, hoff);
            if (sample == NULL) {
                rc = -1;
                goto stop;
            }
        }
        PyObject *e = scan_ext(s, ext, extlen);
        if (e == NULL) {
            rc = -1;
            goto stop;
        }
        int has = PyDict_Contains(sample, e);
        if (has != 0) { /* a repeated extension: the Python reader raises the error */
            Py_DECREF(e);
            rc = has < 0 ? -1 : 0;
            goto stop;
        }
        PyObject *data;
        Py_ssize_t have = s->end - data_at;
        long long need = size - have;
        if (!s->data) { /* where the samples are, only: the data skipped, not read */
            data = Py_NewRef(Py_None);
            s->pos = data_at + (Py_ssize_t)tar_padded(size);
        }
        else if (need <= 0) {
            data = PyBytes_FromStringAndSize((const char *)s->buf + data_at, (Py_ssize_t)size);
            s->pos = data_at + (Py_ssize_t)tar_padded(size);
        }
        else if (need >= SCAN_DIRECT_MIN || at + BLOCK + size > s->max) {
            /* the rest read from the file into its bytes object, then (the same call) the
             * padding and what follows: about as much as lay between the last two such members
             * (the headers and small members of a sample) and a little more */
            long long pad = tar_padded(size) - size;
            long long after = s->fpos + need; /* the file offset after the data */
            long long first = hoff + at;      /* the member's own header */
            if (s->last_end >= 0 && first >= s->last_end)
                s->gap = first + BLOCK - s->last_end;
            s->last_end = first + BLOCK + tar_padded(size);
            long long want = SCAN_CHUNK;
            if (s->gap >= 0 && s->gap + SCAN_SLACK < SCAN_CHUNK)
                want = (s->gap + SCAN_SLACK + BLOCK - 1) / BLOCK * BLOCK;
            long long tail = pad + want;
            if (tail > s->cap)
                tail = s->cap;
            if (tail > s->fstop - after)
                tail = s->fstop - after;
            if (tail < 0)
                tail = 0;
            Py_ssize_t got = 0;
            data = read_rest(s->buf + data_at, have, s->fd, s->fpos, need, (char *)s->buf,
                             (Py_ssize_t)tail, &got);
            if (data != NULL) {
                /* buf[0] is the byte after the data; where the call came short, nothing is
                 * buffered and the padding is skipped by the next fill */
                s->fpos = after + got;
                s->end = got;
                s->pos = (Py_ssize_t)pad;
            }
        }
        else {
            /* small members copied out of the buffer: it grows (up to max), for fewer reads */
            if (s->cap < s->max && scan_grow(s, s->cap * 2) < 0) {
                Py_DECREF(e);
                rc = -1;
                goto stop;
            }
            rc = scan_fill(s, at + BLOCK + (Py_ssize_t)size, SCAN_CHUNK);
            if (rc <= 0) {
                Py_DECREF(e);
                goto stop;
            }
            data_at = s->pos + at + BLOCK;
            data = PyBytes_FromStringAndSize((const char *)s->buf + data_at, (Py_ssize_t)size);
            s->pos = data_at + (Py_ssize_t)tar_padded(size);
        }
        if (data == NULL) {
            Py_DECREF(e);
            rc = -1;
            goto stop;
        }
        rc = PyDict_SetItem(sample, e, data);
        Py_DECREF(e);
        Py_DECREF(data);
        if (rc < 0) {
            rc = -1;
            goto stop;
        }
    }
stop:
    /* declined (rc 0) or an error (rc -1): the sample being read is the Python reader's */
    s->stopped = 1;
    s->resume = call_at;
    Py_XDECREF(sample);
    return NULL;
}

/* one caller at a time (the GIL is let go while it reads: a second thread would find the buffer
 * half filled) */
static PyObject *
scan_next(SampleScanObject *s)
{
    if (s->busy) {
        PyErr_SetString(PyExc_RuntimeError, "SampleScan: next() while another thread reads it");
        return NULL;
    }
    s->busy = 1;
    PyObject *sample = scan_step(s);
    s->busy = 0;
    return sample;
}

static PyObject *
scan_get_resume(SampleScanObject *s, void *closure)
{
    return PyLong_FromLongLong(s->resume);
}

static PyObject *
scan_get_stopped(SampleScanObject *s, void *closure)
{
    return PyBool_FromLong(s->stopped);
}

static PyObject *
scan_get_done(SampleScanObject *s, void *closure)
{
    return PyBool_FromLong(s->done);
}

static PyGetSetDef scan_getset[] = {
    {"resume", (getter)scan_get_resume, NULL,
     "the file offset where the Python reader goes on (a sample's first header), once stopped",
     NULL},
    {"stopped", (getter)scan_get_stopped, NULL, "whether the scan has stopped", NULL},
    {"done", (getter)scan_get_done, NULL,
     "whether it read the end-of-archive marker (nothing is left for the Python reader)", NULL},
    {NULL}};

static int
scan_traverse(SampleScanObject *s, visitproc visit, void *arg)
{
    Py_VISIT(s->url);
    for (Py_ssize_t i = 0; i < s->nexts; i++)
        Py_VISIT(s->ext_str[i]);
    return 0;
}

static int
scan_clear(SampleScanObject *s)
{
    Py_CLEAR(s->url);
    for (Py_ssize_t i = 0; i < s->nexts; i++)
        Py_CLEAR(s->ext_str[i]);
    s->nexts = 0;
    return 0;
}

static void
scan_dealloc(SampleScanObject *s)
{
    PyObject_GC_UnTrack(s);
    scan_clear(s);
    PyMem_Free(s->buf);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

PyTypeObject SampleScanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.SampleScan",
    .tp_basicsize = sizeof(SampleScanObject),
    .tp_dealloc = (destructor)scan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SampleScan(fd, start, stop, url, last_dot, delta[, size[, data]]): the samples of "
              "a local plain tar file from offset start (a header) to stop, read with pread "
              "through a buffer of at most size bytes (data false: fields None, their data "
              "skipped); stops (resume: where the Python reader goes on) at anything unusual.",
    .tp_traverse = (traverseproc)scan_traverse,
    .tp_clear = (inquiry)scan_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)scan_next,
    .tp_getset = scan_getset,
    .tp_init = (initproc)scan_init,
    .tp_new = PyType_GenericNew,
};

#endif
