/* fuse_reply.c — replies and notifications on /dev/fuse: one writev per reply, the header
 * and the caller's buffers (a large READ's by vmsplice + splice, fuse.splice); a ring
 * token's reply goes to its io_uring entry (fuse_uring.c). */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>

#define FE_NOTIFY_RESEND 7 /* kernel 6.9+ (include/uapi/linux/fuse.h, 7.40) */

static int write_reply(int fd, struct iovec *iov, int n)
{
    for (;;) {
        ssize_t w = writev(fd, iov, n);
        if (w >= 0)
            return 0;
        if (errno != EINTR)
            return -errno; /* ENOENT: the request was interrupted; nothing to do */
    }
}

/* Replies by splice (fuse.splice). A writev hands the kernel our buffer, and it pins and
 * copies it a page at a time (fuse_copy_fill: a get-user-pages and the request's lock
 * around each page); vmsplice puts references to the same pages into a pipe (a batch of
 * pages per call) and splice(pipe → /dev/fuse) copies them into the page cache from
 * there: still one copy, and nothing waits in the pipe once splice returns, so a tier
 * buffer is never referenced after the reply that pinned it (fe_tier's slot rule holds).
 * Below FE_SPLICE_MIN replies are written as before: small replies (an ImageNet-like
 * file's) gained nothing measurable. The measurements: docs/design.md, "Replies by
 * splice".
 *
 * A reply goes whole or not at all: its pages (the header's included) must fit the
 * pipe. A 1 MiB READ's reply spans 257 pages; a pipe beyond fs.pipe-max-size (1 MiB =
 * 256 pages by default) needs CAP_SYS_RESOURCE or the sysctl raised (./run setup does:
 * mount/sysctl-kspeedfs.conf), else such replies are written as before. Each thread that
 * replies for an engine with the option (request threads, the fetch thread) makes its
 * pipe on its first large reply; a failed splice closes it (whatever it held goes with
 * it) and the next reply makes another. */

struct reply_pipe {
    int rd, wr;
    size_t pages; /* what it holds at most */
};

static pthread_key_t pipe_key;
static pthread_once_t pipe_once = PTHREAD_ONCE_INIT;
static __thread struct fe_engine *splice_for; /* this thread splices for it: counts */
static __thread struct reply_pipe *tpipe;     /* its pipe (also pipe_key's value) */

static void pipe_close(void *arg)
{
    struct reply_pipe *p = arg;
    close(p->rd);
    close(p->wr);
    free(p);
}

static void pipe_key_make(void) { (void)pthread_key_create(&pipe_key, pipe_close); }

/* A pipe as large as this process may make (FE_PIPE_WANT, else fs.pipe-max-size), or
 * NULL. */
static struct reply_pipe *pipe_open(void)
{
    int fd[2];
    if (pipe2(fd, O_CLOEXEC | O_NONBLOCK) < 0)
        return NULL;
    int got = fcntl(fd[1], F_SETPIPE_SZ, FE_PIPE_WANT);
    if (got < 0)
        got = fcntl(fd[1], F_SETPIPE_SZ, 1 << 20);
    if (got < 0)
        got = fcntl(fd[1], F_GETPIPE_SZ);
    struct reply_pipe *p = got > 0 ? malloc(sizeof *p) : NULL;
    if (!p) {
        close(fd[0]);
        close(fd[1]);
        return NULL;
    }
    *p = (struct reply_pipe){.rd = fd[0],
                             .wr = fd[1],
                             .pages = (size_t)got / (size_t)sysconf(_SC_PAGESIZE)};
    return p;
}

static void pipe_drop(void)
{
    pthread_setspecific(pipe_key, NULL);
    pipe_close(tpipe);
    tpipe = NULL;
}

size_t fe_splice_room(void)
{
    struct reply_pipe *p = pipe_open();
    if (!p)
        return 0;
    size_t room = (p->pages - 1) * (size_t)sysconf(_SC_PAGESIZE); /* a header's page */
    pipe_close(p);
    return room;
}

void fe_reply_thread(struct fe_engine *e) { splice_for = e->opt.splice ? e : NULL; }

/* ``iov[0..n)``, ``len`` bytes, spliced to ``fd``: 1 sent; 0 not (writev it: too small,
 * no pipe, more pages than the pipe holds, or vmsplice refused); -errno: splice failed
 * (ENOENT: the request was interrupted, as writev would say; any other error: the
 * caller writes the reply instead, and the kernel takes it or says ENOENT). */
static int splice_reply(int fd, const struct iovec *iov, int n, size_t len)
{
    struct fe_engine *e = splice_for;
    if (!e || len < FE_SPLICE_MIN)
        return 0;
    if (!tpipe) {
        pthread_once(&pipe_once, pipe_key_make);
        if (!(tpipe = pipe_open())) {
            splice_for = NULL; /* none now: none later (no fds, or no pipes) */
            return 0;
        }
        pthread_setspecific(pipe_key, tpipe);
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = 0;
    for (int i = 0; i < n; i++) {
        uintptr_t a = (uintptr_t)iov[i].iov_base;
        pages += (a + iov[i].iov_len + page - 1) / page - a / page;
    }
    if (pages > tpipe->pages)
        return 0;
    ssize_t v = vmsplice(tpipe->wr, iov, (unsigned long)n, SPLICE_F_NONBLOCK);
    if (v != (ssize_t)len) {
        pipe_drop(); /* part of it may be in the pipe */
        return 0;
    }
    ssize_t s;
    do /* EINTR: nothing was taken from the pipe */
        s = splice(tpipe->rd, NULL, fd, NULL, len, 0);
    while (s < 0 && errno == EINTR);
    if (s == (ssize_t)len) {
        atomic_fetch_add_explicit(&e->spliced, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->spliced_bytes, len, memory_order_relaxed);
        return 1;
    }
    int err = s < 0 ? errno : EIO;
    pipe_drop();
    return -err;
}

/* ``iov[0]`` is left for the header; the payload is iov[1..n). */
int reply_iov(int fd, uint64_t unique, struct iovec *iov, int n)
{
    if (fd < 0)
        return ring_reply(fd, unique, 0, iov, n);
    struct fuse_out_header h = {.error = 0, .unique = unique};
    size_t len = sizeof h;
    for (int i = 1; i < n; i++)
        len += iov[i].iov_len;
    h.len = (uint32_t)len;
    iov[0].iov_base = &h;
    iov[0].iov_len = sizeof h;
    int spliced = splice_reply(fd, iov, n, len);
    if (spliced > 0 || spliced == -ENOENT)
        return spliced > 0 ? 0 : spliced;
    return write_reply(fd, iov, n); /* not spliced, or the splice failed */
}

int reply_buf(int fd, uint64_t unique, const void *buf, size_t len)
{
    struct iovec iov[2] = {{0}, {(void *)buf, len}};
    return reply_iov(fd, unique, iov, len ? 2 : 1);
}

int fe_reply_error(int fd, uint64_t unique, int err)
{
    if (fd < 0)
        return ring_reply(fd, unique, err, NULL, 1);
    struct fuse_out_header h = {.len = sizeof h, .error = -err, .unique = unique};
    struct iovec iov = {&h, sizeof h};
    return write_reply(fd, &iov, 1);
}

int fe_reply_data(int fd, uint64_t unique, const void *buf, size_t len)
{
    return reply_buf(fd, unique, buf, len);
}

int fe_reply_iov(int fd, uint64_t unique, const void *const *bufs, const size_t *lens, int n)
{
    if (n < 0 || n > FE_MAX_IOV)
        return -EINVAL;
    struct iovec iov[FE_MAX_IOV + 1];
    for (int i = 0; i < n; i++)
        iov[i + 1] = (struct iovec){(void *)bufs[i], lens[i]};
    return reply_iov(fd, unique, iov, n + 1);
}

int fe_reply_xattr_size(int fd, uint64_t unique, uint32_t size)
{
    struct fuse_getxattr_out o = {.size = size};
    return reply_buf(fd, unique, &o, sizeof o);
}

int fe_notify_store(int fd, uint64_t nodeid, uint64_t offset, const void *buf, size_t len)
{
    struct fuse_out_header h = {.error = FUSE_NOTIFY_STORE, .unique = 0};
    struct fuse_notify_store_out o = {.nodeid = nodeid,
                                      .offset = offset,
                                      .size = (uint32_t)len};
    struct iovec iov[3] = {{&h, sizeof h}, {&o, sizeof o}, {(void *)buf, len}};
    h.len = (uint32_t)(sizeof h + sizeof o + len);
    return write_reply(fd, iov, 3);
}

int fe_notify_resend(int fd)
{
    struct fuse_out_header h = {.len = sizeof h, .error = FE_NOTIFY_RESEND, .unique = 0};
    struct iovec iov = {&h, sizeof h};
    return write_reply(fd, &iov, 1);
}
