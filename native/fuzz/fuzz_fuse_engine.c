/* fuzz_fuse_engine.c — the native FUSE engine (fuse_engine.c) under random requests,
 * random (often corrupt) manifest indexes and a racing memory tier.  Built with
 * AddressSanitizer + UBSan by tests/unit/test_fuse_engine_fuzz.py.
 *
 * Each case: a random index (a sane tree with fields then corrupted at random: the
 * engine must bounds-check what Python validated), an engine on one end of a
 * SOCK_SEQPACKET socketpair (message boundaries like /dev/fuse), INIT, one request
 * thread; then this thread plays the kernel and Python at once — sends random requests
 * (known opcodes with random nodeids, offsets, sizes and names, and random bytes),
 * reads and checks every reply header, answers queued misses, and puts, discards,
 * touches and reaps tier buffers while the request thread replies from them.  A tier
 * buffer is freed the moment the engine hands its owner back, so a reply that read it
 * later is a use-after-free ASan reports.  Each case also lays out random io_uring
 * entries (fe_ring_layout: a header whose sizes lie, into an output buffer of exactly the
 * capacity it is told, so a write past it is an ASan report).  Exit 0 and "no failure"
 * when every case ran.
 *
 *   fuzz_fuse_engine -seconds S -seed N
 */
#define _GNU_SOURCE
#include "fuse_engine.h"
#include "fuse_uring_abi.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static uint64_t rng;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }

#define FAIL(...)                                                                             \
    do {                                                                                      \
        fprintf(stderr, "FAIL: " __VA_ARGS__);                                                \
        fputc('\n', stderr);                                                                  \
        exit(1);                                                                              \
    } while (0)

struct arrays {
    uint32_t parent[64], mode[64], uid[64], gid[64], ext[64], chunk_len[8];
    uint64_t size[64], name_off[64], data[64];
    int64_t mtime[64];
    uint16_t name_len[64];
    uint8_t names[1024], ext_digests[64 * 16], chunk_digests[8 * 16];
};

/* A tree: root 0, its children 1..n1 (a few dirs among them, each with children after). */
static void make_index(struct arrays *a, struct fe_index *ix)
{
    memset(a, 0, sizeof *a);
    uint64_t entries = 1 + below(63), chunks = 1 + below(8);
    uint64_t cs = 4096u << below(3), bs = below(3) ? 512u << below(4) : 0;
    if (bs > cs)
        bs = cs;
    uint64_t names_len = 0, nfiles = 0, cursor = 0, ext = 0;
    for (uint64_t i = 0; i < entries; i++) {
        a->parent[i] = i ? (uint32_t)below(i) : 0;
        int kind = i == 0 ? 0 : (int)below(4); /* 0 dir, 3 symlink, else file */
        a->mode[i] = kind == 0 ? S_IFDIR | 0755 : kind == 3 ? S_IFLNK | 0777 : S_IFREG | 0644;
        a->mtime[i] = (int64_t)rnd();
        uint16_t n = (uint16_t)(1 + below(12));
        a->name_off[i] = names_len;
        a->name_len[i] = n;
        for (int j = 0; j < n && names_len < sizeof a->names; j++)
            a->names[names_len++] = (uint8_t)('a' + below(26));
        if (kind == 0) {
            a->data[i] = 1 + below(entries);
            a->size[i] = below(entries);
        } else if (kind == 3) {
            a->data[i] = below(names_len + 1);
            a->size[i] = below(16);
        } else {
            a->size[i] = below(3 * cs);
            a->data[i] = cursor;
            cursor += a->size[i];
            a->ext[i] = (uint32_t)ext++;
            nfiles++;
        }
    }
    for (uint64_t k = 0; k < chunks; k++)
        a->chunk_len[k] = (uint32_t)(1 + below(cs));
    for (size_t j = 0; j < sizeof a->ext_digests; j++)
        a->ext_digests[j] = (uint8_t)below(4); /* few keys: collisions and hits */
    for (size_t j = 0; j < sizeof a->chunk_digests; j++)
        a->chunk_digests[j] = (uint8_t)below(4);
    /* corrupt a few fields: what a broken (but signed) manifest could hold */
    for (int c = (int)below(4); c > 0; c--) {
        uint64_t i = below(entries);
        switch (below(6)) {
        case 0:
            a->data[i] = rnd();
            break;
        case 1:
            a->size[i] = rnd();
            break;
        case 2:
            a->name_off[i] = rnd();
            break;
        case 3:
            a->ext[i] = (uint32_t)rnd();
            break;
        case 4:
            a->parent[i] = (uint32_t)rnd();
            break;
        default:
            a->mode[i] = (uint32_t)rnd();
            break;
        }
    }
    *ix = (struct fe_index){.entries = entries,
                            .chunks = chunks,
                            .extents = ext < 64 ? ext : 64,
                            .names_len = names_len,
                            .nfiles = nfiles,
                            .chunk_size = cs,
                            .block_size = bs,
                            .block_stride = bs ? (cs + bs - 1) / bs : 0,
                            .parent = a->parent,
                            .mode = a->mode,
                            .uid = a->uid,
                            .gid = a->gid,
                            .size = a->size,
                            .mtime_ns = a->mtime,
                            .name_off = a->name_off,
                            .name_len = a->name_len,
                            .data = a->data,
                            .ext = a->ext,
                            .chunk_len = a->chunk_len,
                            .names = a->names,
                            .ext_digests = a->ext_digests,
                            .chunk_digests = a->chunk_digests};
}

/* ---------------------------------------------------------------- the "kernel" side */

static uint64_t sent, replies;

#define OPEN_UNIQUE (1ULL << 62) /* OPENs carry this bit: their replies give handles */
static uint64_t handles[16];
static int nhandles;

static void drain(int fd, int wait_ms)
{
    static uint8_t buf[1 << 21];
    struct pollfd p = {fd, POLLIN, 0};
    while (poll(&p, 1, wait_ms) > 0 && (p.revents & POLLIN)) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0)
            return;
        const struct fuse_out_header *h = (const void *)buf;
        if ((size_t)n < sizeof *h || h->len != (uint32_t)n)
            FAIL("reply of %zd bytes says len %u", n, (size_t)n < sizeof *h ? 0 : h->len);
        if (h->error > 0 || h->error < -4095)
            FAIL("reply error %d", h->error);
        if ((h->unique & OPEN_UNIQUE) && h->error == 0) {
            if ((size_t)n != sizeof *h + sizeof(struct fuse_open_out))
                FAIL("OPEN reply of %zd bytes", n);
            if (nhandles < 16)
                handles[nhandles++] = ((const struct fuse_open_out *)(h + 1))->fh;
            else
                FAIL("more open handles than OPENs sent");
        }
        replies++;
        wait_ms = 0;
    }
}

static void send_msg(int fd, const void *msg, size_t len)
{
    for (;;) {
        if (send(fd, msg, len, MSG_DONTWAIT) == (ssize_t)len) {
            sent++;
            return;
        }
        if (errno != EAGAIN && errno != ENOBUFS)
            FAIL("send: %s", strerror(errno));
        drain(fd, 10);
    }
}

static const uint32_t OPCODES[] = {FUSE_LOOKUP,  FUSE_GETATTR,      FUSE_READLINK,
                                   FUSE_OPEN,    FUSE_RELEASE,      FUSE_READ,
                                   FUSE_READ,    FUSE_READ,         FUSE_OPENDIR,
                                   FUSE_READDIR, FUSE_READDIRPLUS,  FUSE_RELEASEDIR,
                                   FUSE_STATFS,  FUSE_GETXATTR,     FUSE_LISTXATTR,
                                   FUSE_FORGET,  FUSE_BATCH_FORGET, FUSE_INTERRUPT,
                                   FUSE_WRITE,   FUSE_MKDIR,        FUSE_FLUSH,
                                   FUSE_IOCTL,   FUSE_LSEEK,        999};


static void random_request(int fd, const struct fe_index *ix, uint64_t unique)
{
    uint8_t msg[4096];
    memset(msg, 0, sizeof msg);
    struct fuse_in_header *h = (void *)msg;
    uint8_t *arg = msg + sizeof *h;
    size_t alen = 0;
    h->opcode = OPCODES[below(sizeof OPCODES / sizeof *OPCODES)];
    h->unique = unique;
    h->nodeid = below(4) ? 1 + below(ix->entries) : rnd();
    switch (h->opcode) {
    case FUSE_LOOKUP:
    case FUSE_GETXATTR: {
        if (h->opcode == FUSE_GETXATTR) {
            ((struct fuse_getxattr_in *)arg)->size = (uint32_t)below(300);
            alen = sizeof(struct fuse_getxattr_in);
        }
        size_t n = below(300);
        for (size_t j = 0; j < n; j++)
            arg[alen + j] = (uint8_t)('a' + below(26));
        alen += n + (below(8) ? 1 : 0); /* sometimes no terminating NUL */
        break;
    }
    case FUSE_OPEN:
        if (nhandles >= 8)
            return; /* room for the replies in flight */
        ((struct fuse_open_in *)arg)->flags = below(4) ? O_RDONLY : (uint32_t)rnd();
        alen = sizeof(struct fuse_open_in);
        h->unique |= OPEN_UNIQUE;
        break;
    case FUSE_RELEASE:
        if (!nhandles)
            return;
        ((struct fuse_release_in *)arg)->fh = handles[--nhandles];
        alen = sizeof(struct fuse_release_in);
        break;
    case FUSE_READ:
    case FUSE_READDIR:
    case FUSE_READDIRPLUS: {
        struct fuse_read_in *r = (void *)arg;
        r->fh = h->opcode == FUSE_READ && nhandles ? handles[below(nhandles)] : rnd();
        r->offset = below(2) ? below(3 * ix->chunk_size) : rnd() >> 1;
        r->size = (uint32_t)(below(2) ? 4096 : below(1 << 20));
        alen = sizeof *r;
        break;
    }
    case FUSE_LISTXATTR:
        ((struct fuse_getxattr_in *)arg)->size = (uint32_t)below(300);
        alen = sizeof(struct fuse_getxattr_in);
        break;
    default:
        alen = below(64);
        for (size_t j = 0; j < alen; j++)
            arg[j] = (uint8_t)rnd();
    }
    if (below(16) == 0)
        alen = below(alen + 1); /* truncated arguments */
    h->len = (uint32_t)(sizeof *h + alen);
    send_msg(fd, msg, h->len);
}

/* ---------------------------------------------------------------- the "Python" side */

struct owner {
    uint8_t *data;
};

static void release(void *o)
{
    struct owner *ow = o;
    memset(ow->data, 0xdd, 1); /* touch: a use-after-free is reported at the reader */
    free(ow->data);
    free(ow);
}

static void random_key(const struct fe_index *ix, uint8_t *key, size_t *keylen)
{
    int kind = (int)below(3);
    if (kind == 0 || !ix->extents) {
        memcpy(key, ix->chunk_digests + 16 * below(ix->chunks), 16);
        *keylen = 16;
    } else if (kind == 1) {
        memcpy(key, ix->ext_digests + 16 * below(ix->extents), 16);
        *keylen = 16;
    } else {
        memcpy(key, ix->chunk_digests + 16 * below(ix->chunks), 16);
        uint32_t b = (uint32_t)below(8);
        memcpy(key + 16, &b, 4);
        *keylen = 20;
    }
}

static void tier_step(struct fe_engine *e, const struct fe_index *ix)
{
    uint8_t key[20];
    size_t keylen;
    random_key(ix, key, &keylen);
    int what = (int)below(4);
    if (what <= 1) {
        size_t len = below(2) ? ix->chunk_size : below(ix->chunk_size + 1);
        struct owner *o = malloc(sizeof *o);
        o->data = malloc(len ? len : 1);
        memset(o->data, 0x5a, len ? len : 1);
        if (fe_tier_put(e, key, keylen, o->data, len, o) < 0)
            release(o);
    } else if (what == 2) {
        int found;
        void *o = fe_tier_discard(e, key, keylen, &found);
        if (o)
            release(o);
    } else {
        fe_tier_touched(e, key, keylen, below(2) ? FE_SERVED : FE_TOUCHED);
    }
    void *owners[64];
    size_t n = fe_tier_reap(e, owners, 64);
    for (size_t i = 0; i < n; i++)
        release(owners[i]);
}

static void answer_queue(struct fe_engine *e)
{
    struct fe_request q[32];
    size_t n = fe_take(e, q, 32);
    static const uint8_t zeros[4096];
    for (size_t i = 0; i < n; i++) {
        const struct fe_read *rd = &q[i].read;
        const struct fe_xattr *x = &q[i].xattr;
        if (q[i].kind == FE_READ && below(2))
            fe_reply_data(rd->fd, rd->unique, zeros,
                          rd->size < sizeof zeros ? rd->size : sizeof zeros);
        else if (q[i].kind == FE_READ)
            fe_reply_error(rd->fd, rd->unique, EIO);
        else if ((q[i].kind == FE_GETXATTR || q[i].kind == FE_LISTXATTR) && below(2))
            fe_reply_xattr_size(x->fd, x->unique, 7);
        else if (q[i].kind == FE_GETXATTR || q[i].kind == FE_LISTXATTR)
            fe_reply_error(x->fd, x->unique, EIO);
    }
}

static void one_case(void)
{
    static struct arrays a;
    struct fe_index ix;
    make_index(&a, &ix);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
        FAIL("socketpair: %s", strerror(errno));
    int bufsz = 4 << 20;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &bufsz, sizeof bufsz);
    setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &bufsz, sizeof bufsz);
    struct fe_options opt = {.generation = 1,
                             .dataset_bytes = rnd() >> 8,
                             .entry_timeout = 1.5,
                             .attr_timeout = 86400,
                             .xattrs = (int)below(2),
                             .max_pages = 256,
                             .prefetch_depth = (uint32_t)below(5),
                             .prefetch_trigger = 2};
    char err[256];
    struct fe_engine *e = fe_create(sv[0], &ix, &opt, err, sizeof err);
    if (!e)
        FAIL("fe_create: %s", err);
    struct {
        struct fuse_in_header h;
        struct fuse_init_in in;
    } init = {.h = {.len = sizeof init, .opcode = FUSE_INIT, .unique = 1},
              .in = {.major = 7,
                     .minor = 31 + (uint32_t)below(10),
                     .max_readahead = 131072,
                     .flags = (uint32_t)rnd(),
                     .flags2 = (uint32_t)rnd()}};
    send_msg(sv[1], &init, sizeof init);
    if (fe_init(e, err, sizeof err) < 0)
        FAIL("fe_init: %s", err);
    drain(sv[1], 100);
    if (fe_start(e, 1, err, sizeof err) < 0)
        FAIL("fe_start: %s", err);
    int requests = 50 + (int)below(200);
    for (int i = 0; i < requests; i++) {
        if (below(8) == 0) { /* a burst of 4 KiB reads */
            for (int j = 0; j < 8; j++) {
                struct {
                    struct fuse_in_header h;
                    struct fuse_read_in r;
                } m = {.h = {.len = sizeof m,
                             .opcode = FUSE_READ,
                             .unique = 1000 + (uint64_t)j,
                             .nodeid = 1 + below(ix.entries)},
                       .r = {.fh = nhandles ? handles[below(nhandles)] : 0,
                             .offset = j ? 4096u * (uint64_t)j : below(2 * ix.chunk_size),
                             .size = 4096}};
                send_msg(sv[1], &m, sizeof m);
            }
        }
        random_request(sv[1], &ix, 2 + (uint64_t)i);
        for (int t = (int)below(4); t > 0; t--)
            tier_step(e, &ix);
        answer_queue(e);
        drain(sv[1], 0);
    }
    if (below(2))
        fe_stop(e); /* a handover: threads interrupted in read, joined */
    else
        shutdown(sv[1], SHUT_WR); /* the worker reads 0 and ends */
    for (int spins = 0; fe_running(e); spins++) {
        answer_queue(e);
        drain(sv[1], 1);
        if (spins > 100000)
            FAIL("request thread did not end");
    }
    fe_join(e);
    answer_queue(e);
    drain(sv[1], 0);
    void *owners[256];
    size_t n;
    while ((n = fe_tier_clear(e, owners, 256)) > 0)
        for (size_t i = 0; i < n; i++)
            release(owners[i]);
    if (fe_tier_count(e) != 0)
        FAIL("tier not empty after clear: %zu", fe_tier_count(e));
    struct fe_counters c;
    fe_counters(e, &c);
    fe_destroy(e); /* closes sv[0], frees handles never released */
    close(sv[1]);
    nhandles = 0;
}

/* Random ring entries through fe_ring_layout: sizes that add up are laid out exactly
 * (header, op_in, payload), any other is -EIO; heap buffers of exactly the stated
 * capacities, so ASan sees a read or write past either. */
static uint64_t ring_layouts;
static void ring_layout_case(void)
{
    struct fe_uring_req_header *hdr = malloc(sizeof *hdr);
    if (!hdr)
        FAIL("out of memory");
    for (size_t i = 0; i < sizeof *hdr; i++)
        ((uint8_t *)hdr)[i] = (uint8_t)rnd();
    size_t pcap = below(3) ? below(4096) : below(70000), cap = 40 + below(8192);
    struct fuse_in_header ih;
    memcpy(&ih, hdr->in_out, sizeof ih);
    if (below(2)) { /* mostly-sane sizes, then one field off by a little */
        uint32_t psz = (uint32_t)below(pcap + 2),
                 op = (uint32_t)below(FE_URING_OP_IN_OUT_SZ + 2);
        ih.len = (uint32_t)(sizeof ih + op + psz + (below(4) ? 0 : below(3) - 1));
        memcpy(hdr->in_out, &ih, sizeof ih);
        hdr->ring_ent_in_out.payload_sz = psz;
    }
    uint8_t *payload = malloc(pcap ? pcap : 1), *out = malloc(cap);
    if (!payload || !out)
        FAIL("out of memory");
    for (size_t i = 0; i < pcap; i++)
        payload[i] = (uint8_t)i;
    long n = fe_ring_layout(hdr, payload, pcap, out, cap);
    memcpy(&ih, hdr->in_out, sizeof ih);
    size_t psz = hdr->ring_ent_in_out.payload_sz;
    int fits = ih.len >= sizeof ih && ih.len <= cap && psz <= pcap &&
               psz <= ih.len - sizeof ih && ih.len - sizeof ih - psz <= FE_URING_OP_IN_OUT_SZ;
    if (fits != (n >= 0) || (n >= 0 && (size_t)n != ih.len))
        FAIL("fe_ring_layout: len %u payload %zu caps %zu/%zu gave %ld", ih.len, psz, pcap,
             cap, n);
    if (n >= 0) {
        size_t op = ih.len - sizeof ih - psz;
        if (memcmp(out, &ih, sizeof ih) || memcmp(out + sizeof ih, hdr->op_in, op) ||
            memcmp(out + sizeof ih + op, payload, psz))
            FAIL("fe_ring_layout: the layout is not header, op_in, payload");
    }
    ring_layouts++;
    free(hdr);
    free(payload);
    free(out);
}

int main(int argc, char **argv)
{
    double seconds = 3;
    rng = 0x9e3779b97f4a7c15ULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-seconds"))
            seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "-seed"))
            rng = strtoull(argv[i + 1], NULL, 0) | 1;
    }
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint64_t cases = 0;
    do {
        one_case();
        for (int i = 0; i < 64; i++)
            ring_layout_case();
        cases++;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) / 1e9 <
             seconds);
    printf("%llu cases, %llu requests, %llu replies, %llu ring layouts: no failure\n",
           (unsigned long long)cases, (unsigned long long)sent, (unsigned long long)replies,
           (unsigned long long)ring_layouts);
    return 0;
}
