/* The reader's rule for naming a member's sample and field, shared by the C loops that index
 * shards (_speedups.index_members, and _xxh3.Background's read-back thread while a shard is
 * written); index.IndexBuilder.add is the reference, and the tests compare both with it.
 *
 * name_split(name, len, last_dot, &skip, &dot): 1 where the member names a field, with skip the
 * bytes of a leading "./" (2, else 0: the sample's flag) and dot where the key ends and the
 * extension starts after it (counted from name + skip; the first dot of the base name, or its
 * last with last_dot); 0 where the reader skips the member: a base name starting with "__", or
 * without a dot past its first byte, or ending with its dot. Bytes: '/', '.' and '_' are ASCII,
 * so a UTF-8 name splits where its str would. */
#ifndef TARSHARDS_NAMES_H
#define TARSHARDS_NAMES_H

#include <stddef.h>
#include <string.h>

static inline int
name_split(const unsigned char *name, size_t len, int last_dot, size_t *skip, size_t *dot)
{
    size_t s = len >= 2 && name[0] == '.' && name[1] == '/' ? 2 : 0;
    name += s;
    len -= s;
    size_t base = len; /* the base name starts after the last '/' */
    while (base > 0 && name[base - 1] != '/')
        base--;
    if (len - base >= 2 && name[base] == '_' && name[base + 1] == '_')
        return 0;
    const unsigned char *d = NULL;
    if (last_dot) {
        for (size_t i = len; i > base; i--)
            if (name[i - 1] == '.') {
                d = name + i - 1;
                break;
            }
    }
    else
        d = memchr(name + base, '.', len - base);
    if (d == NULL || d == name + base || d == name + len - 1)
        return 0;
    *skip = s;
    *dot = (size_t)(d - name);
    return 1;
}

#endif
