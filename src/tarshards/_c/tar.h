/* The tar format for the C paths: the ONE header parser (reading side) and the ONE header builder
 * (writing side), as static inline functions that every C loop of _speedups and _xxh3 reading or
 * writing a tar header shares: the reader's member scan (members.c), the indexer's
 * (index_scan.c), random access (random_access.c), the writer (write.c) and the thread that reads
 * a shard back while it is written (readback.c). Python's tario/headers.py is the reference;
 * tests/test_speedups.py holds the C paths equal to it, and tests/test_c_sources.py checks that
 * no other C file parses a header field or a checksum of its own.
 *
 * Nothing here needs the GIL or Python objects (the read-back thread runs without them).
 *
 * Reading: a C path takes the members it is sure of and declines the rest (returns its "not
 * handled" signal; Python reads those, and raises). Two strictnesses of one number parser:
 *   tar_number(f, n, TAR_EXACT, &v)   the canonical field the writers of plain members make
 *                                      (optional leading spaces, octal digits to the field's end):
 *                                      what the fast paths take, anything else declined;
 *   tar_number(f, n, TAR_ANY, &v)      what a tar reader accepts (octal, NUL/space padded, or
 *                                      base-256): the read-back thread, which follows every
 *                                      header of the writer's stream. */
#ifndef TARSHARDS_TAR_H
#define TARSHARDS_TAR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* ---- the layout ------------------------------------------------------------------------------ */
#define BLOCK 512             /* a header, and the unit data is padded to */
#define TAR_NAME 0            /* 100 bytes, NUL-terminated unless full */
#define TAR_NAME_LEN 100
#define TAR_MODE 100          /* 8 */
#define TAR_UID 108           /* 8 */
#define TAR_GID 116           /* 8 */
#define TAR_SIZE 124          /* 12: 11 octal digits and a NUL, or base-256 */
#define TAR_MTIME 136         /* 12 */
#define TAR_CHKSUM 148        /* 8: six octal digits, NUL, space (as the usual writers put it) */
#define TAR_TYPE 156          /* '0' (or NUL) regular; 'x' pax, 'g' global pax, 'L' GNU name */
#define TAR_MAGIC 257         /* "ustar\0" (POSIX) or "ustar " (GNU) */
#define TAR_VERSION 263       /* "00" */
#define TAR_DEVMAJOR 329      /* 8 */
#define TAR_DEVMINOR 337      /* 8 */
#define TAR_PREFIX 345        /* 155: POSIX ustar's directory prefix of the name */
#define TAR_PREFIX_LEN 155
#define MAX_META (1 << 20)    /* the largest pax or GNU long name payload a fast path takes:
                               * tario.headers._MAX_META */

/* size rounded up to whole blocks (the data and its padding) */
static inline long long
tar_padded(long long size)
{
    return (size + (BLOCK - 1)) & ~(long long)(BLOCK - 1);
}

/* ---- reading: fields ------------------------------------------------------------------------- */
#define TAR_EXACT 1
#define TAR_ANY 0

/* The number in the field f[:n] into *out: 1, or 0 where it does not read.
 * TAR_EXACT: optional leading spaces, then octal digits through the field's end, at least one
 *            (digits never overflow: callers pass at most 11);
 * TAR_ANY:   base-256 where the first byte's high bit is set (the rest big-endian), else optional
 *            leading spaces and the octal digits up to the first other byte (a NUL, a space; none
 *            is 0); 0 where the value would pass 2**63. */
static inline int
tar_number(const unsigned char *f, size_t n, int exact, long long *out)
{
    unsigned long long v = 0;
    size_t i = 0;
    if (!exact && (f[0] & 0x80)) {
        for (i = 1; i < n; i++) {
            if (v >> 55)
                return 0;
            v = (v << 8) | f[i];
        }
        *out = (long long)v;
        return 1;
    }
    while (i < n && f[i] == ' ')
        i++;
    if (exact) {
        if (i == n)
            return 0;
        for (; i < n; i++) {
            unsigned char c = f[i];
            if (c < '0' || c > '7')
                return 0;
            v = v * 8 + (c - '0');
        }
    }
    else {
        for (; i < n && f[i] >= '0' && f[i] <= '7'; i++) {
            if (v >> 60)
                return 0;
            v = (v << 3) | (unsigned long long)(f[i] - '0');
        }
    }
    *out = (long long)v;
    return 1;
}

/* the sum of a header's 512 bytes, its checksum field counted as spaces (psadbw with SSE2); the
 * builder's too */
static inline unsigned long
tar_header_sum(const unsigned char *h)
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
    for (int i = TAR_CHKSUM; i < TAR_CHKSUM + 8; i++)
        sum -= h[i];
    return sum + 8 * ' ';
}

/* whether the header's checksum (unsigned, six octal digits as the usual writers put them) is
 * right */
static inline int
tar_checksum_ok(const unsigned char *h)
{
    long long stored;
    return tar_number(h + TAR_CHKSUM, 6, TAR_EXACT, &stored) &&
           (long long)tar_header_sum(h) == stored;
}

/* whether the 512 bytes at h are all zero (an end-of-archive block) */
static inline int
tar_zero_block(const unsigned char *h)
{
    for (int i = 0; i < BLOCK; i++)
        if (h[i])
            return 0;
    return 1;
}

/* the length of the ustar name field's name (up to its NUL, or all 100 bytes) */
static inline size_t
tar_name_len(const unsigned char *h)
{
    const unsigned char *nul = memchr(h + TAR_NAME, 0, TAR_NAME_LEN);
    return nul ? (size_t)(nul - (h + TAR_NAME)) : TAR_NAME_LEN;
}

/* the member's name as the ustar header gives it: POSIX ustar's prefix (where the magic is
 * "ustar\0" and a prefix is set), '/', then the name field; in *name (joined: a buffer of at
 * least 256 bytes, used where there is a prefix), its length returned */
static inline size_t
tar_full_name(const unsigned char *h, unsigned char *joined, const unsigned char **name)
{
    size_t len = tar_name_len(h);
    *name = h + TAR_NAME;
    if (h[TAR_PREFIX] != 0 && memcmp(h + TAR_MAGIC, "ustar\0", 6) == 0) { /* POSIX only */
        const unsigned char *pn = memchr(h + TAR_PREFIX, 0, TAR_PREFIX_LEN);
        size_t prefix_len = pn ? (size_t)(pn - (h + TAR_PREFIX)) : TAR_PREFIX_LEN;
        memcpy(joined, h + TAR_PREFIX, prefix_len);
        joined[prefix_len] = '/';
        memcpy(joined + prefix_len + 1, h + TAR_NAME, len);
        *name = joined;
        len += prefix_len + 1;
    }
    return len;
}

/* ---- reading: what the fast paths take ------------------------------------------------------- */

/* a canonical header (no link name, octal size, checksum right): its size in *size, else 0 (the
 * Python path decides what the header is, and raises) */
static inline int
tar_canonical_header(const unsigned char *h, long long *size)
{
    if (h[135] != 0 || !tar_number(h + TAR_SIZE, 11, TAR_EXACT, size))
        return 0;
    if (h[TAR_CHKSUM + 6] != 0 && h[TAR_CHKSUM + 6] != ' ')
        return 0;
    return tar_checksum_ok(h);
}

/* a canonical ustar header of a regular file ('0', no prefix): its size in *size, else 0 */
static inline int
tar_plain_header(const unsigned char *h, long long *size)
{
    if (h[TAR_TYPE] != '0' || h[TAR_PREFIX] != 0)
        return 0;
    return tar_canonical_header(h, size);
}

/* whether h is a header whose checksum is right and which, when it is a regular member's ('0' or
 * NUL), stores size (canonical 11 octal digits): random access's check of the header an index
 * points at (0 means only "not shown here") */
static inline int
tar_header_ok(const unsigned char *h, long long size)
{
    long long got;
    if (!tar_checksum_ok(h))
        return 0;
    if (h[TAR_TYPE] != '0' && h[TAR_TYPE] != 0)
        return 1;
    return h[135] == 0 && tar_number(h + TAR_SIZE, 11, TAR_EXACT, &got) && got == size;
}

/* ---- reading: pax records -------------------------------------------------------------------- */

/* The pax record at p[*pos:n] ("LENGTH KEY=VALUE\n", LENGTH counting the whole record): 1 with its
 * key and value and *pos moved past it; 0 at the end of the records (n, or a NUL); -1 where the
 * record does not read.
 * TAR_EXACT: as tario.headers._parse_pax accepts it (a decimal length of at most 20 digits, the
 *            record ending with its newline, a '=' in it); the value without the newline.
 * TAR_ANY:   the read-back thread's reading of the writer's stream: any length that fits the
 *            payload; a record without '=' has an empty key (matches none); the value runs to
 *            the record's end (its newline, where there is one, included). */
static inline int
tar_pax_record(const unsigned char *p, ptrdiff_t n, int exact, ptrdiff_t *pos,
               const unsigned char **key, ptrdiff_t *keylen, const unsigned char **val,
               ptrdiff_t *vallen)
{
    ptrdiff_t at = *pos, sp = at, length = 0;
    if (at >= n || p[at] == 0)
        return 0;
    if (exact) {
        while (sp < n && sp < at + 21 && p[sp] != ' ')
            sp++;
        if (sp >= n || sp == at || sp >= at + 21 || p[sp] != ' ')
            return -1;
        for (ptrdiff_t i = at; i < sp; i++) {
            if (p[i] < '0' || p[i] > '9' || length > (PTRDIFF_MAX - 9) / 10)
                return -1;
            length = length * 10 + (p[i] - '0');
        }
        if (length > n - at || at + length <= sp + 1 || p[at + length - 1] != '\n')
            return -1;
    }
    else {
        while (sp < n && p[sp] >= '0' && p[sp] <= '9' && length < ((ptrdiff_t)1 << 40))
            length = length * 10 + (p[sp++] - '0');
        if (sp >= n || p[sp] != ' ' || length == 0 || length > n - at || at + length < sp + 1)
            return -1;
    }
    const unsigned char *k = p + sp + 1;
    ptrdiff_t reclen = at + length - (sp + 1) - (exact ? 1 : 0); /* exact: without the newline */
    const unsigned char *eq = memchr(k, '=', (size_t)reclen);
    if (eq == NULL) {
        if (exact)
            return -1;
        eq = k - 1; /* an empty key */
    }
    *key = k;
    *keylen = eq < k ? 0 : eq - k;
    *val = eq < k ? k + reclen : eq + 1;
    *vallen = eq < k ? 0 : reclen - *keylen - 1;
    *pos = at + length;
    return 1;
}

/* The records of a pax header's payload that leave the member's reading as the plain path reads
 * it: every record well formed, no "size" and no "GNU.sparse." key (those change what the data
 * is), no empty or '/'-ended "path" (those change which name wins: the Python path decides).
 * *path: the value of the last "path" record, or NULL. Returns 0 at anything else (the Python
 * path reads the member, and raises). */
static inline int
tar_harmless_pax(const unsigned char *p, ptrdiff_t n, const unsigned char **path,
                 ptrdiff_t *pathlen)
{
    ptrdiff_t pos = 0, keylen, vallen;
    const unsigned char *key, *val;
    int rc;
    *path = NULL;
    *pathlen = 0;
    while ((rc = tar_pax_record(p, n, TAR_EXACT, &pos, &key, &keylen, &val, &vallen)) == 1) {
        if ((keylen == 4 && memcmp(key, "size", 4) == 0) ||
            (keylen >= 10 && memcmp(key, "GNU.sparse", 10) == 0))
            return 0;
        if (keylen == 4 && memcmp(key, "path", 4) == 0) {
            if (vallen == 0 || val[vallen - 1] == '/')
                return 0;
            *path = val;
            *pathlen = vallen;
        }
    }
    return rc == 0;
}

/* A pax extended header ('x') at h whose records are harmless (see tar_harmless_pax), or a GNU
 * long name ('L', not empty), followed by a plain member header, all inside the first `room` bytes
 * from h: the member header's distance from h in *at, its data size in *size, the pax path (or
 * NULL) in *path and *pathlen. */
static inline int
tar_pax_member(const unsigned char *h, ptrdiff_t room, ptrdiff_t *at, long long *size,
               const unsigned char **path, ptrdiff_t *pathlen)
{
    long long psize;
    if ((h[TAR_TYPE] != 'x' && h[TAR_TYPE] != 'L') || !tar_canonical_header(h, &psize) ||
        psize > MAX_META)
        return 0;
    ptrdiff_t member = BLOCK + (ptrdiff_t)tar_padded(psize);
    if (member > room - BLOCK)
        return 0;
    if (h[TAR_TYPE] == 'L') {
        /* a GNU long name: its blocks up to the first NUL name the member, past its declared
         * size where the name runs on (as GNU tar and tarfile read it) */
        ptrdiff_t blocks = member - BLOCK;
        const unsigned char *nul = memchr(h + BLOCK, 0, (size_t)blocks);
        *path = h + BLOCK;
        *pathlen = nul ? (ptrdiff_t)(nul - (h + BLOCK)) : blocks;
        if (*pathlen == 0)
            return 0;
    }
    else if (!tar_harmless_pax(h + BLOCK, (ptrdiff_t)psize, path, pathlen))
        return 0;
    if (!tar_plain_header(h + member, size) || *size > room - member - BLOCK)
        return 0;
    *at = member;
    return 1;
}

/* ---- writing: the one header builder --------------------------------------------------------- */

/* `digits` octal digits of v, zero-padded, then a NUL (what snprintf(dst, digits + 1, "%0*llo")
 * writes for a v that fits). Not snprintf: once a library in the process registers a printf
 * extension (numpy's OpenBLAS brings libquadmath, which does), glibc formats every call through
 * its slow positional path, which costs several times its usual one (perf: ~6 % of a writer's
 * CPU time went to it). */
static inline void
tar_put_octal(char *dst, int digits, unsigned long long v)
{
    dst[digits] = 0;
    for (int i = digits - 1; i >= 0; i--) {
        dst[i] = (char)('0' + (v & 7));
        v >>= 3;
    }
}

/* the fields every plain member's ustar block shares (mode, owner, mtime, type, magic), as
 * tario.TarMemberWriter writes them */
static inline void
tar_template(char head[BLOCK], long long mode, long long mtime)
{
    memset(head, 0, BLOCK);
    tar_put_octal(head + TAR_MODE, 7, (unsigned long long)mode);
    memcpy(head + TAR_UID, "0000000", 8);
    memcpy(head + TAR_GID, "0000000", 8);
    tar_put_octal(head + TAR_MTIME, 11, (unsigned long long)mtime);
    head[TAR_TYPE] = '0';
    memcpy(head + TAR_MAGIC, "ustar", 6);
    memcpy(head + TAR_VERSION, "00", 2);
    memcpy(head + TAR_DEVMAJOR, "0000000", 8);
    memcpy(head + TAR_DEVMINOR, "0000000", 8);
}

/* one plain member's block into h: the template, its name (ASCII, at most 100 bytes, no NUL: the
 * caller checks), its size and the checksum */
static inline void
tar_header(char *h, const char head[BLOCK], const char *name, size_t namelen, long long size)
{
    memcpy(h, head, BLOCK);
    memcpy(h + TAR_NAME, name, namelen);
    tar_put_octal(h + TAR_SIZE, 11, (unsigned long long)size);
    tar_put_octal(h + TAR_CHKSUM, 6, tar_header_sum((const unsigned char *)h));
    h[TAR_CHKSUM + 6] = 0;
    h[TAR_CHKSUM + 7] = ' ';
}

#endif
