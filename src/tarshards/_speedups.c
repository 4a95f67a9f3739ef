/* Optional C accelerator for the two per-member hot loops of tarshards.
 *
 * scan_members: the fast path of tario.iter_tar_batches (plain ustar members lying wholly in a
 *               buffer, header checksums verified exactly).
 * group_members: the loop of format.group_samples over one batch of members (samples carry
 *                __key__, __url__ and __offset__, the offset of their first member).
 * ShuffleRun: the sample loop of source.ShuffleCore.run, its picks prefetched.
 * WriteBehind: buffers written to a file and synced by a thread of its own (an index's save).
 *
 * Both stop (rather than raise) at anything unusual, and the pure Python code takes over from
 * there, so the Python implementation stays the single definition of behaviour and of errors.
 * tests/test_speedups.py checks that both paths agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <errno.h>
#if !defined(_WIN32)
#define HAVE_PREAD 1 /* scan_members reads members straight into their bytes (fd arguments) */
#include <sys/uio.h>
#include <unistd.h>
#endif

#include "_names.h"

#define BLOCK 512
#ifndef REFILL
#define REFILL (8 << 10)
#endif
/* a member cut by the buffer with at least this much still to read is read straight into its
 * bytes object; less is left to the buffer's next fill (a syscall for a few bytes costs more
 * than copying them twice) */
/* a scan reading members straight into their bytes returns after about this many bytes of
 * them (a batch: the consumer frees it before the next, whose bytes then reuse that memory,
 * still in cache, as reader.COPY_WINDOW does for a map) */
#ifndef DIRECT_WINDOW
#define DIRECT_WINDOW (256 << 10)
#endif
#ifndef DIRECT_MIN
#define DIRECT_MIN (16 << 10)
#endif

static int
parse_octal(const unsigned char *p, Py_ssize_t len, long long *out)
{
    /* canonical field: optional leading spaces, octal digits to the end of the field */
    Py_ssize_t i = 0;
    long long v = 0;
    while (i < len && p[i] == ' ')
        i++;
    if (i == len)
        return 0;
    for (; i < len; i++) {
        unsigned char c = p[i];
        if (c < '0' || c > '7')
            return 0;
        v = v * 8 + (c - '0');
    }
    *out = v;
    return 1;
}

#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* the sum of a header's 512 bytes, its checksum field counted as spaces (psadbw with SSE2) */
static unsigned long
header_sum(const unsigned char *h)
{
    unsigned long sum = 0;
#if defined(__SSE2__)
    __m128i acc = _mm_setzero_si128(), zero = _mm_setzero_si128();
    for (int i = 0; i < BLOCK; i += 16)
        acc = _mm_add_epi64(acc, _mm_sad_epu8(_mm_loadu_si128((const __m128i *)(h + i)), zero));
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, acc);
    sum = (unsigned long)(lanes[0] + lanes[1]);
#else
    for (int i = 0; i < BLOCK; i++)
        sum += h[i];
#endif
    for (int i = 148; i < 156; i++)
        sum -= h[i];
    return sum + 8 * ' ';
}

/* a canonical ustar header of a regular file ('0', no prefix or link name, octal size, checksum
 * right): its size in *size, else 0 (the Python path decides what the header is, and raises) */
static int
canonical_header(const unsigned char *h, long long *size)
{
    long long stored;
    if (h[135] != 0 || !parse_octal(h + 124, 11, size))
        return 0;
    if (h[154] != 0 && h[154] != ' ')
        return 0;
    if (!parse_octal(h + 148, 6, &stored))
        return 0;
    return (long long)header_sum(h) == stored;
}

static int
plain_header(const unsigned char *h, long long *size)
{
    if (h[156] != '0' || h[345] != 0)
        return 0;
    return canonical_header(h, size);
}

#define MAX_META (1 << 20) /* tario.headers._MAX_META */

/* The records of a pax header's payload that leave the member's reading as the plain path reads
 * it: every record well formed (as tario.headers._parse_pax accepts it), no "size" and no
 * "GNU.sparse." key (those change what the data is), no empty or '/'-ended "path" (those change
 * which name wins: the Python path decides). *path: the value of the last "path" record, or
 * NULL. Returns 0 at anything else (the Python path reads the member, and raises). */
static int
harmless_pax(const unsigned char *p, Py_ssize_t n, const unsigned char **path, Py_ssize_t *pathlen)
{
    Py_ssize_t pos = 0;
    *path = NULL;
    *pathlen = 0;
    while (pos < n && p[pos] != 0) {
        Py_ssize_t sp = pos, length = 0;
        while (sp < n && sp < pos + 21 && p[sp] != ' ')
            sp++;
        if (sp >= n || sp == pos || sp >= pos + 21 || p[sp] != ' ')
            return 0;
        for (Py_ssize_t i = pos; i < sp; i++) {
            if (p[i] < '0' || p[i] > '9' || length > (PY_SSIZE_T_MAX - 9) / 10)
                return 0;
            length = length * 10 + (p[i] - '0');
        }
        if (length > n - pos || pos + length <= sp + 1 || p[pos + length - 1] != '\n')
            return 0;
        const unsigned char *key = p + sp + 1;
        Py_ssize_t reclen = pos + length - 1 - (sp + 1); /* the record without its newline */
        const unsigned char *eq = memchr(key, '=', (size_t)reclen);
        if (eq == NULL)
            return 0;
        Py_ssize_t keylen = eq - key, vallen = reclen - keylen - 1;
        if ((keylen == 4 && memcmp(key, "size", 4) == 0) ||
            (keylen >= 10 && memcmp(key, "GNU.sparse", 10) == 0))
            return 0;
        if (keylen == 4 && memcmp(key, "path", 4) == 0) {
            if (vallen == 0 || eq[vallen] == '/')
                return 0;
            *path = eq + 1;
            *pathlen = vallen;
        }
        pos += length;
    }
    return 1;
}

/* A pax extended header ('x') at h whose records are harmless (see harmless_pax), or a GNU long
 * name ('L', not empty), followed by a plain member header, all inside the first `room` bytes from h: the member header's distance
 * from h in *at, its data size in *size, the pax path (or NULL) in *path and *pathlen. */
static int
pax_member(const unsigned char *h, Py_ssize_t room, Py_ssize_t *at, long long *size,
           const unsigned char **path, Py_ssize_t *pathlen)
{
    long long psize;
    if ((h[156] != 'x' && h[156] != 'L') || !canonical_header(h, &psize) || psize > MAX_META)
        return 0;
    Py_ssize_t member = BLOCK + (Py_ssize_t)((psize + 511) & ~(long long)511);
    if (member > room - BLOCK)
        return 0;
    if (h[156] == 'L') {
        /* a GNU long name: its blocks up to the first NUL name the member, past its declared
         * size where the name runs on (as GNU tar and tarfile read it) */
        Py_ssize_t blocks = member - BLOCK;
        const unsigned char *nul = memchr(h + BLOCK, 0, (size_t)blocks);
        *path = h + BLOCK;
        *pathlen = nul ? (Py_ssize_t)(nul - (h + BLOCK)) : blocks;
        if (*pathlen == 0)
            return 0;
    } else if (!harmless_pax(h + BLOCK, (Py_ssize_t)psize, path, pathlen))
        return 0;
    if (!plain_header(h + member, size) || *size > room - member - BLOCK)
        return 0;
    *at = member;
    return 1;
}

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
static PyObject *
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

static PyObject *
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
        Py_ssize_t at = 0; /* the member's own header: h + at (after a pax header) */
        const unsigned char *path = NULL;
        Py_ssize_t pathlen = 0;
        if (!plain_header(h, &size) || size > n - pos - BLOCK) {
#ifdef HAVE_PREAD
            long long whole;
            if (fd >= 0 && slices == Py_None && plain_header(h, &whole) &&
                whole - (n - pos - BLOCK) >= direct_min && whole - (n - pos - BLOCK) <= fstop - fpos) {
                /* a plain member cut by the buffer's end: the rest read from the file into its
                 * bytes object; then the buffer is done with (pos past n: its padding) */
                Py_ssize_t have = n - pos - BLOCK;
                long long need = whole - have;
                const unsigned char *nul = memchr(h, 0, 100);
                PyObject *name = PyUnicode_DecodeUTF8((const char *)h,
                                                      nul ? (Py_ssize_t)(nul - h) : 100,
                                                      "surrogateescape");
                if (name == NULL)
                    goto fail;
                long long pad = ((whole + 511) & ~(long long)511) - whole;
                long long next = fpos + need + pad; /* the file offset of the next header */
                int refilling = !view.readonly && next < fstop;
                Py_ssize_t tail_len = 0, tail_got = 0;
                if (refilling) { /* the padding and the next headers, by the same call */
                    tail_len = (Py_ssize_t)pad + refill;
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
                pos += BLOCK + (Py_ssize_t)((whole + 511) & ~(long long)511) - (Py_ssize_t)need;
                break;
            }
#endif
            if (!pax || !pax_member(h, n - pos, &at, &size, &path, &pathlen))
                break; /* the Python path decides (and raises) */
        }
        /* the next header's lines asked for now: they arrive while this member is copied out
         * (its first touch was a cache miss, and a TLB miss, per member) */
        Py_ssize_t next = pos + at + BLOCK + (Py_ssize_t)((size + 511) & ~(long long)511);
        if (next <= n - BLOCK)
            prefetch_block(buf + next);
        PyObject *name;
        if (path != NULL) {
            name = PyUnicode_DecodeUTF8((const char *)path, pathlen, "surrogateescape");
        } else {
            const unsigned char *nul = memchr(h + at, 0, 100);
            Py_ssize_t namelen = nul ? (Py_ssize_t)(nul - (h + at)) : 100;
            name = PyUnicode_DecodeUTF8((const char *)h + at, namelen, "surrogateescape");
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
        pos += at + BLOCK + ((size + 511) & ~(long long)511);
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

static PyObject *KEY_STR, *URL_STR, *OFFSET_STR;

/* group_members(batch, start, url, last_dot, sample, key) -> (samples, sample, key, stop)
 * Groups batch[start:] like format.group_samples. stop is the index of a member that repeats an
 * extension of the current sample (not consumed), or -1. */
/* the extensions group_members saw last (ASCII, lower-case: as a sample's key uses them), so
 * that a member whose extension is one of them takes that str (its hash known) instead of a
 * new one (a substring, a case check and a hash per member); the GIL guards them */
#define EXT_CACHE 8
static PyObject *ext_cache[EXT_CACHE];
static int ext_cache_next;

static PyObject *
cached_ext(const char *p, Py_ssize_t n)
{
    for (int i = 0; i < EXT_CACHE; i++) {
        PyObject *e = ext_cache[i];
        if (e != NULL && PyUnicode_GET_LENGTH(e) == n &&
            memcmp(PyUnicode_DATA(e), p, (size_t)n) == 0) {
            Py_INCREF(e);
            return e;
        }
    }
    return NULL;
}

static void
remember_ext(PyObject *e)
{
    if (!PyUnicode_IS_ASCII(e) || PyUnicode_GET_LENGTH(e) > 32)
        return;
    Py_INCREF(e);
    Py_XSETREF(ext_cache[ext_cache_next], e);
    ext_cache_next = (ext_cache_next + 1) % EXT_CACHE;
}

static PyObject *
group_members(PyObject *self, PyObject *args)
{
    PyObject *batch, *url, *sample, *key;
    Py_ssize_t start;
    int last_dot;
    if (!PyArg_ParseTuple(args, "O!nOpOO", &PyList_Type, &batch, &start, &url, &last_dot,
                          &sample, &key))
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_INCREF(sample);
    Py_INCREF(key);
    Py_ssize_t stop = -1;
    Py_ssize_t count = PyList_GET_SIZE(batch);
    for (Py_ssize_t i = start; i < count; i++) {
        PyObject *member = PyList_GET_ITEM(batch, i);
        if (!PyTuple_Check(member) || PyTuple_GET_SIZE(member) != 3) {
            PyErr_SetString(PyExc_TypeError, "members are (name, data, offset) tuples");
            goto fail;
        }
        PyObject *nameobj = PyTuple_GET_ITEM(member, 0);
        PyObject *data = PyTuple_GET_ITEM(member, 1);
        PyObject *offset = PyTuple_GET_ITEM(member, 2);
        if (!PyUnicode_Check(nameobj)) {
            PyErr_SetString(PyExc_TypeError, "member names are str");
            goto fail;
        }
        Py_ssize_t len = PyUnicode_GET_LENGTH(nameobj);
        Py_ssize_t s0 = 0;
        if (len >= 2 && PyUnicode_READ_CHAR(nameobj, 0) == '.' &&
            PyUnicode_READ_CHAR(nameobj, 1) == '/')
            s0 = 2;
        Py_ssize_t slash = PyUnicode_FindChar(nameobj, '/', s0, len, -1);
        if (slash == -2)
            goto fail;
        Py_ssize_t b = slash >= 0 ? slash + 1 : s0;
        if (len - b >= 2 && PyUnicode_READ_CHAR(nameobj, b) == '_' &&
            PyUnicode_READ_CHAR(nameobj, b + 1) == '_')
            continue;
        Py_ssize_t dot = PyUnicode_FindChar(nameobj, '.', b, len, last_dot ? -1 : 1);
        if (dot == -2)
            goto fail;
        if (dot <= b || dot == len - 1)
            continue;
        /* the key: compared with the sample's in place where both are ASCII (the usual
         * case: no substring for the members after a sample's first) */
        int ascii = PyUnicode_IS_ASCII(nameobj);
        const char *nd = ascii ? (const char *)PyUnicode_DATA(nameobj) : NULL;
        int same = 0;
        PyObject *k = NULL;
        if (ascii && key != Py_None && PyUnicode_IS_ASCII(key))
            same = PyUnicode_GET_LENGTH(key) == dot - s0 &&
                   memcmp(PyUnicode_DATA(key), nd + s0, (size_t)(dot - s0)) == 0;
        else if (key != Py_None) {
            k = PyUnicode_Substring(nameobj, s0, dot);
            if (k == NULL)
                goto fail;
            same = PyUnicode_Compare(k, key) == 0;
            if (PyErr_Occurred()) {
                Py_DECREF(k);
                goto fail;
            }
        }
        if (!same && k == NULL) {
            k = PyUnicode_Substring(nameobj, s0, dot);
            if (k == NULL)
                goto fail;
        }
        PyObject *ext = ascii ? cached_ext(nd + dot + 1, len - dot - 1) : NULL;
        if (ext == NULL) {
            ext = PyUnicode_Substring(nameobj, dot + 1, len);
            if (ext == NULL) {
                Py_XDECREF(k);
                goto fail;
            }
            /* lower-case the extension unless it already is */
            int needs_lower = 0;
            Py_ssize_t elen = PyUnicode_GET_LENGTH(ext);
            for (Py_ssize_t j = 0; j < elen; j++) {
                Py_UCS4 c = PyUnicode_READ_CHAR(ext, j);
                if (c >= 128 || (c >= 'A' && c <= 'Z')) {
                    needs_lower = 1;
                    break;
                }
            }
            if (needs_lower) {
                PyObject *low = PyObject_CallMethod(ext, "lower", NULL);
                Py_DECREF(ext);
                if (low == NULL) {
                    Py_XDECREF(k);
                    goto fail;
                }
                ext = low;
            }
            else
                remember_ext(ext);
        }
        if (same) {
            int has = PyDict_Contains(sample, ext);
            if (has != 0) {
                Py_XDECREF(k);
                Py_DECREF(ext);
                if (has < 0)
                    goto fail;
                stop = i;
                break;
            }
            int rc = PyDict_SetItem(sample, ext, data);
            Py_XDECREF(k);
            Py_DECREF(ext);
            if (rc < 0)
                goto fail;
        } else {
            if (sample != Py_None && PyList_Append(out, sample) < 0) {
                Py_DECREF(k);
                Py_DECREF(ext);
                goto fail;
            }
            PyObject *d = PyDict_New();
            if (d == NULL || PyDict_SetItem(d, KEY_STR, k) < 0 ||
                PyDict_SetItem(d, URL_STR, url) < 0 || PyDict_SetItem(d, OFFSET_STR, offset) < 0 ||
                PyDict_SetItem(d, ext, data) < 0) {
                Py_XDECREF(d);
                Py_DECREF(k);
                Py_DECREF(ext);
                goto fail;
            }
            Py_DECREF(ext);
            Py_DECREF(sample);
            sample = d;
            Py_DECREF(key);
            key = k;
        }
    }
    return Py_BuildValue("(NNNn)", out, sample, key, stop);
fail:
    Py_DECREF(out);
    Py_DECREF(sample);
    Py_DECREF(key);
    return NULL;
}

/* ustar_parts(parts, members, start, mtime, mode) -> (nbytes, stop)
 * Appends header, data and padding of members[start:] to the list parts, as
 * tario.TarMemberWriter.add_all does for plain members. Stops (stop = index) at a member the
 * Python path must write (name not ASCII, longer than 100 bytes or holding a NUL, size >= 8**11,
 * data not bytes); stop = -1 when all were written. An mtime or mode that does not fit its
 * header field stops at the first member, so the Python path raises (never a truncated field). */
static PyObject *ZERO_PAD;

/* `digits` octal digits of v, zero-padded, then a NUL (what snprintf(dst, digits + 1, "%0*llo")
 * writes for a v that fits). Not snprintf: once a library in the process registers a printf
 * extension (numpy's OpenBLAS brings libquadmath, which does), glibc formats every call through
 * its slow positional path, which costs several times its usual one (perf: ~6 % of a writer's
 * CPU time went to it). */
static inline void
put_octal(char *dst, int digits, unsigned long long v)
{
    dst[digits] = 0;
    for (int i = digits - 1; i >= 0; i--) {
        dst[i] = (char)('0' + (v & 7));
        v >>= 3;
    }
}

/* the fields every plain member's ustar block shares (mode, owner, mtime, type, magic) */
static void
ustar_template(char head[BLOCK], long long mode, long long mtime)
{
    memset(head, 0, BLOCK);
    put_octal(head + 100, 7, (unsigned long long)mode);
    memcpy(head + 108, "0000000", 8);
    memcpy(head + 116, "0000000", 8);
    put_octal(head + 136, 11, (unsigned long long)mtime);
    head[156] = '0';
    memcpy(head + 257, "ustar", 6);
    memcpy(head + 263, "00", 2);
    memcpy(head + 329, "0000000", 8);
    memcpy(head + 337, "0000000", 8);
}

/* one plain member's block into h: the template, its name (ASCII, at most 100 characters), its
 * size and the checksum */
static void
ustar_header(char *h, const char head[BLOCK], PyObject *name, Py_ssize_t size)
{
    memcpy(h, head, BLOCK);
    memcpy(h, PyUnicode_DATA(name), (size_t)PyUnicode_GET_LENGTH(name));
    put_octal(h + 124, 11, (unsigned long long)size);
    put_octal(h + 148, 6, header_sum((const unsigned char *)h));
    h[154] = 0;
    h[155] = ' ';
}

static PyObject *
ustar_parts(PyObject *self, PyObject *args)
{
    PyObject *parts, *members;
    Py_ssize_t start;
    long long mtime, mode;
    if (!PyArg_ParseTuple(args, "O!OnLL", &PyList_Type, &parts, &members, &start, &mtime, &mode))
        return NULL;
    PyObject *seq = PySequence_Fast(members, "members must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    long long total = 0;
    Py_ssize_t stop = -1;
    if (mtime < 0 || mtime >= (1LL << 33) || mode < 0 || mode >= (1LL << 21)) {
        Py_DECREF(seq);
        return Py_BuildValue("(Ln)", 0LL, start < count ? start : (Py_ssize_t)-1);
    }
    char head[BLOCK];
    ustar_template(head, mode, mtime);
    for (Py_ssize_t i = start; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2) {
            stop = i;
            break;
        }
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        PyObject *data = PyTuple_GET_ITEM(m, 1);
        if (!PyUnicode_Check(name) || !PyUnicode_IS_ASCII(name) ||
            PyUnicode_GET_LENGTH(name) > 100 || !PyBytes_CheckExact(data) ||
            memchr(PyUnicode_DATA(name), 0, PyUnicode_GET_LENGTH(name)) != NULL) {
            stop = i;
            break;
        }
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        if ((long long)size >= (1LL << 33)) {
            stop = i;
            break;
        }
        char h[BLOCK];
        ustar_header(h, head, name, size);
        PyObject *hdr = PyBytes_FromStringAndSize(h, BLOCK);
        if (hdr == NULL)
            goto fail;
        int rc = PyList_Append(parts, hdr);
        Py_DECREF(hdr);
        if (rc < 0 || PyList_Append(parts, data) < 0)
            goto fail;
        Py_ssize_t pad = (BLOCK - size % BLOCK) % BLOCK;
        if (pad) {
            PyObject *p = PyBytes_FromStringAndSize(PyBytes_AS_STRING(ZERO_PAD), pad);
            if (p == NULL)
                goto fail;
            rc = PyList_Append(parts, p);
            Py_DECREF(p);
            if (rc < 0)
                goto fail;
        }
        total += BLOCK + size + pad;
    }
    Py_DECREF(seq);
    return Py_BuildValue("(Ln)", total, stop);
fail:
    Py_DECREF(seq);
    return NULL;
}


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
typedef uint64_t (*checksum64_fn)(const void *, size_t);
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
static int
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

static inline void
put_u64(unsigned char *p, uint64_t v)
{
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

/* the code of extension ext in the dict codes (a new one numbered len(codes)); -1 on error */
static long long
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
static long long
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

/* the rows are laid out as they lie in memory: little-endian hosts only (elsewhere this module
 * does not build, and the pure Python writer records) */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "Recorder's rows assume a little-endian host"
#endif
typedef struct {
    int64_t sample, ext, offset, data, size;
    uint64_t checksum;
} MemberRow;

typedef struct {
    int64_t offset, end, flags;
} SampleRow;

#define HINTS 16

typedef struct {
    PyObject_HEAD
    PyObject *keys, *codes, *checksum, *header_size;
    /* bytearrays, grown by doubling and holding `used` bytes (their getters trim them) */
    PyObject *members, *samples, *key_blob, *key_offsets;
    Py_ssize_t m_used, s_used, kb_used, ko_used;
    int kind; /* 0: a callable, 1: checksum64 */
    checksum64_fn fn;
    int64_t offset;
    PyObject *hint[HINTS]; /* the extension of the i-th member of the last write (a dict key) */
    int64_t hint_code[HINTS];
} RecorderObject;

static PyTypeObject RecorderType;

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
static int
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
static int
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
static int
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

static PyTypeObject RecorderType;

/* index_columns(samples, members) -> 9 bytes: the index's columns cut out of the packed rows
 * (Recorder's and the C scanner's layout: per sample three int64, per member six), little-endian
 * as the index file stores them: the samples' tar offsets, ends (int64) and flags (uint8); the
 * members' sample numbers (uint32), extension codes (uint16), header offsets, data offsets,
 * sizes (int64) and checksums (uint64). Narrower fields keep their low bytes (numpy's astype). */
static PyObject *
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

/* sample_members(sample, encoder, encode_value) -> list or None: writer.sample_members' list of
 * (KEY.EXT, bytes) members, sorted by extension, in one call, for the samples it takes: a dict
 * whose __key__ is a non-empty str with a base name that neither holds a dot nor starts with "__",
 * whose fields are str extensions (fields starting with "__" and None values left out), none
 * empty or holding '/'. Values: bytes as they are; str as UTF-8 (not for a .gz extension, whose
 * text the encoder compresses); with encoder, anything else through encode_value(value, ext),
 * called once, what it returns taken as it is (its errors raised); without, a bytearray or
 * memoryview copied into bytes. None where the
 * Python function decides (and raises): anything else, or no member at all. */
static int
gz_extension(PyObject *ext)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(ext);
    if (n < 2)
        return 0;
    Py_UCS4 a = PyUnicode_READ_CHAR(ext, n - 2), b = PyUnicode_READ_CHAR(ext, n - 1);
    if ((a != 'g' && a != 'G') || (b != 'z' && b != 'Z'))
        return 0;
    return n == 2 || PyUnicode_READ_CHAR(ext, n - 3) == '.';
}

static PyObject *
sample_members_c(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sample_members(sample, encoder, encode_value)");
        return NULL;
    }
    PyObject *sample = args[0], *encode = args[2];
    int encoder = PyObject_IsTrue(args[1]);
    if (encoder < 0)
        return NULL;
    if (!PyDict_CheckExact(sample))
        Py_RETURN_NONE;
    PyObject *key = PyDict_GetItemString(sample, "__key__"); /* borrowed */
    if (key == NULL || !PyUnicode_CheckExact(key) || PyUnicode_GET_LENGTH(key) == 0)
        Py_RETURN_NONE;
    Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
    int ok = key_base_ok(key, klen);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_NONE;
    PyObject *exts = PyDict_Keys(sample);
    if (exts == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(exts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(exts, i))) {
            Py_DECREF(exts);
            Py_RETURN_NONE;
        }
    if (PyList_Sort(exts) < 0) {
        Py_DECREF(exts);
        return NULL;
    }
    /* "KEY.", made now: key is borrowed from the sample, which an encoder may change */
    PyObject *prefix = NULL, *dot_s = PyUnicode_FromOrdinal('.');
    if (dot_s != NULL) {
        prefix = PyUnicode_Concat(key, dot_s);
        Py_DECREF(dot_s);
    }
    PyObject *out = prefix == NULL ? NULL : PyList_New(0);
    if (out == NULL) {
        Py_XDECREF(prefix);
        Py_DECREF(exts);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ext = PyList_GET_ITEM(exts, i);
        Py_ssize_t elen = PyUnicode_GET_LENGTH(ext);
        if (elen >= 2 && PyUnicode_READ_CHAR(ext, 0) == '_' && PyUnicode_READ_CHAR(ext, 1) == '_')
            continue;
        PyObject *value = PyDict_GetItemWithError(sample, ext); /* borrowed */
        if (value == NULL) {
            if (PyErr_Occurred())
                goto error;
            goto python; /* changed behind our back */
        }
        if (value == Py_None)
            continue;
        if (elen == 0 || PyUnicode_FindChar(ext, '/', 0, elen, 1) != -1)
            goto python;
        PyObject *data;
        if (PyBytes_CheckExact(value)) {
            Py_INCREF(value);
            data = value;
        }
        else if (PyUnicode_CheckExact(value) && !(encoder && gz_extension(ext))) {
            data = PyUnicode_AsUTF8String(value);
            if (data == NULL) { /* lone surrogates: the Python function raises */
                PyErr_Clear();
                goto python;
            }
        }
        else if (encoder) {
            Py_INCREF(value); /* held through the call (the encoder may change the sample) */
            PyObject *argv[2] = {value, ext};
            data = PyObject_Vectorcall(encode, argv, 2, NULL); /* taken as it is, as there */
            Py_DECREF(value);
            if (data == NULL)
                goto error;
        }
        else if (PyByteArray_CheckExact(value) || PyMemoryView_Check(value)) {
            data = PyBytes_FromObject(value);
            if (data == NULL)
                goto error;
        }
        else
            goto python;
        PyObject *name = PyUnicode_Concat(prefix, ext);
        if (name == NULL) {
            Py_DECREF(data);
            goto error;
        }
        PyObject *member = PyTuple_New(2);
        if (member == NULL) {
            Py_DECREF(name);
            Py_DECREF(data);
            goto error;
        }
        PyTuple_SET_ITEM(member, 0, name);
        PyTuple_SET_ITEM(member, 1, data);
        int rc = PyList_Append(out, member);
        Py_DECREF(member);
        if (rc < 0)
            goto error;
    }
    if (PyList_GET_SIZE(out) == 0)
        goto python;
    Py_DECREF(prefix);
    Py_DECREF(exts);
    return out;
error:
    Py_XDECREF(prefix);
    Py_DECREF(exts);
    Py_DECREF(out);
    return NULL;
python:
    Py_XDECREF(prefix);
    Py_DECREF(exts);
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* members_size(members, header_size) -> int: the bytes a write of (name, data) members takes in
 * the tar stream (headers, data, padding to 512), as ShardWriter needs it before the write to
 * decide on a new shard: 512 for a member whose name and size fit a ustar header as they are,
 * header_size(name, size) (a pax header, the Python rule) for any other; data anything with a
 * length. */
static PyObject *
members_size(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "members_size(members, header_size)");
        return NULL;
    }
    /* a tuple of its own: the callbacks (header_size, a value's __len__) cannot change it */
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL)
        return NULL;
    long long total = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(m, 0))) {
            PyErr_SetString(PyExc_TypeError, "members are (name: str, data) pairs");
            goto error;
        }
        PyObject *name = PyTuple_GET_ITEM(m, 0), *data = PyTuple_GET_ITEM(m, 1);
        Py_ssize_t size = PyBytes_CheckExact(data) ? PyBytes_GET_SIZE(data) : PyObject_Size(data);
        if (size < 0)
            goto error;
        long long hsize = member_header_size(name, size, args[1]);
        if (hsize < 0)
            goto error;
        total += hsize + (long long)size + ((-(long long)size) & (BLOCK - 1));
    }
    Py_DECREF(seq);
    return PyLong_FromLongLong(total);
error:
    Py_DECREF(seq);
    return NULL;
}

/* tar_sample(members, mtime, mode, max_size[, recorder, key]) -> bytes or None
 * One write of (name, bytes) members as its tar bytes, built in one buffer: each member's ustar
 * header (as ustar_parts makes it), data and padding, back to back (one allocation and one copy
 * of the data, no header or padding objects, no join). With a Recorder, the write is recorded
 * there too (Recorder.record). None, having written and recorded nothing, where the sample needs
 * more than this: a member that is not a plain ustar member (a pax header, not bytes), more than
 * max_size bytes in all, mtime or mode out of range, or a write the recorder does not take. */
static PyObject *
tar_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "tar_sample(members, mtime, mode, max_size[, recorder, key])");
        return NULL;
    }
    PyObject *recorder = NULL, *key = NULL;
    long long mtime = PyLong_AsLongLong(args[1]), mode = PyLong_AsLongLong(args[2]);
    Py_ssize_t max_size = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (nargs == 6) {
        if (!PyObject_TypeCheck(args[4], &RecorderType)) {
            PyErr_SetString(PyExc_TypeError, "tar_sample: recorder must be a Recorder");
            return NULL;
        }
        recorder = args[4];
        key = args[5];
        if (key == Py_None) /* a write without a key: the general path records it */
            Py_RETURN_NONE;
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "tar_sample: the key must be a str");
            return NULL;
        }
    }
    if (mtime < 0 || mtime >= (1LL << 33) || mode < 0 || mode >= (1LL << 21))
        Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(args[0], "members must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2)
            goto none;
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        PyObject *data = PyTuple_GET_ITEM(m, 1);
        if (!PyUnicode_Check(name) || !PyUnicode_IS_ASCII(name) ||
            PyUnicode_GET_LENGTH(name) > 100 || !PyBytes_CheckExact(data) ||
            memchr(PyUnicode_DATA(name), 0, PyUnicode_GET_LENGTH(name)) != NULL)
            goto none;
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        total += BLOCK + size + (BLOCK - size % BLOCK) % BLOCK;
        if (total > max_size)
            goto none;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        goto error;
    if (recorder != NULL) {
        int rc = PyUnicode_IS_ASCII(key)
                     ? recorder_record_plain((RecorderObject *)recorder, seq, key)
                     : recorder_record_seq((RecorderObject *)recorder, seq, key);
        if (rc <= 0) {
            Py_DECREF(out);
            if (rc < 0)
                goto error;
            goto none;
        }
    }
    char head[BLOCK];
    ustar_template(head, mode, mtime);
    char *o = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *name = PyTuple_GET_ITEM(m, 0);
        PyObject *data = PyTuple_GET_ITEM(m, 1);
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        ustar_header(o, head, name, size);
        o += BLOCK;
        memcpy(o, PyBytes_AS_STRING(data), (size_t)size);
        o += size;
        Py_ssize_t pad = (BLOCK - size % BLOCK) % BLOCK;
        memset(o, 0, (size_t)pad);
        o += pad;
    }
    Py_DECREF(seq);
    return out;
none:
    Py_DECREF(seq);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    return NULL;
}

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.Recorder",
    .tp_basicsize = sizeof(RecorderObject),
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Recorder(keys, codes, checksum, header_size): the writer's index rows.",
    .tp_methods = recorder_methods,
    .tp_getset = recorder_getset,
    .tp_new = recorder_new,
};

/* index_members(buf, pos, base, end, last_dot, codes, keys, samples, members, key, checksum)
 *     -> (pos, key)
 * index.IndexBuilder.add for a run of plain ustar members lying wholly in buf[:end] (the
 * conditions of scan_members, and ASCII names), without copying their data: appends to the
 * bytearray samples (tar offset, end, flags: three i64 per new sample), to the list keys (its
 * key), to the bytearray members (sample, extension code, header offset, data offset, size,
 * checksum(data): six 64-bit values per member; data: a read-only memoryview over buf, released
 * after the call) and extends the current sample's end. key is the current sample's key (str or
 * None). Stops at anything else; Python takes over there. */
static PyObject *
index_members(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, n;
    long long base;
    int last_dot;
    PyObject *codes, *keys, *samples, *members, *key, *checksum;
    if (!PyArg_ParseTuple(args, "y*nLnpO!O!O!O!OO", &view, &pos, &base, &n, &last_dot,
                          &PyDict_Type, &codes, &PyList_Type, &keys, &PyByteArray_Type,
                          &samples, &PyByteArray_Type, &members, &key, &checksum))
        return NULL;
    if (!(PyCallable_Check(checksum) || PyCapsule_CheckExact(checksum))) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "index_members: checksum must be callable or a capsule");
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)view.buf;
    if (n > view.len || n < 0)
        n = view.len;
    Py_INCREF(key);
    const char *kdata = NULL; /* the current key's bytes, when it is ASCII */
    Py_ssize_t kl = -1;
    if (key != Py_None && PyUnicode_Check(key) && PyUnicode_IS_ASCII(key)) {
        kdata = (const char *)PyUnicode_DATA(key);
        kl = PyUnicode_GET_LENGTH(key);
    }
    PyObject *last_ext = NULL; /* a one-entry cache of (extension bytes -> code) */
    long long last_code = -1;
    while (n - pos >= BLOCK) {
        const unsigned char *h = buf + pos;
        long long size;
        if (!plain_header(h, &size))
            break;
        if (((size + 511) & ~(long long)511) > n - pos - BLOCK)
            break; /* data and padding wholly in buf: pos never passes end */
        const unsigned char *nul = memchr(h, 0, 100);
        Py_ssize_t len = nul ? (Py_ssize_t)(nul - h) : 100;
        int ascii = 1;
        for (Py_ssize_t i = 0; i < len; i++)
            if (h[i] >= 0x80) {
                ascii = 0;
                break;
            }
        if (!ascii)
            break;
        long long hoff = base + pos, doff = hoff + BLOCK;
        long long endoff = doff + ((size + 511) & ~(long long)511);
        pos += BLOCK + (Py_ssize_t)((size + 511) & ~(long long)511);
        size_t skip, split; /* the reader's naming rules (IndexBuilder.add, _names.h) */
        if (!name_split(h, (size_t)len, last_dot, &skip, &split))
            continue;
        const char *name = (const char *)h + skip;
        int dot_slash = skip != 0;
        len -= (Py_ssize_t)skip;
        Py_ssize_t dot = (Py_ssize_t)split;
        uint64_t sum; /* before any record changes: a failing call leaves them whole */
        if (call_checksum_mem(checksum, h + BLOCK, (Py_ssize_t)size, &sum) < 0)
            goto fail;
        if (!(kdata != NULL && kl == dot && memcmp(kdata, name, (size_t)dot) == 0)) {
            PyObject *k = PyUnicode_DecodeASCII(name, dot, NULL);
            if (k == NULL)
                goto fail;
            if (PyList_Append(keys, k) < 0) {
                Py_DECREF(k);
                goto fail;
            }
            Py_DECREF(key);
            key = k;
            kdata = (const char *)PyUnicode_DATA(k);
            kl = dot;
            Py_ssize_t old = PyByteArray_GET_SIZE(samples);
            if (PyByteArray_Resize(samples, old + 24) < 0)
                goto fail;
            unsigned char *r = (unsigned char *)PyByteArray_AS_STRING(samples) + old;
            put_u64(r, (uint64_t)hoff);
            put_u64(r + 8, (uint64_t)endoff);
            put_u64(r + 16, dot_slash ? 1 : 0);
        } else {
            Py_ssize_t sz = PyByteArray_GET_SIZE(samples);
            if (sz < 24) { /* a key without its sample record: not ours to fix */
                PyErr_SetString(PyExc_ValueError, "index_members: key given without samples");
                goto fail;
            }
            put_u64((unsigned char *)PyByteArray_AS_STRING(samples) + sz - 16, (uint64_t)endoff);
        }
        Py_ssize_t elen = len - dot - 1;
        long long code;
        if (last_ext != NULL && PyBytes_GET_SIZE(last_ext) == elen &&
            memcmp(PyBytes_AS_STRING(last_ext), name + dot + 1, (size_t)elen) == 0) {
            code = last_code;
        } else {
            PyObject *ext = PyUnicode_DecodeASCII(name + dot + 1, elen, NULL);
            if (ext == NULL)
                goto fail;
            code = ext_code(codes, ext);
            Py_DECREF(ext);
            if (code < 0)
                goto fail;
            Py_XDECREF(last_ext);
            last_ext = PyBytes_FromStringAndSize(name + dot + 1, elen);
            if (last_ext == NULL)
                goto fail;
            last_code = code;
        }
        Py_ssize_t nsamples = PyList_GET_SIZE(keys);
        Py_ssize_t old = PyByteArray_GET_SIZE(members);
        if (PyByteArray_Resize(members, old + 48) < 0)
            goto fail;
        unsigned char *r = (unsigned char *)PyByteArray_AS_STRING(members) + old;
        put_u64(r, (uint64_t)(nsamples - 1));
        put_u64(r + 8, (uint64_t)code);
        put_u64(r + 16, (uint64_t)hoff);
        put_u64(r + 24, (uint64_t)doff);
        put_u64(r + 32, (uint64_t)size);
        put_u64(r + 40, sum);
    }
    Py_XDECREF(last_ext);
    PyBuffer_Release(&view);
    return Py_BuildValue("(nN)", pos, key);
fail:
    Py_XDECREF(last_ext);
    Py_DECREF(key);
    PyBuffer_Release(&view);
    return NULL;
}

/* header_ok(data, at, size) -> bool
 * Whether data[at:at + 512] is a tar header whose checksum (unsigned, six octal digits as the
 * usual writers put them) is right and which, when it is a regular member's ('0' or NUL),
 * stores size (canonical 11 octal digits). False means only "not shown here": the Python check
 * (indexed._check_header) decides and words the error. */
static PyObject *
header_ok(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t at;
    long long size;
    if (!PyArg_ParseTuple(args, "y*nL", &view, &at, &size))
        return NULL;
    int ok = 0;
    if (at >= 0 && view.len - at >= BLOCK) {
        const unsigned char *h = (const unsigned char *)view.buf + at;
        long long stored, got;
        if (parse_octal(h + 148, 6, &stored) && (long long)header_sum(h) == stored) {
            if (h[156] != '0' && h[156] != 0)
                ok = 1;
            else
                ok = h[135] == 0 && parse_octal(h + 124, 11, &got) && got == size;
        }
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* the header_ok test on a block */
static int
block_ok(const unsigned char *h, long long size)
{
    long long stored, got;
    if (!parse_octal(h + 148, 6, &stored) || (long long)header_sum(h) != stored)
        return 0;
    if (h[156] != '0' && h[156] != 0)
        return 1;
    return h[135] == 0 && parse_octal(h + 124, 11, &got) && got == size;
}

/* read_sample(fd, start, end, base, first, data_offsets, sizes, exts, m0, m1, key, url)
 *   -> dict or None
 * IndexedDataset's ds[i] for a local plain shard: bytes start:end of the file (one pread, no
 * GIL), the first member's header (at tar offset first) checked as header_ok does, and the
 * sample dict {"__key__": key, "__url__": url, "__offset__": base, exts[m]: its bytes} of
 * members m0:m1, whose data lie at data_offsets[m] (tar offsets; the sample's first header is at
 * base, file offset start) with sizes[m]. None where the read comes short or the header does not
 * fit (the Python path then says why). */
static PyObject *
read_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12 || !PyList_Check(args[5]) || !PyList_Check(args[6]) ||
        !PyList_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError,
                        "read_sample(fd, start, end, base, first, data_offsets: list, sizes: "
                        "list, exts: list, m0, m1, key, url)");
        return NULL;
    }
    int fd = PyLong_AsLong(args[0]);
    long long start = PyLong_AsLongLong(args[1]), end = PyLong_AsLongLong(args[2]);
    long long base = PyLong_AsLongLong(args[3]), first = PyLong_AsLongLong(args[4]);
    Py_ssize_t m0 = PyLong_AsSsize_t(args[8]), m1 = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *doffs = args[5], *sizes = args[6], *exts = args[7];
    if (end < start || m0 < 0 || m1 < m0 || m1 > PyList_GET_SIZE(doffs) ||
        m1 > PyList_GET_SIZE(sizes) || m1 > PyList_GET_SIZE(exts))
        Py_RETURN_NONE;
    size_t n = (size_t)(end - start);
    char stack[16384];
    char *buf = n <= sizeof stack ? stack : (char *)PyMem_Malloc(n ? n : 1);
    if (buf == NULL)
        return PyErr_NoMemory();
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    got = pread(fd, buf, n, (off_t)start);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    long long at = first - base;
    if (got != (ssize_t)n || at < 0 || at + BLOCK > (long long)n)
        goto none;
    PyObject *size0 = PyList_GET_ITEM(sizes, m0 < m1 ? m0 : 0);
    if (m0 < m1 && !block_ok((const unsigned char *)buf + at, PyLong_AsLongLong(size0)))
        goto none;
    out = PyDict_New();
    if (out == NULL)
        goto done;
    PyObject *offset = PyLong_FromLongLong(base);
    if (offset == NULL || PyDict_SetItem(out, KEY_STR, args[10]) < 0 ||
        PyDict_SetItem(out, URL_STR, args[11]) < 0 || PyDict_SetItem(out, OFFSET_STR, offset) < 0) {
        Py_XDECREF(offset);
        goto fail;
    }
    Py_DECREF(offset);
    for (Py_ssize_t m = m0; m < m1; m++) {
        long long a = PyLong_AsLongLong(PyList_GET_ITEM(doffs, m)) - base;
        long long size = PyLong_AsLongLong(PyList_GET_ITEM(sizes, m));
        if (PyErr_Occurred())
            goto fail;
        if (a < 0 || size < 0 || a + size > (long long)n) { /* an index of another file */
            Py_CLEAR(out);
            goto none;
        }
        PyObject *v = PyBytes_FromStringAndSize(buf + a, (Py_ssize_t)size);
        if (v == NULL)
            goto fail;
        int rc = PyDict_SetItem(out, PyList_GET_ITEM(exts, m), v);
        Py_DECREF(v);
        if (rc < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
    goto done;
none:
    out = Py_None;
    Py_INCREF(out);
done:
    if (buf != stack)
        PyMem_Free(buf);
    return out;
}

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

static PyObject *THIRTY_TWO;

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

static PyTypeObject ShuffleRunType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.ShuffleRun",
    .tp_basicsize = sizeof(ShuffleRun),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ShuffleRun(buf, it, getrandbits, shuffle, bufsize, initial, emitted, tail): "
              "ShuffleCore.run's sample loop (see the comment above it in _speedups.c).",
    .tp_new = ShuffleRun_new,
    .tp_dealloc = (destructor)ShuffleRun_dealloc,
    .tp_traverse = (traverseproc)ShuffleRun_traverse,
    .tp_clear = (inquiry)ShuffleRun_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)ShuffleRun_next,
    .tp_members = ShuffleRun_members,
    .tp_methods = ShuffleRun_methods,
};

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

static PyTypeObject WriteBehindType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._speedups.WriteBehind",
    .tp_basicsize = sizeof(WriteBehindObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "WriteBehind(fd, offset, parts, path): parts written to fd (pwrite from offset on) "
              "and synced by a thread of its own; wait() for it.",
    .tp_new = WriteBehind_new,
    .tp_dealloc = (destructor)WriteBehind_dealloc,
    .tp_methods = WriteBehind_methods,
};

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
        PyType_Ready(&RecorderType) < 0 || PyType_Ready(&WriteBehindType) < 0)
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
#endif
    return m;
}
