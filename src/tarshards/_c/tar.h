/* The tar format, read and written: the ONE header parser of the C paths (reading side) and the
 * ONE header builder (writing side), as static inline functions shared by every C loop of
 * _speedups and _xxh3 that reads or writes a tar header. The Python reference is
 * tario/headers.py (tests/test_speedups.py holds the two equal). */
#ifndef TARSHARDS_TAR_H
#define TARSHARDS_TAR_H

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define BLOCK 512

static inline int
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

/* the sum of a header's 512 bytes, its checksum field counted as spaces (psadbw with SSE2) */
static inline unsigned long
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
static inline int
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

static inline int
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
static inline int
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
static inline int
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
static inline void
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
static inline void
ustar_header(char *h, const char head[BLOCK], PyObject *name, Py_ssize_t size)
{
    memcpy(h, head, BLOCK);
    memcpy(h, PyUnicode_DATA(name), (size_t)PyUnicode_GET_LENGTH(name));
    put_octal(h + 124, 11, (unsigned long long)size);
    put_octal(h + 148, 6, header_sum((const unsigned char *)h));
    h[154] = 0;
    h[155] = ' ';
}

/* the header_ok test on a block */
static inline int
block_ok(const unsigned char *h, long long size)
{
    long long stored, got;
    if (!parse_octal(h + 148, 6, &stored) || (long long)header_sum(h) != stored)
        return 0;
    if (h[156] != '0' && h[156] != 0)
        return 1;
    return h[135] == 0 && parse_octal(h + 124, 11, &got) && got == size;
}

#endif
