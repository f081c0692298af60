/* fuse_xxh_avx2.c — the same xxh3-128 compiled for AVX2 (fuse_xxh.h says why). */
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_PREFETCH_DIST 2048 /* fuse_xxh.h: a chunk another core just wrote */
#include <xxhash.h>
#include <string.h>

#include "fuse_xxh.h"

void fe_xxh128_avx2(const void *buf, size_t len, uint8_t out[16])
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(buf, len));
    memcpy(out, c.digest, 16);
}
