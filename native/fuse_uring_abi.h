/* fuse_uring_abi.h — the FUSE-over-io_uring ABI (kernel 6.14+, FUSE protocol 7.42).
 *
 * Debian 12's linux-libc-dev (6.1) predates it, so the constants and structs are defined
 * here from the kernel's include/uapi/linux/fuse.h (7.42+; unchanged through 6.18) and
 * Documentation/filesystems/fuse-io-uring.rst. Only what the engine uses; every name
 * carries an FE_ prefix so a newer <linux/fuse.h> never collides with it.
 *
 *   INIT reply flags2 bit 9 (FUSE_OVER_IO_URING, 1 << 41): the daemon will serve the
 *   connection over io_uring queues; the kernel offers it only when the fuse module's
 *   enable_uring parameter is Y.
 *
 *   One queue per possible CPU (qid = CPU number); each entry is one IORING_OP_URING_CMD
 *   on a 128-byte SQE whose fd is the /dev/fuse fd, whose addr/len is an iovec[2]:
 *   [0] a struct fe_uring_req_header, [1] a payload buffer of at least
 *   max(FUSE_MIN_READ_BUFFER = 8192, max_write, max_pages * PAGE_SIZE) bytes, and whose
 *   80-byte command area holds a struct fe_uring_cmd_req.
 */
#ifndef KSPEEDFS_FUSE_URING_ABI_H
#define KSPEEDFS_FUSE_URING_ABI_H

#include <stdint.h>

#define FE_FUSE_OVER_IO_URING (1ULL << 41)

#define FE_URING_IN_OUT_HEADER_SZ 128
#define FE_URING_OP_IN_OUT_SZ 128
#define FE_FUSE_MIN_READ_BUFFER 8192

/* The trailer of the header buffer: the kernel writes it with a request, the daemon
 * with its reply (payload_sz: bytes valid in the payload buffer, either way). */
struct fe_uring_ent_in_out {
    uint64_t flags;
    uint64_t commit_id; /* the request's unique: echo it in the commit */
    uint32_t payload_sz;
    uint32_t padding;
    uint64_t reserved;
};

/* iov[0] of an entry. in_out: struct fuse_in_header on a request, struct
 * fuse_out_header on a reply. op_in: the opcode's fixed first argument (in_args[0],
 * e.g. struct fuse_read_in; empty for LOOKUP, whose name is in the payload). */
struct fe_uring_req_header {
    char in_out[FE_URING_IN_OUT_HEADER_SZ];
    char op_in[FE_URING_OP_IN_OUT_SZ];
    struct fe_uring_ent_in_out ring_ent_in_out;
};

/* io_uring_sqe.cmd_op */
enum {
    FE_IO_URING_CMD_REGISTER = 1,         /* register an entry's buffers, wait for a request */
    FE_IO_URING_CMD_COMMIT_AND_FETCH = 2, /* reply to commit_id, wait for the next */
};

/* In the SQE's 80-byte command area. */
struct fe_uring_cmd_req {
    uint64_t flags;
    uint64_t commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

_Static_assert(sizeof(struct fe_uring_ent_in_out) == 32, "fuse_uring_ent_in_out is 32 bytes");
_Static_assert(sizeof(struct fe_uring_req_header) == 288,
               "fuse_uring_req_header is 288 bytes");
_Static_assert(sizeof(struct fe_uring_cmd_req) == 24, "fuse_uring_cmd_req is 24 bytes");

#endif
