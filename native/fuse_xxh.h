/* fuse_xxh.h — xxh3-128, the chunk digest (kspeedfs/checksum.py), for the native fetch.
 *
 * xxhash.h is compiled inline twice, plainly and for AVX2, and the AVX2 copy is taken
 * when the CPU has it: Debian's libxxhash is built for SSE2 only and hashes markedly
 * slower than the AVX2 copy, which keeps up with the Python wheel.
 *
 * Both copies prefetch 2048 bytes ahead instead of xxhash.h's 384: a landed chunk was
 * just written by another core (the NIC thread's receive), and its lines come from that
 * core's cache at a latency the default distance does not cover.  The measurements:
 * docs/design.md, "xxh3 in C". */
#ifndef KSPEEDFS_FUSE_XXH_H
#define KSPEEDFS_FUSE_XXH_H

#include <stddef.h>
#include <stdint.h>

/* The canonical (big-endian) xxh3-128 of buf[0..len), as xxhash.xxh3_128_digest. */
void fe_xxh128(const void *buf, size_t len, uint8_t out[16]);

void fe_xxh128_avx2(const void *buf, size_t len, uint8_t out[16]); /* fuse_xxh_avx2.c */

/* The canonical (big-endian) xxh3-64 of buf[0..len), as xxhash.xxh3_64_digest. */
void fe_xxh64(const void *buf, size_t len, uint8_t out[8]);

#endif
