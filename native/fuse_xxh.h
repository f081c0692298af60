/* fuse_xxh.h — xxh3-128, the chunk digest (kspeedfs/checksum.py), for the native fetch.
 *
 * xxhash.h is compiled inline twice, plainly and for AVX2, and the AVX2 copy is taken
 * when the CPU has it: on 4 MiB buffers here the Debian library (built for SSE2) hashes
 * 18.4 GB/s, the inline AVX2 copy 28.4–29.4, the Python wheel (AVX-512) 29.0.
 *
 * Both copies prefetch 2048 bytes ahead instead of xxhash.h's 384: a landed chunk was
 * just written by another core (the NIC thread's receive), and its lines come from that
 * core's cache at a latency the default distance does not cover.  Measured here (4 MiB
 * buffers memset by a thread pinned to the other CPU, then hashed; 5 runs each): AVX2
 * 12.1–14.4 → 15.2–16.0 GB/s (hot: 24.5–26.9 → 28.3–28.6), SSE2 9.0–9.3 → 12.5–12.7. */
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
