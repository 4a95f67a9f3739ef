/* What the files of the _xxh3 module share: includes, and the upper halves of the vector
 * registers cleared after the vectorised hash (clear_upper). Internal (hidden names). */
#ifndef TARSHARDS_XXH3_H
#define TARSHARDS_XXH3_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <errno.h>
#include <fcntl.h>
#include <time.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include "names.h"
#include "tar.h"

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

extern PyTypeObject BackgroundType, OwnedType; /* readback.c */

/* After the vectorised hash, the upper halves of the vector registers are zeroed (vzeroupper).
 * The dispatched AVX2/AVX-512 code of the system's libxxhash returns with them dirty (Debian's
 * build holds two vzeroupper in all), and every legacy SSE instruction after it (the C loops of
 * _speedups, libc's, the interpreter's) then pays for merging them: on an AVX-512 host the
 * writer's header checksum loop ran 3x slower beside the hashing, and recording the index cost
 * 16-22 % of ShardWriter's rate instead of 9-12 %. */
#if defined(__x86_64__) && defined(__GNUC__)
extern int HAVE_AVX; /* set once, at import */
static inline void
clear_upper(void)
{
    if (HAVE_AVX)
        __asm__ volatile("vzeroupper" ::: "memory");
}
#else
static inline void
clear_upper(void)
{
}
#endif


#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
