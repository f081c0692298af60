/* fuse_xxh.c — xxh3-128 for the native fetch: the portable copy and the dispatch; and
 * xxh3-64, a block's digest (128 KiB: the portable copy). */
#define XXH_INLINE_ALL
#define XXH_PREFETCH_DIST 2048 /* fuse_xxh.h: a chunk another core just wrote */
#include <stdatomic.h>
#include <string.h>
#include <xxhash.h>

#include "fuse_xxh.h"

static void xxh128_plain(const void *buf, size_t len, uint8_t out[16])
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(buf, len));
    memcpy(out, c.digest, 16);
}

void fe_xxh128(const void *buf, size_t len, uint8_t out[16])
{
    static atomic_int avx2 = -1; /* first use: every thread finds the same answer */
    int have = atomic_load_explicit(&avx2, memory_order_relaxed);
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") ? 1 : 0;
        atomic_store_explicit(&avx2, have, memory_order_relaxed);
    }
    if (have)
        fe_xxh128_avx2(buf, len, out);
    else
        xxh128_plain(buf, len, out);
}

void fe_xxh64(const void *buf, size_t len, uint8_t out[8])
{
    XXH64_canonical_t c;
    XXH64_canonicalFromHash(&c, XXH3_64bits(buf, len));
    memcpy(out, c.digest, 8);
}
