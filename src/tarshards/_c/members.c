/* The reader's member scan: consecutive plain members of a byte run (scan_members), the fast
 * path of tario.iter_tar_batches. */
#include "speedups.h"

#ifndef REFILL
#define REFILL (8 << 10)
#endif
/* a refill sized by the last sample's layout (see gap in scan_members) asks for this much more */
#ifndef REFILL_SLACK
#define REFILL_SLACK 1024
#endif
/* a scan reading members straight into their bytes returns after about this many bytes of
 * them (a batch: the consumer frees it before the next, whose bytes then reuse that memory,
 * still in cache, as reader.COPY_WINDOW does for a map). Each batch costs ~1.3 us of Python
 * (the reader's loop, the grouping call): over 100 KB samples (bench/bench_reads.py, a 1 MiB
 * L2), 64 KiB batches read a pass in 29-30 ms, 256 KiB in 25.4-26.7, 1 MiB in 24.5-25.1,
 * 2 MiB no faster */
#ifndef DIRECT_WINDOW
#define DIRECT_WINDOW (1 << 20)
#endif
/* a member cut by the buffer with at least this much still to read is read straight into its
 * bytes object; less is left to the buffer's next fill (a syscall for a few bytes costs more
 * than copying them twice) */
#ifndef DIRECT_MIN
#define DIRECT_MIN (16 << 10)
#endif

/* scan_members(buf, pos, base, end[, limit[, view[, pax[, layout[, fd, fpos, fstop[, min]]]]]])
 *   -> (members, pos), or with fd: (members, pos, end, base, fpos, taken)
 * members: list of (name, data, offset) for consecutive plain members; stops at the first header
 * that is not a canonical '0' member fully inside buf, or whose checksum does not match, or
 * (with limit) at the first header that starts at or after limit. buf may be any buffer (a
 * bytearray, an mmap): each member's data is copied once, into its bytes object; or, with view
 * (a memoryview of buf; None: copy), it is view[start:stop], no copy: the slice holds the
 * export of buf, so buf stays alive (and an mmap stays mapped) as long as any slice does.
 * With pax true, a member whose pax extended header holds only records that leave its reading
 * unchanged (mtime, atime, ctime, uid...; a path, which names it), or whose GNU long name header
 * names it, is read too, offset at that header (as Python tarfile and webdataset write every member, and GNU tar --format=posix);
 * with layout (a list), each such member's (first header offset, data offset, size, False) is
 * appended to it, as the Python path reports a member it reads itself.
 * With fd (a file buf's bytes were read from; buf[end] is file offset fpos, the input stops at
 * fstop; buf a writable bytearray): a plain member that buf cuts with at least min bytes still
 * to come is read from the file straight into its bytes object (pread), buf refilled from the
 * next header on (REFILL bytes) and the scan goes on, up to about a batch's worth of bytes;
 * returned: buf's new end and base (stream offset of buf[0]), the file offset after it, and
 * the bytes read from the file past buf's end (when the next header lies past fstop: pos is
 * then past end by the member's padding, as the Python buffer skips it). */
/* view[start:stop] (a memoryview sharing view's export: no copy) */
static PyObject *
member_view(PyObject *view, Py_ssize_t start, Py_ssize_t stop)
{
    PyObject *a = PyLong_FromSsize_t(start);
    PyObject *b = PyLong_FromSsize_t(stop);
    PyObject *slice = (a != NULL && b != NULL) ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    if (slice == NULL)
        return NULL;
    PyObject *out = PyObject_GetItem(view, slice);
    Py_DECREF(slice);
    return out;
}

/* ask for a header block's eight cache lines (a hint: nothing happens where it is not mapped) */
static inline void
prefetch_block(const unsigned char *h)
{
#if defined(__GNUC__) || defined(__clang__)
    for (int k = 0; k < BLOCK; k += 64)
        __builtin_prefetch(h + k, 0, 3);
#else
    (void)h;
#endif
}

#ifdef HAVE_PREAD
/* the data of a member whose header is in the buffer and whose data runs past it: the
 * ``have`` bytes in the buffer, then ``need`` bytes read from file descriptor ``fd`` at
 * ``fpos`` straight into the bytes object (one copy from the page cache, no page faults on a
 * map of the file), without the GIL; with ``tail`` (tail_len > 0), what follows the member in
 * the file is read into it by the same call (preadv): *tail_got says how much (0 where the
 * call came short). NULL with OSError set when the file ends early. */
PyObject *
read_rest(const unsigned char *have_at, Py_ssize_t have, int fd, long long fpos, long long need,
          char *tail, Py_ssize_t tail_len, Py_ssize_t *tail_got)
{
    PyObject *data = PyBytes_FromStringAndSize(NULL, have + (Py_ssize_t)need);
    if (data == NULL)
        return NULL;
    char *dst = PyBytes_AS_STRING(data);
    memcpy(dst, have_at, (size_t)have); /* first: have_at may lie in tail */
    dst += have;
    long long done = 0;
    int err = 0;
    *tail_got = 0;
    Py_BEGIN_ALLOW_THREADS
    if (tail_len > 0) {
        struct iovec iov[2] = {{dst, (size_t)need}, {tail, (size_t)tail_len}};
        ssize_t got;
        do {
            got = preadv(fd, iov, 2, (off_t)fpos);
        } while (got < 0 && errno == EINTR);
        if (got < 0)
            err = errno;
        else if (got >= need) {
            done = need;
            *tail_got = (Py_ssize_t)(got - need);
        } else
            done = got;
    }
    while (!err && done < need) {
        ssize_t got = pread(fd, dst + done, (size_t)(need - done), (off_t)(fpos + done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (got == 0) {
            err = -1;
            break;
        }
        done += got;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        Py_DECREF(data);
        if (err > 0) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            PyErr_Format(PyExc_OSError, "the file ended %lld bytes into a read of %lld (it was "
                         "truncated while being read)", done, need);
        }
        return NULL;
    }
    return data;
}
#endif

PyObject *
scan_members(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, n, limit = PY_SSIZE_T_MAX;
    long long base;
    PyObject *slices = Py_None; /* a memoryview of buf: members are slices of it */
    int pax = 0;
    PyObject *layout = Py_None; /* a list: (first, data_at, size, False) of each pax member */
    int fd = -1;                /* the file buf's bytes come from: read the rest of a member */
    long long fpos = 0, fstop = 0; /* the file's offset at buf[n], where its input stops */
    long long direct_min = DIRECT_MIN; /* read straight into a member: at least this much */
    if (!PyArg_ParseTuple(args, "y*nLn|nOpOiLLL", &view, &pos, &base, &n, &limit, &slices, &pax,
                          &layout, &fd, &fpos, &fstop, &direct_min))
        return NULL;
    long long taken = 0; /* bytes read from fd past buf[n] (and not into buf) */
    long long copied = 0; /* member bytes read into their objects by this call */
    const long long window = DIRECT_WINDOW; /* at most about this much a batch */
    /* a refill after a member read straight into its bytes: the next sample's headers and small
     * members; the next large member, cut by it, is read straight into its bytes too (a larger
     * refill would copy more of it twice: into the buffer, then out) */
    const Py_ssize_t refill = view.len < REFILL ? view.len : REFILL;
    /* the bytes between two members read straight in (the headers and small members of a
     * sample: 1.5 KB for a class and a header): the next refill asks for that much and
     * REFILL_SLACK more, not REFILL, so that less of the next large member goes through the
     * buffer (two copies). -1: none seen yet in this call */
    long long gap = -1, last_end = -1;
    if (layout != Py_None && !PyList_Check(layout)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "scan_members: layout must be a list or None");
        return NULL;
    }
    if (slices != Py_None && !PyMemoryView_Check(slices)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "scan_members: view must be a memoryview or None");
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)view.buf;
    if (n > view.len || n < 0)
        n = view.len;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    while (n - pos >= BLOCK && pos < limit) {
        const unsigned char *h = buf + pos;
        long long size;
        ptrdiff_t at = 0; /* the member's own header: h + at (after a pax header) */
        const unsigned char *path = NULL;
        ptrdiff_t pathlen = 0;
        if (!tar_plain_header(h, &size) || size > n - pos - BLOCK) {
#ifdef HAVE_PREAD
            long long whole;
            if (fd >= 0 && slices == Py_None && tar_plain_header(h, &whole) &&
                whole - (n - pos - BLOCK) >= direct_min && whole - (n - pos - BLOCK) <= fstop - fpos) {
                /* a plain member cut by the buffer's end: the rest read from the file into its
                 * bytes object; then the buffer is done with (pos past n: its padding) */
                Py_ssize_t have = n - pos - BLOCK;
                long long need = whole - have;
                PyObject *name = PyUnicode_DecodeUTF8((const char *)h,
                                                      (Py_ssize_t)tar_name_len(h),
                                                      "surrogateescape");
                if (name == NULL)
                    goto fail;
                long long pad = tar_padded(whole) - whole;
                long long next = fpos + need + pad; /* the file offset of the next header */
                int refilling = !view.readonly && next < fstop;
                Py_ssize_t tail_len = 0, tail_got = 0;
                long long hoff = base + pos; /* this member's header, in the stream */
                if (last_end >= 0 && hoff >= last_end)
                    gap = hoff + BLOCK - last_end;
                last_end = hoff + BLOCK + tar_padded(whole);
                if (refilling) { /* the padding and the next headers, by the same call */
                    Py_ssize_t want = refill;
                    if (gap >= 0 && gap + REFILL_SLACK < refill)
                        want = (Py_ssize_t)((gap + REFILL_SLACK + BLOCK - 1) / BLOCK * BLOCK);
                    tail_len = (Py_ssize_t)pad + want;
                    if (tail_len > view.len)
                        tail_len = view.len;
                    if (tail_len > fstop - (fpos + need))
                        tail_len = (Py_ssize_t)(fstop - (fpos + need));
                }
                PyObject *data = read_rest(h + BLOCK, have, fd, fpos, need, (char *)view.buf,
                                           tail_len, &tail_got);
                PyObject *t = data == NULL ? NULL : Py_BuildValue("(NNL)", name, data, base + pos);
                if (data == NULL)
                    Py_DECREF(name);
                if (t == NULL)
                    goto fail;
                int rc = PyList_Append(out, t);
                Py_DECREF(t);
                if (rc < 0)
                    goto fail;
                if (refilling) {
                    if (tail_got == 0) { /* the call came short: refill on its own */
                        ssize_t got;
                        Py_BEGIN_ALLOW_THREADS
                        do {
                            got = pread(fd, (char *)view.buf, (size_t)tail_len,
                                        (off_t)(fpos + need));
                        } while (got < 0 && errno == EINTR);
                        Py_END_ALLOW_THREADS
                        if (got < 0) {
                            PyErr_SetFromErrno(PyExc_OSError);
                            goto fail;
                        }
                        tail_got = (Py_ssize_t)got;
                    }
                    /* buf[0] is now the byte after the member's data (its padding first) */
                    base += pos + BLOCK + whole;
                    fpos += need + tail_got;
                    pos = (Py_ssize_t)pad;
                    n = tail_got;
                    copied += whole;
                    limit = PY_SSIZE_T_MAX;
                    if (copied >= window)
                        break; /* a batch's worth: the next call goes on from the refill */
                    continue;
                }
                taken += need;
                fpos += need;
                pos += BLOCK + (Py_ssize_t)tar_padded(whole) - (Py_ssize_t)need;
                break;
            }
#endif
            if (!pax || !tar_pax_member(h, n - pos, &at, &size, &path, &pathlen))
                break; /* the Python path decides (and raises) */
        }
        /* the next header's lines asked for now: they arrive while this member is copied out
         * (its first touch was a cache miss, and a TLB miss, per member) */
        Py_ssize_t next = pos + at + BLOCK + (Py_ssize_t)tar_padded(size);
        if (next <= n - BLOCK)
            prefetch_block(buf + next);
        PyObject *name;
        if (path != NULL) {
            name = PyUnicode_DecodeUTF8((const char *)path, pathlen, "surrogateescape");
        } else {
            name = PyUnicode_DecodeUTF8((const char *)h + at, (Py_ssize_t)tar_name_len(h + at),
                                        "surrogateescape");
        }
        if (name == NULL)
            goto fail;
        PyObject *data;
        if (slices == Py_None)
            data = PyBytes_FromStringAndSize((const char *)h + at + BLOCK, (Py_ssize_t)size);
        else
            data = member_view(slices, pos + at + BLOCK, pos + at + BLOCK + (Py_ssize_t)size);
        if (data == NULL) {
            Py_DECREF(name);
            goto fail;
        }
        PyObject *off = PyLong_FromLongLong(base + pos);
        if (off == NULL) {
            Py_DECREF(name);
            Py_DECREF(data);
            goto fail;
        }
        PyObject *t = PyTuple_Pack(3, name, data, off);
        Py_DECREF(name);
        Py_DECREF(data);
        Py_DECREF(off);
        if (t == NULL)
            goto fail;
        int rc = PyList_Append(out, t);
        Py_DECREF(t);
        if (rc < 0)
            goto fail;
        if (at && layout != Py_None) { /* where its data lies (the reader's layout channel) */
            PyObject *entry = Py_BuildValue("(LLLO)", base + pos, base + pos + at + BLOCK, size,
                                            Py_False);
            rc = entry == NULL ? -1 : PyList_Append(layout, entry);
            Py_XDECREF(entry);
            if (rc < 0)
                goto fail;
        }
        pos += at + BLOCK + tar_padded(size);
    }
    PyBuffer_Release(&view);
    if (fd >= 0) /* the buffer may have been refilled: its end, base and the file offset */
        return Py_BuildValue("(NnnLLL)", out, pos, n, base, fpos, taken);
    return Py_BuildValue("(Nn)", out, pos);
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return NULL;
}
