/* The tar read-back of _xxh3: Background, a thread that reads a shard back while it is written
 * (its xxh3_64, its members' checksums, its index rows). */
#include "xxh3.h"

/* Background(path, members=True): a shard's hashes worked out by a thread that reads the shard
 * back while it is written.
 *
 * Recording the index while writing hashes every byte twice (each member alone, and the whole
 * file); on the writing thread that cost 15-25 % of ShardWriter's rate on small samples. Handing
 * the written buffers to another thread costs as much again (each buffer's cache lines travel
 * between the cores once the allocator reuses them: measured, about 1 us per 6.6 KB sample, three
 * times hashing it in place). Here the writing thread does nothing per sample: this object's
 * pthread reads the file back (pread from the page cache into a buffer of its own, no GIL), feeds
 * the file's streaming xxh3_64 and, with members=True, follows the tar stream the writer emits
 * (ustar headers; pax headers, whose "size" record it honours) to hash each member's data
 * (xxh3_64 one-shot where the member lies in one read, streaming otherwise: the same values), in
 * file order. The writer's temporary file is append-only, so what the thread reads below the end
 * of the file is final. It reads what is there, then sleeps (or until finish()) and reads on: 200 us
 * after a read that found bytes, twice as long after each that found none, up to 2 ms. (A fixed
 * 1 ms left up to a millisecond of the writer's bytes to read at finish(): 290 us of waiting a
 * 5,000-sample shard of 4.5 KB samples on /dev/shm, 120 us with the short first sleep; the
 * doubling keeps an idle writer's thread from waking 10,000 times a second.)
 *
 *   finish(size)  wait until the thread has read size bytes (the whole file), then
 *                 (file hexdigest, member checksums as little-endian u64 bytes); OSError if the
 *                 file cannot be read or is shorter, ValueError if its tar stream is not one the
 *                 writer makes
 *   close()       stop the thread and close the file (idempotent; finish() does it too)
 *
 * index=True: the thread also makes the shard's index rows (bg_index), so that the writing thread
 * records nothing per sample either (measured on 4.5 KB samples: the writer's own record of the
 * rows, in C, cost 300-480 ns a sample on the writing thread, mostly the rows' fresh memory:
 * page faults and cache misses beside the kernel's copies). finish(size) then returns
 * (file hexdigest, sample_offsets, sample_ends, sample_flags, key_offsets, member_sample,
 * member_ext, member_offsets, member_data_offsets, member_sizes, member_checksums, key_blob,
 * extensions): the index file's columns as index._ARRAYS has them (Owned buffers, no copy),
 * the extensions (str) in code order. The stream must be the writer's (pax 'x' headers and
 * regular members), else ValueError.
 *
 * Not across fork: in a child the thread does not exist; its calls raise RuntimeError and the
 * object is freed without joining. */
#define BG_CHUNK (256 << 10)
#define BG_POLL_MIN_NS 200000L
#define BG_POLL_MAX_NS 2000000L

enum { ST_HDR, ST_PAX, ST_DATA, ST_SKIP, ST_END };

/* a growing byte buffer of the thread's (malloc'd: no GIL needed) */
typedef struct {
    unsigned char *p;
    size_t len, cap;
} Grow;

/* room for n more bytes at g->p + g->len (doubling); -1 when out of memory */
static int
grow_reserve(Grow *g, size_t n)
{
    if (g->len + n <= g->cap)
        return 0;
    size_t cap = g->cap ? 2 * g->cap : (size_t)64 << 10;
    while (cap < g->len + n)
        cap *= 2;
    unsigned char *more = (unsigned char *)realloc(g->p, cap);
    if (more == NULL)
        return -1;
    g->p = more;
    g->cap = cap;
    return 0;
}

static int
grow_add(Grow *g, const void *src, size_t n)
{
    if (grow_reserve(g, n) < 0)
        return -1;
    memcpy(g->p + g->len, src, n);
    g->len += n;
    return 0;
}

static int
grow_i64(Grow *g, int64_t v)
{
    /* little-endian hosts: the index file's order (Background(index=True) refuses others) */
    return grow_add(g, &v, 8);
}

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started; /* the thread runs (the mutex and condition exist) */
    int fd;
    int members; /* follow the tar stream and hash members */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    /* under mu */
    int stop, done;
    long long target; /* the file's final size once finish() tells it, else -1 */
    int err;          /* errno of a failed read */
    char bad[160];    /* why the tar stream is not the writer's */
    /* the thread's own (read by the producer only once done) */
    unsigned long long offset;
    XXH3_state_t *file;
    XXH3_state_t *member;
    int state;
    int streaming; /* the current member's data is in the streaming state */
    unsigned char hdr[512];
    size_t fill;
    unsigned long long need; /* bytes left in the member's data, its padding or a pax payload */
    unsigned long long pad;
    char *pax;
    size_t pax_len, pax_cap;
    int pax_keep;
    long long size_override; /* a pax "size" for the next member, or -1 */
    uint64_t *sums;
    size_t nsums, capsums;
    pid_t pid;
    /* index=True: the index's rows, made here as the reader names the members (see bg_index) */
    int index;
    int have_start;               /* start holds the current member's first header */
    unsigned long long start;     /* that header's offset (its pax header's, where it has one) */
    long long path_at;            /* its pax "path" record: at pax + path_at, path_len bytes */
    size_t path_len;              /*   (path_at -1: none) */
    long long row;                /* its member row, whose checksum its data gives (-1: none) */
    /* the index's columns (index._ARRAYS; tar_offsets are sample_offsets) */
    Grow s_off, s_end, s_flags, m_sample, m_ext, m_off, m_data, m_size, m_sum;
    Grow keys, key_offsets, exts, ext_offsets;
    long long last_ext;           /* the code the last member's extension had (-1: none) */
} BackgroundObject;


static void
bg_bad(BackgroundObject *b, const char *why)
{
    if (!b->bad[0])
        snprintf(b->bad, sizeof b->bad, "%s (at byte %llu of the file)", why, b->offset);
    b->state = ST_END;
}

static int
bg_sum(BackgroundObject *b, uint64_t v)
{
    if (b->index) { /* into the member's row (none for a member the reader skips) */
        if (b->row >= 0)
            memcpy(b->m_sum.p + 8 * (size_t)b->row, &v, 8);
        b->row = -1;
        return 0;
    }
    if (b->nsums == b->capsums) {
        size_t cap = b->capsums ? 2 * b->capsums : 4096;
        uint64_t *more = (uint64_t *)realloc(b->sums, cap * sizeof *more);
        if (more == NULL) {
            bg_bad(b, "out of memory for the member checksums");
            return -1;
        }
        b->sums = more;
        b->capsums = cap;
    }
    b->sums[b->nsums++] = v;
    return 0;
}

/* the "size" record of a pax payload, or -1; its "path" record's value at p + *path_at,
 * *path_len bytes (*path_at -1: none) */
static long long
bg_pax_size(const char *p, size_t n, long long *path_at, size_t *path_len)
{
    const unsigned char *u = (const unsigned char *)p, *key, *val;
    ptrdiff_t pos = 0, keylen, vallen;
    long long found = -1;
    *path_at = -1;
    while (tar_pax_record(u, (ptrdiff_t)n, TAR_ANY, &pos, &key, &keylen, &val, &vallen) == 1) {
        if (keylen == 4 && memcmp(key, "size", 4) == 0 && vallen > 0) {
            unsigned long long v = 0;
            for (ptrdiff_t k = 0; k < vallen && val[k] >= '0' && val[k] <= '9'; k++)
                v = v * 10 + (unsigned long long)(val[k] - '0');
            found = (long long)v;
        }
        else if (keylen == 4 && memcmp(key, "path", 4) == 0) {
            *path_at = (long long)(val - u);
            *path_len = (size_t)(vallen - (vallen > 0 && val[vallen - 1] == '\n'));
        }
    }
    return found;
}

/* index=True: the regular member whose header (the ustar block h) was just read, its data at
 * b->offset: rows as index.IndexBuilder.add makes them from the name the reader gives it (the pax
 * "path" record, else the ustar prefix and name), its bytes as they are (the key's bytes are
 * the index's; the reader's surrogateescape decoding gives them back). A name the reader skips
 * (no extension, or a base name starting with "__") gets no row. 0, or -1 out of memory. */
static int
bg_index(BackgroundObject *b, const unsigned char *h, long long size)
{
    const unsigned char *name;
    size_t len;
    unsigned char joined[256];
    size_t plen = b->path_len;
    if (b->path_at >= 0) /* the pax path, its trailing slashes dropped (if anything is left) */
        while (plen > 0 && b->pax[b->path_at + (long long)plen - 1] == '/')
            plen--;
    if (b->path_at >= 0 && plen > 0) {
        name = (const unsigned char *)b->pax + b->path_at;
        len = plen;
    }
    else
        len = tar_full_name(h, joined, &name);
    b->path_at = -1;
    long long hoff = (long long)b->start, doff = (long long)b->offset;
    b->have_start = 0;
    b->row = -1;
    size_t skip, dot;
    if (!name_split(name, len, 0, &skip, &dot)) /* the writer's indexes: last_dot=False */
        return 0;
    int dot_slash = skip != 0;
    name += skip;
    len -= skip;
    int64_t end = doff + tar_padded(size);
    size_t nkeys = b->key_offsets.len / 8 - 1;
    const int64_t *ko = (const int64_t *)b->key_offsets.p;
    if (nkeys > 0 && (size_t)(ko[nkeys] - ko[nkeys - 1]) == dot &&
        memcmp(b->keys.p + ko[nkeys - 1], name, dot) == 0) {
        memcpy(b->s_end.p + b->s_end.len - 8, &end, 8); /* the sample's end */
    }
    else {
        uint8_t flags = dot_slash ? 1 : 0;
        if (nkeys >= UINT32_MAX) {
            bg_bad(b, "more than 2**32 - 1 samples in one shard");
            return 0;
        }
        if (grow_add(&b->keys, name, dot) < 0 || grow_i64(&b->key_offsets, (int64_t)b->keys.len) < 0 ||
            grow_i64(&b->s_off, hoff) < 0 || grow_i64(&b->s_end, end) < 0 ||
            grow_add(&b->s_flags, &flags, 1) < 0)
            return -1;
        nkeys++;
    }
    /* the extension's code: the last member's, else the table's (a few entries), else new */
    const unsigned char *ext = name + dot + 1;
    size_t elen = len - dot - 1;
    size_t nexts = b->ext_offsets.len / 8 - 1;
    const int64_t *eo = (const int64_t *)b->ext_offsets.p;
    long long code = -1;
    long long try = b->last_ext + 1 < (long long)nexts ? b->last_ext + 1 : 0; /* the next, first */
    for (size_t k = 0; k < nexts; k++, try = try + 1 < (long long)nexts ? try + 1 : 0)
        if ((size_t)(eo[try + 1] - eo[try]) == elen && memcmp(b->exts.p + eo[try], ext, elen) == 0) {
            code = try;
            break;
        }
    if (code < 0) {
        if (nexts > UINT16_MAX) {
            bg_bad(b, "more than 65536 extensions in one shard");
            return 0;
        }
        if (grow_add(&b->exts, ext, elen) < 0 || grow_i64(&b->ext_offsets, (int64_t)b->exts.len) < 0)
            return -1;
        code = (long long)nexts;
    }
    b->last_ext = code;
    uint32_t sample = (uint32_t)(nkeys - 1);
    uint16_t ecode = (uint16_t)code;
    uint64_t zero = 0;
    if (grow_add(&b->m_sample, &sample, 4) < 0 || grow_add(&b->m_ext, &ecode, 2) < 0 ||
        grow_i64(&b->m_off, hoff) < 0 || grow_i64(&b->m_data, doff) < 0 ||
        grow_i64(&b->m_size, size) < 0 || grow_add(&b->m_sum, &zero, 8) < 0)
        return -1;
    b->row = (long long)(b->m_size.len / 8) - 1;
    return 0;
}

static void
bg_header(BackgroundObject *b)
{
    const unsigned char *h = b->hdr;
    if (b->index && !b->have_start) {
        b->start = b->offset - 512;
        b->have_start = 1;
    }
    if (tar_zero_block(h)) { /* the end-of-archive marker: what follows is only hashed in */
        b->state = ST_END;
        return;
    }
    long long size;
    if (!tar_number(h + TAR_SIZE, 12, TAR_ANY, &size)) {
        bg_bad(b, "a header's size field does not read");
        return;
    }
    char type = (char)h[TAR_TYPE];
    if (b->index && (type == 'g' || type == 'L' || type == 'K' ||
                     (type == 'x' && b->start != b->offset - 512))) {
        bg_bad(b, "a header the writer does not make before a member"); /* its names: ours */
        return;
    }
    if (type == 'x' || type == 'g') {
        if (size > (1 << 24)) {
            bg_bad(b, "a pax header over 16 MiB");
            return;
        }
        b->pax_keep = type == 'x';
        if (b->pax_keep && (size_t)size > b->pax_cap) {
            char *more = (char *)realloc(b->pax, (size_t)size);
            if (more == NULL) {
                bg_bad(b, "out of memory for a pax header");
                return;
            }
            b->pax = more;
            b->pax_cap = (size_t)size;
        }
        b->pax_len = 0;
        b->pad = (unsigned long long)(-size & 511);
        if (size) {
            b->need = (unsigned long long)size;
            b->state = ST_PAX;
        }
        else {
            b->need = b->pad;
            b->state = b->need ? ST_SKIP : ST_HDR;
        }
        return;
    }
    if (type == 'L' || type == 'K') { /* GNU long names (the writer does not make them) */
        b->need = (unsigned long long)size + (unsigned long long)(-size & 511);
        b->state = b->need ? ST_SKIP : ST_HDR;
        return;
    }
    if (b->size_override >= 0) {
        size = b->size_override;
        b->size_override = -1;
    }
    if (type != '0' && type != '\0' && type != '7') {
        bg_bad(b, "a member that is not a regular file");
        return;
    }
    if (b->index && bg_index(b, h, size) < 0) {
        bg_bad(b, "out of memory for the index");
        return;
    }
    b->need = (unsigned long long)size;
    b->pad = (unsigned long long)(-size & 511);
    if (size == 0) {
        if (bg_sum(b, (uint64_t)XXH3_64bits_dispatch("", 0)) == 0)
            b->state = ST_HDR;
        return;
    }
    b->state = ST_DATA;
    b->streaming = 0;
}

/* feed n bytes of the file (at b->offset) to the member parser */
static void
bg_parse(BackgroundObject *b, const unsigned char *p, size_t n)
{
    while (n) {
        size_t take;
        switch (b->state) {
        case ST_HDR:
            take = 512 - b->fill < n ? 512 - b->fill : n;
            memcpy(b->hdr + b->fill, p, take);
            b->fill += take;
            b->offset += take;
            p += take;
            n -= take;
            if (b->fill == 512) {
                b->fill = 0;
                bg_header(b);
            }
            continue;
        case ST_PAX:
            take = b->need < n ? (size_t)b->need : n;
            if (b->pax_keep) {
                memcpy(b->pax + b->pax_len, p, take);
                b->pax_len += take;
            }
            b->need -= take;
            if (!b->need) {
                if (b->pax_keep) {
                    long long sz = bg_pax_size(b->pax, b->pax_len, &b->path_at, &b->path_len);
                    if (sz >= 0)
                        b->size_override = sz;
                }
                b->need = b->pad;
                b->state = b->need ? ST_SKIP : ST_HDR;
            }
            break;
        case ST_DATA:
            take = b->need < n ? (size_t)b->need : n;
            if (!b->streaming && take == b->need) { /* the whole member in this read: one shot */
                if (bg_sum(b, (uint64_t)XXH3_64bits_dispatch(p, take)) < 0)
                    return;
            }
            else {
                if (!b->streaming) {
                    XXH3_64bits_reset(b->member);
                    b->streaming = 1;
                }
                XXH3_64bits_update_dispatch(b->member, p, take);
                if (take == b->need) {
                    b->streaming = 0;
                    if (bg_sum(b, (uint64_t)XXH3_64bits_digest(b->member)) < 0)
                        return;
                }
            }
            b->need -= take;
            if (!b->need) {
                b->need = b->pad;
                b->state = b->need ? ST_SKIP : ST_HDR;
            }
            break;
        case ST_SKIP:
            take = b->need < n ? (size_t)b->need : n;
            b->need -= take;
            if (!b->need)
                b->state = ST_HDR;
            break;
        default: /* ST_END */
            b->offset += n;
            return;
        }
        b->offset += take;
        p += take;
        n -= take;
    }
}

static void
bg_wait_ns(BackgroundObject *b, long ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += ns;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&b->cond, &b->mu, &ts);
}

static void *
bg_main(void *arg)
{
    BackgroundObject *b = (BackgroundObject *)arg;
    unsigned char *buf = (unsigned char *)malloc(BG_CHUNK);
    unsigned long long pos = 0;
    int told = 0; /* a read came back empty after the final size was told */
    int err = buf == NULL ? ENOMEM : 0;
    long poll = BG_POLL_MIN_NS;
    while (!err) {
        ssize_t r = pread(b->fd, buf, BG_CHUNK, (off_t)pos);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (r > 0) {
            XXH3_64bits_update_dispatch(b->file, buf, (size_t)r);
            if (b->members)
                bg_parse(b, buf, (size_t)r);
            clear_upper();
            pos += (unsigned long long)r;
            poll = BG_POLL_MIN_NS;
            continue;
        }
        pthread_mutex_lock(&b->mu);
        int stop = b->stop;
        int again = !stop && b->target >= 0 && pos < (unsigned long long)b->target && !told;
        /* finish() tells the size once the file is complete: a read that came back empty
         * just before it was told is read again, once */
        told = b->target >= 0;
        if (again) {
            pthread_mutex_unlock(&b->mu);
            continue;
        }
        if (!stop && b->target >= 0 && pos >= (unsigned long long)b->target) {
            if (pos > (unsigned long long)b->target)
                snprintf(b->bad, sizeof b->bad, "the file is longer than the %lld bytes written",
                         b->target);
            b->done = 1;
            stop = 1;
            pthread_cond_broadcast(&b->cond);
        }
        else if (!stop && b->target >= 0) /* all of it flushed, yet not all of it there */
            err = EIO;
        else if (!stop) {
            bg_wait_ns(b, poll);
            poll = poll < BG_POLL_MAX_NS / 2 ? 2 * poll : BG_POLL_MAX_NS;
        }
        pthread_mutex_unlock(&b->mu);
        if (stop)
            break;
    }
    free(buf);
    pthread_mutex_lock(&b->mu);
    if (err) {
        b->err = err;
        b->done = 1;
        pthread_cond_broadcast(&b->cond);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static int
bg_check(BackgroundObject *b)
{
    if (b->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "a background hasher (a TarWriter recording its index) cannot be used "
                        "in a forked child: its thread is in the parent");
        return -1;
    }
    if (!b->started) {
        PyErr_SetString(PyExc_ValueError, "the background hasher is closed");
        return -1;
    }
    return 0;
}

static void
bg_stop(BackgroundObject *b)
{
    if (b->started) {
        b->started = 0;
        if (b->pid == getpid()) {
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&b->mu);
            b->stop = 1;
            pthread_cond_broadcast(&b->cond);
            pthread_mutex_unlock(&b->mu);
            pthread_join(b->thread, NULL);
            Py_END_ALLOW_THREADS
            pthread_mutex_destroy(&b->mu);
            pthread_cond_destroy(&b->cond);
        }
    }
    if (b->fd >= 0) {
        close(b->fd);
        b->fd = -1;
    }
}

static PyObject *
bg_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", "members", "index", NULL};
    PyObject *path;
    int members = 1, index = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|pp", kwlist, PyUnicode_FSConverter, &path,
                                     &members, &index))
        return NULL;
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    if (index) { /* the rows are the index file's little-endian values as they lie in memory */
        Py_DECREF(path);
        PyErr_SetString(PyExc_NotImplementedError, "Background(index=True): little-endian hosts");
        return NULL;
    }
#endif
    BackgroundObject *b = (BackgroundObject *)type->tp_alloc(type, 0);
    if (b == NULL) {
        Py_DECREF(path);
        return NULL;
    }
    b->fd = -1;
    b->pid = getpid();
    b->members = members || index;
    b->index = index;
    b->path_at = -1;
    b->row = -1;
    b->last_ext = -1;
    b->target = -1;
    b->size_override = -1;
    b->state = ST_HDR;
    b->file = XXH3_createState();
    b->member = XXH3_createState();
    if (b->file == NULL || b->member == NULL ||
        (index && (grow_i64(&b->key_offsets, 0) < 0 || grow_i64(&b->ext_offsets, 0) < 0))) {
        Py_DECREF(path);
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    XXH3_64bits_reset(b->file);
    int fd;
    Py_BEGIN_ALLOW_THREADS
    fd = open(PyBytes_AS_STRING(path), O_RDONLY | O_CLOEXEC);
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        Py_DECREF(path);
        Py_DECREF(b);
        return NULL;
    }
    Py_DECREF(path);
    b->fd = fd;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (pthread_mutex_init(&b->mu, NULL) != 0 || pthread_cond_init(&b->cond, &attr) != 0) {
        pthread_condattr_destroy(&attr);
        Py_DECREF(b);
        PyErr_SetString(PyExc_RuntimeError, "Background(): no mutex");
        return NULL;
    }
    pthread_condattr_destroy(&attr);
    int rc = pthread_create(&b->thread, NULL, bg_main, b);
    if (rc != 0) {
        pthread_mutex_destroy(&b->mu);
        pthread_cond_destroy(&b->cond);
        Py_DECREF(b);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    b->started = 1;
#if defined(__linux__)
    pthread_setname_np(b->thread, "tarshards-hash"); /* seen in top -H, /proc/PID/task */
#endif
    return (PyObject *)b;
}

static void
bg_dealloc(BackgroundObject *b)
{
    bg_stop(b);
    if (b->file != NULL)
        XXH3_freeState(b->file);
    if (b->member != NULL)
        XXH3_freeState(b->member);
    free(b->pax);
    free(b->sums);
    Grow *grows[] = {&b->s_off, &b->s_end, &b->s_flags, &b->m_sample, &b->m_ext, &b->m_off,
                     &b->m_data, &b->m_size, &b->m_sum};
    for (size_t i = 0; i < sizeof grows / sizeof *grows; i++)
        free(grows[i]->p);
    free(b->keys.p);
    free(b->key_offsets.p);
    free(b->exts.p);
    free(b->ext_offsets.p);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *
bg_close(BackgroundObject *b, PyObject *unused)
{
    (void)unused;
    bg_stop(b);
    Py_RETURN_NONE;
}

/* Owned: read-only bytes in memory the thread malloc'd, handed over without a copy */
typedef struct {
    PyObject_HEAD
    unsigned char *p;
    Py_ssize_t len;
} OwnedObject;

static int
owned_getbuffer(OwnedObject *o, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)o, o->p, o->len, 1, flags);
}

static void
owned_dealloc(OwnedObject *o)
{
    free(o->p);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static Py_ssize_t
owned_length(OwnedObject *o)
{
    return o->len;
}

static PyBufferProcs owned_as_buffer = {(getbufferproc)owned_getbuffer, NULL};
static PySequenceMethods owned_as_sequence = {.sq_length = (lenfunc)owned_length};

PyTypeObject OwnedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._xxh3.Owned",
    .tp_basicsize = sizeof(OwnedObject),
    .tp_dealloc = (destructor)owned_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Read-only bytes made by the background thread (the buffer protocol, len()).",
    .tp_as_buffer = &owned_as_buffer,
    .tp_as_sequence = &owned_as_sequence,
};

/* the bytes of g as an Owned (g emptied; the room it grew beyond them given back) */
static PyObject *
owned_from(Grow *g)
{
    OwnedObject *o = PyObject_New(OwnedObject, &OwnedType);
    if (o == NULL)
        return NULL;
    if (g->len && g->cap - g->len > ((size_t)64 << 10)) { /* doubling left up to half unused */
        unsigned char *fit = (unsigned char *)realloc(g->p, g->len);
        if (fit != NULL)
            g->p = fit;
    }
    o->p = g->p;
    o->len = (Py_ssize_t)g->len;
    g->p = NULL;
    g->len = g->cap = 0;
    return (PyObject *)o;
}

static PyObject *
bg_finish(BackgroundObject *b, PyObject *arg)
{
    long long size = PyLong_AsLongLong(arg);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "finish(size): size >= 0");
        return NULL;
    }
    if (bg_check(b) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&b->mu);
    b->target = size;
    pthread_cond_broadcast(&b->cond);
    while (!b->done)
        pthread_cond_wait(&b->cond, &b->mu);
    pthread_mutex_unlock(&b->mu);
    Py_END_ALLOW_THREADS
    int err = b->err;
    bg_stop(b);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (b->bad[0]) {
        PyErr_Format(PyExc_ValueError, "reading the shard back: %s", b->bad);
        return NULL;
    }
    if (b->members && (b->state == ST_DATA || b->state == ST_PAX ||
                       (b->state == ST_SKIP && b->need) || (b->state == ST_HDR && b->fill))) {
        PyErr_SetString(PyExc_ValueError, "reading the shard back: it ends inside a member");
        return NULL;
    }
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits_digest(b->file));
    if (b->index) {
        PyObject *exts = PyList_New(0);
        if (exts == NULL)
            return NULL;
        const int64_t *eo = (const int64_t *)b->ext_offsets.p;
        for (size_t k = 0; k + 1 < b->ext_offsets.len / 8; k++) {
            PyObject *e = PyUnicode_DecodeUTF8((const char *)b->exts.p + eo[k],
                                               (Py_ssize_t)(eo[k + 1] - eo[k]), "surrogateescape");
            if (e == NULL || PyList_Append(exts, e) < 0) {
                Py_XDECREF(e);
                Py_DECREF(exts);
                return NULL;
            }
            Py_DECREF(e);
        }
        return Py_BuildValue("(s#NNNNNNNNNNNN)", hex, (Py_ssize_t)16, owned_from(&b->s_off),
                             owned_from(&b->s_end), owned_from(&b->s_flags),
                             owned_from(&b->key_offsets), owned_from(&b->m_sample),
                             owned_from(&b->m_ext), owned_from(&b->m_off),
                             owned_from(&b->m_data), owned_from(&b->m_size),
                             owned_from(&b->m_sum), owned_from(&b->keys), exts);
    }
    PyObject *sums = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(b->nsums * 8));
    if (sums == NULL)
        return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(sums);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (b->nsums)
        memcpy(o, b->sums, b->nsums * 8);
#else
    for (size_t i = 0; i < b->nsums; i++)
        for (int k = 0; k < 8; k++)
            o[8 * i + k] = (unsigned char)(b->sums[i] >> (8 * k));
#endif
    return Py_BuildValue("(s#N)", hex, (Py_ssize_t)16, sums);
}

static PyMethodDef bg_methods[] = {
    {"finish", (PyCFunction)bg_finish, METH_O,
     "finish(size) -> (file hexdigest, member checksums as little-endian u64 bytes); with "
     "index=True (file hexdigest, samples, members, keys, key_offsets, extensions)."},
    {"close", (PyCFunction)bg_close, METH_NOARGS, "Stop the thread and close the file."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject BackgroundType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tarshards._xxh3.Background",
    .tp_basicsize = sizeof(BackgroundObject),
    .tp_dealloc = (destructor)bg_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Background(path, members=True): a file's xxh3_64 (and its tar members') worked "
              "out by a thread that reads it back while it is written.",
    .tp_methods = bg_methods,
    .tp_new = bg_new,
};
