/* What the files of the _speedups module share: includes, the module's interned strings, its
 * functions and types (for the method table in speedups_module.c), and the Recorder's rows and
 * helpers that the writer's and the indexer's loops use. Internal: every name here is hidden
 * (not exported from the shared object). */
#ifndef TARSHARDS_SPEEDUPS_H
#define TARSHARDS_SPEEDUPS_H

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
#include <stdint.h>

#include "names.h"
#include "tar.h"

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* interned "__key__", "__url__", "__offset__"; 512 zero bytes; the int 32 (speedups_module.c) */
extern PyObject *KEY_STR, *URL_STR, *OFFSET_STR, *ZERO_PAD, *THIRTY_TWO;

/* the module's functions and types */
PyObject *scan_members(PyObject *self, PyObject *args);                        /* members.c */
PyObject *group_members(PyObject *self, PyObject *args);                       /* group.c */
PyObject *ustar_parts(PyObject *self, PyObject *args);                         /* write.c */
PyObject *sample_members_c(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *members_size(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *tar_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *index_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* recorder.c */
PyObject *index_members(PyObject *self, PyObject *args);                       /* index_scan.c */
PyObject *header_ok(PyObject *self, PyObject *args);                           /* random_access.c */
PyObject *read_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
extern PyTypeObject RecorderType;    /* recorder.c */
extern PyTypeObject ShuffleRunType;  /* shuffle.c */
extern PyTypeObject CountedType;     /* counted.c */
extern PyTypeObject WriteBehindType; /* writebehind.c */
#ifdef HAVE_PREAD
extern PyTypeObject SampleScanType; /* samples.c */
/* members.c: the rest of a member read from fd into a new bytes object (and what follows it
 * into tail, by the same call) */
PyObject *read_rest(const unsigned char *have_at, Py_ssize_t have, int fd, long long fpos,
                    long long need, char *tail, Py_ssize_t tail_len, Py_ssize_t *tail_got);
#endif

/* recorder.c: the member checksum (a callable, or a C function in a capsule) */
typedef uint64_t (*checksum64_fn)(const void *, size_t);
int call_checksum_mem(PyObject *fn, const unsigned char *p, Py_ssize_t n, uint64_t *out);
long long ext_code(PyObject *codes, PyObject *ext);
long long member_header_size(PyObject *name, Py_ssize_t size, PyObject *header_size);
int key_base_ok(PyObject *key, Py_ssize_t klen);

static inline void
put_u64(unsigned char *p, uint64_t v)
{
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}


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

int recorder_record_seq(RecorderObject *r, PyObject *seq, PyObject *key);
int recorder_record_plain(RecorderObject *r, PyObject *seq, PyObject *key);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
