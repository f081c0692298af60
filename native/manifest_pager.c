/* manifest_pager.c — the page map (manifest_pager.h has the contract).
 *
 * Per page, one state under m->lock: ABSENT (no PTEs: a touch faults), FILLING (one
 * handler is loading it; further faults on it need nothing, since that handler's
 * UFFDIO_COPY wakes every thread waiting in its range), RESIDENT (filled, in the FIFO).
 * State and PTEs agree whenever the lock is free, but for FILLING: a page only becomes
 * RESIDENT after its copy succeeded, and is dropped (MADV_DONTNEED) under the lock as it
 * turns ABSENT. So a fault message for a RESIDENT page is one that raced with the fill
 * (its thread was woken by it or never slept): UFFDIO_WAKE, nothing to load.
 *
 * Loading runs outside the lock, in the handler's own buffers (one set per thread: the
 * compressed file, the inflated page, a libdeflate decompressor and a SHA-256 context), so the threads
 * load different pages in parallel.
 */
#define _GNU_SOURCE
#include "manifest_pager.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <libdeflate.h>
#include <zlib.h>

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

enum { ABSENT = 0, FILLING = 1, RESIDENT = 2 };

struct worker {
    struct mp *m;
    pthread_t thread;
    int started;
    struct libdeflate_decompressor *z;
    EVP_MD_CTX *md;
    uint8_t *in;  /* the page file: up to in_cap bytes (one more read says it is longer) */
    uint8_t *out; /* the inflated page, then zeros to the system page: page_size + sys_page */
    char path[4096];
    char why[MP_FAILURE_LEN - 256]; /* the failure message's tail: every dir's reason */
};

struct mp {
    uint8_t *base;
    size_t size, map_len, page_size, sys_page, npages, in_cap;
    uint8_t *hashes;
    char **dirs;
    size_t ndirs;
    char *ask; /* the node's ask socket, or NULL */
    int ask_ms;
    int uffd, stopfd, user_mode_only, zeropage;
    EVP_MD *sha256; /* fetched once (OpenSSL 3: an implicit fetch per init costs) */
    int nthreads;
    struct worker *w;

    pthread_mutex_t lock; /* state, fifo */
    uint8_t *state;       /* per page: ABSENT, FILLING, RESIDENT */
    uint32_t *fifo;       /* RESIDENT pages, oldest filled first: a ring of fifo_cap */
    size_t fifo_cap, fifo_head, fifo_len;

    pthread_mutex_t fail_lock; /* the first failure's message, then the flag */
    atomic_int failed;
    char failure[MP_FAILURE_LEN];

    atomic_uint_fast64_t faults, fills, evictions, failures, fill_ns, resident;
    atomic_uint_fast64_t read_ns, inflate_ns, sha_ns, copy_ns; /* handlers' CPU time */
    atomic_uint_fast64_t asks;
};

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* The calling thread's CPU time: a fill's parts timed by it are what the handler spent on
 * them, whatever else the machine runs (~0.2 us a call: 5 calls a fill of ~150 us). */
static uint64_t cpu_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void add_ns(atomic_uint_fast64_t *c, uint64_t since, uint64_t *now)
{
    *now = cpu_ns();
    atomic_fetch_add_explicit(c, *now - since, memory_order_relaxed);
}

size_t mp_pages(size_t size, size_t page_size)
{
    return page_size ? size / page_size + (size % page_size != 0) : 0;
}

static size_t page_len(const struct mp *m, size_t i)
{
    size_t off = i * m->page_size;
    return m->size - off < m->page_size ? m->size - off : m->page_size;
}

/* The bytes of page i's range in the region: its length rounded up to the system page. */
static size_t page_span(const struct mp *m, size_t i)
{
    size_t n = page_len(m, i);
    return (n + m->sys_page - 1) / m->sys_page * m->sys_page;
}

/* ----------------------------------------------------------------- loading a page */

static const char hexd[] = "0123456789abcdef";

static void hex32(const uint8_t *h, char *out)
{
    for (int k = 0; k < MP_HASH_LEN; k++) {
        out[2 * k] = hexd[h[k] >> 4];
        out[2 * k + 1] = hexd[h[k] & 15];
    }
    out[2 * MP_HASH_LEN] = 0;
}

/* Append ``fmt`` to w->why (truncated, never overflowing). */
static void whyf(struct worker *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void whyf(struct worker *w, const char *fmt, ...)
{
    size_t n = strlen(w->why);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->why + n, sizeof w->why - n, fmt, ap);
    va_end(ap);
}

/* Read the page file at w->path into w->in: its length, or -1 with the reason appended.
 * O_NONBLOCK and the S_ISREG check: a FIFO (or a device) under a page's name must not
 * block the handler. */
static ssize_t read_file(struct worker *w)
{
    int fd = open(w->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        whyf(w, "%s", errno == ENOENT ? "missing" : strerror(errno));
        return -1;
    }
    struct stat st;
    int bad = fstat(fd, &st) < 0 ? errno : 0;
    if (bad || !S_ISREG(st.st_mode)) {
        whyf(w, "%s", bad ? strerror(bad) : "not a regular file");
        close(fd);
        return -1;
    }
    size_t n = 0;
    while (n <= w->m->in_cap) {
        ssize_t r = read(fd, w->in + n, w->m->in_cap + 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            whyf(w, "read: %s", strerror(errno));
            close(fd);
            return -1;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    if (n > w->m->in_cap) {
        whyf(w, "larger than a zlib stream of %zu bytes can be", w->m->page_size);
        return -1;
    }
    return (ssize_t)n;
}

/* Inflate w->in[0..n) into w->out: 0 when it is one zlib stream of exactly ``want``
 * bytes with nothing after it, else -1 with the reason appended. At most want + 1 bytes
 * are ever written (a stream that would inflate further stops there: no bomb). */
static int inflate_page(struct worker *w, size_t n, size_t want)
{
    size_t used = 0, got = 0;
    enum libdeflate_result rc = libdeflate_zlib_decompress_ex(w->z, w->in, n, w->out, want + 1,
                                                              &used, &got);
    if (rc == LIBDEFLATE_SUCCESS && got == want && used == n)
        return 0;
    if (rc == LIBDEFLATE_SUCCESS && got == want)
        whyf(w, "%zu bytes after the zlib stream", n - used);
    else if (rc == LIBDEFLATE_SUCCESS)
        whyf(w, "inflates to %zu bytes, not %zu", got, want);
    else if (rc == LIBDEFLATE_INSUFFICIENT_SPACE)
        whyf(w, "inflates to more than %zu bytes", want);
    else
        whyf(w, "bad or truncated zlib stream");
    return -1;
}

static int sha256_is(struct worker *w, size_t want, const uint8_t *hash)
{
    uint8_t d[EVP_MAX_MD_SIZE];
    unsigned int dl = 0;
    if (EVP_DigestInit_ex(w->md, w->m->sha256, NULL) != 1 ||
        EVP_DigestUpdate(w->md, w->out, want) != 1 || EVP_DigestFinal_ex(w->md, d, &dl) != 1 ||
        dl != MP_HASH_LEN) {
        whyf(w, "SHA-256 failed");
        return 0;
    }
    if (memcmp(d, hash, MP_HASH_LEN) != 0) {
        whyf(w, "SHA-256 mismatch");
        return 0;
    }
    return 1;
}

/* Page i's verified bytes into w->out (then zeros up to its span) from the first dir
 * that has them: 0, or -1 with every dir's reason appended to w->why. */
static int from_dirs(struct worker *w, size_t i)
{
    struct mp *m = w->m;
    const uint8_t *hash = m->hashes + i * MP_HASH_LEN;
    size_t want = page_len(m, i);
    char hex[2 * MP_HASH_LEN + 1];
    hex32(hash, hex);
    for (size_t d = 0; d < m->ndirs; d++) {
        whyf(w, "%s%s: ", d ? "; " : "", m->dirs[d]);
        int len = snprintf(w->path, sizeof w->path, "%s/%.2s/%s", m->dirs[d], hex, hex);
        if (len < 0 || (size_t)len >= sizeof w->path) {
            whyf(w, "path too long");
            continue;
        }
        uint64_t t0 = cpu_ns(), t;
        ssize_t n = read_file(w);
        add_ns(&m->read_ns, t0, &t);
        if (n < 0)
            continue;
        int bad = inflate_page(w, (size_t)n, want) < 0;
        add_ns(&m->inflate_ns, t, &t);
        if (bad)
            continue;
        bad = !sha256_is(w, want, hash);
        add_ns(&m->sha_ns, t, &t);
        if (bad)
            continue;
        memset(w->out + want, 0, page_span(m, i) - want);
        return 0;
    }
    return -1;
}

/* Ask the host's node for page i (mp_config.ask; the wire format: manifest/ask.py): 0 once
 * it answers that the first dir has it now, else -1 with the reason appended. Each step
 * bounded by ask_ms. */
static int ask_node(struct worker *w, size_t i)
{
    struct mp *m = w->m;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    struct timeval tv = {.tv_sec = m->ask_ms / 1000, .tv_usec = (m->ask_ms % 1000) * 1000};
    uint8_t req[MP_HASH_LEN + 8], ans = 1;
    uint64_t want = page_len(m, i);
    memcpy(req, m->hashes + i * MP_HASH_LEN, MP_HASH_LEN);
    for (int b = 0; b < 8; b++)
        req[MP_HASH_LEN + b] = (uint8_t)(want >> (8 * b));
    snprintf(a.sun_path, sizeof a.sun_path, "%s", m->ask);
    atomic_fetch_add_explicit(&m->asks, 1, memory_order_relaxed);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        whyf(w, "; ask: %s", strerror(errno));
        return -1;
    }
    ssize_t r = -1;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0 ||
        connect(fd, (struct sockaddr *)&a, sizeof a) < 0)
        whyf(w, "; ask %s: %s", m->ask, strerror(errno));
    else if (send(fd, req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req)
        whyf(w, "; ask %s: send: %s", m->ask, strerror(errno));
    else if ((r = recv(fd, &ans, 1, 0)) != 1)
        whyf(w, "; ask %s: %s", m->ask, r == 0 ? "closed" : strerror(errno));
    else if (ans != 0)
        whyf(w, "; ask %s: the node has none", m->ask);
    close(fd);
    return r == 1 && ans == 0 ? 0 : -1;
}

/* Page i's verified bytes into w->out (then zeros up to its span): from the dirs, else
 * from the first dir once the node was asked for it; 0, or -1 with the reasons in
 * w->why. */
static int load_page(struct worker *w, size_t i)
{
    w->why[0] = 0;
    if (from_dirs(w, i) == 0)
        return 0;
    if (!w->m->ask || ask_node(w, i) < 0)
        return -1;
    whyf(w, "; then ");
    return from_dirs(w, i);
}

/* ------------------------------------------------------------- into the region */

static int wake(struct mp *m, size_t i)
{
    struct uffdio_range r = {.start = (uintptr_t)(m->base + i * m->page_size),
                             .len = page_span(m, i)};
    return ioctl(m->uffd, UFFDIO_WAKE, &r);
}

/* Page i's range from ``src`` (NULL: zeros) by UFFDIO_COPY (or UFFDIO_ZEROPAGE) of the
 * whole range at once, waking no one yet (the caller wakes the range once the page's state
 * says it is there, so a thread that resumes sees the counters and the FIFO with it): 0,
 * or -errno. A system page already there (EEXIST: it cannot be, as only one handler fills
 * a page, but if it were its bytes would be these) is stepped over and the rest copied. */
static int place(struct mp *m, size_t i, const uint8_t *src)
{
    uintptr_t dst = (uintptr_t)(m->base + i * m->page_size);
    size_t len = page_span(m, i), off = 0;
    while (off < len) {
        int rc;
        long long done;
        if (src) {
            struct uffdio_copy c = {.dst = dst + off,
                                    .src = (uintptr_t)(src + off),
                                    .len = len - off,
                                    .mode = UFFDIO_COPY_MODE_DONTWAKE};
            rc = ioctl(m->uffd, UFFDIO_COPY, &c);
            done = c.copy;
        } else {
            struct uffdio_zeropage z = {.range = {.start = dst + off, .len = len - off},
                                        .mode = UFFDIO_ZEROPAGE_MODE_DONTWAKE};
            rc = ioctl(m->uffd, UFFDIO_ZEROPAGE, &z);
            done = z.zeropage;
        }
        if (rc == 0)
            break;
        int err = errno;
        if (done > 0)
            off += (size_t)done;
        if (err == EEXIST)
            off += m->sys_page;
        else if (err != EAGAIN)
            return -err; /* EAGAIN: a partial copy (or the mm changing), the rest again */
    }
    return 0;
}

/* Drop the oldest-filled pages until at most fifo_cap stay; m->lock held.
 *
 * Why FIFO (oldest filled) rather than LRU: a read of a filled page never reaches us (that
 * is the point of mapping it), so the only order we know is the order of fills; reading
 * the accessed bits of the PTEs would take a page-table walk per decision. A hot page
 * dropped this way costs one fault to come back, and with cache_bytes over the working
 * set that is rare.
 *
 * Dropping a page another thread is reading at that moment is safe: its next access
 * faults, the page is loaded again and verified against the same SHA-256, so the bytes
 * it sees are identical (the engine checks mp_failed after a read, for the one case in
 * which they would not be: the page could not be loaded the second time). */
static void evict_over(struct mp *m)
{
    while (m->fifo_len > m->fifo_cap) {
        size_t j = m->fifo[m->fifo_head];
        m->fifo_head = (m->fifo_head + 1) % (m->fifo_cap + 1);
        m->fifo_len--;
        madvise(m->base + j * m->page_size, page_span(m, j), MADV_DONTNEED);
        m->state[j] = ABSENT;
        atomic_fetch_add_explicit(&m->evictions, 1, memory_order_relaxed);
        atomic_fetch_sub_explicit(&m->resident, 1, memory_order_relaxed);
    }
}

static void record_failure(struct mp *m, struct worker *w, size_t i)
{
    pthread_mutex_lock(&m->fail_lock);
    if (!atomic_load(&m->failed)) {
        char hex[2 * MP_HASH_LEN + 1];
        hex32(m->hashes + i * MP_HASH_LEN, hex);
        snprintf(m->failure, sizeof m->failure,
                 "manifest page %zu of %zu (sha256 %s) could not be loaded: %s", i, m->npages,
                 hex, w->why);
        for (char *p = m->failure; *p; p++) /* one line, whatever a dir's name holds */
            if (*p == '\n' || *p == '\r')
                *p = ' ';
        atomic_store(&m->failed, 1); /* seq_cst, and before the zeros are placed */
    }
    pthread_mutex_unlock(&m->fail_lock);
    atomic_fetch_add_explicit(&m->failures, 1, memory_order_relaxed);
}

static void handle_fault(struct worker *w, uintptr_t addr)
{
    struct mp *m = w->m;
    uint64_t t0 = now_ns();
    atomic_fetch_add_explicit(&m->faults, 1, memory_order_relaxed);
    if (addr < (uintptr_t)m->base || addr >= (uintptr_t)m->base + m->map_len)
        return;
    size_t i = (addr - (uintptr_t)m->base) / m->page_size;
    pthread_mutex_lock(&m->lock);
    int s = m->state[i];
    if (s == ABSENT)
        m->state[i] = FILLING;
    pthread_mutex_unlock(&m->lock);
    if (s == RESIDENT)
        wake(m, i);
    if (s != ABSENT)
        return;

    int ok = load_page(w, i) == 0, rc = -1;
    if (ok) {
        uint64_t c0 = cpu_ns(), c;
        rc = place(m, i, w->out);
        add_ns(&m->copy_ns, c0, &c);
    }
    if (rc < 0 && ok) {
        w->why[0] = 0;
        whyf(w, "UFFDIO_COPY: %s", strerror(-rc));
        ok = 0;
    }
    if (!ok) {
        record_failure(m, w, i);
        if (m->zeropage) {
            rc = place(m, i, NULL);
        } else {
            memset(w->out, 0, page_span(m, i));
            rc = place(m, i, w->out);
        }
    }

    pthread_mutex_lock(&m->lock);
    if (rc < 0) {
        m->state[i] = ABSENT; /* nothing placed (out of memory) */
    } else {
        m->state[i] = RESIDENT;
        m->fifo[(m->fifo_head + m->fifo_len) % (m->fifo_cap + 1)] = (uint32_t)i;
        m->fifo_len++;
        atomic_fetch_add_explicit(&m->resident, 1, memory_order_relaxed);
        evict_over(m);
    }
    if (ok && rc == 0)
        atomic_fetch_add_explicit(&m->fills, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->fill_ns, now_ns() - t0, memory_order_relaxed);
    pthread_mutex_unlock(&m->lock);
    wake(m, i); /* every thread that faulted in the page: it is there (or, rc < 0, absent
                 * again, and the thread faults again and is retried) */
}

static void *handler_main(void *arg)
{
    struct worker *w = arg;
    struct mp *m = w->m;
    for (;;) {
        struct pollfd p[2] = {{.fd = m->uffd, .events = POLLIN},
                              {.fd = m->stopfd, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno != EINTR)
                usleep(1000); /* never give up: a faulting thread would wait forever */
            continue;
        }
        if (p[1].revents)
            return NULL; /* the eventfd stays readable: every thread sees it */
        if (p[0].revents & (POLLERR | POLLNVAL)) {
            usleep(1000); /* not after the handshake; were it so, no busy loop */
            continue;
        }
        struct uffd_msg msg;
        ssize_t r = read(m->uffd, &msg, sizeof msg);
        if (r != (ssize_t)sizeof msg)
            continue; /* EAGAIN: another handler took it */
        if (msg.event == UFFD_EVENT_PAGEFAULT)
            handle_fault(w, (uintptr_t)msg.arg.pagefault.address);
    }
}

/* ------------------------------------------------------------------- open, close */

static void free_workers(struct mp *m)
{
    for (int t = 0; m->w && t < m->nthreads; t++) {
        struct worker *w = &m->w[t];
        libdeflate_free_decompressor(w->z);
        EVP_MD_CTX_free(w->md);
        free(w->in);
        free(w->out);
    }
    free(m->w);
}

static void free_mp(struct mp *m)
{
    free_workers(m);
    for (size_t d = 0; m->dirs && d < m->ndirs; d++)
        free(m->dirs[d]);
    free(m->dirs);
    free(m->ask);
    free(m->hashes);
    free(m->state);
    free(m->fifo);
#if OPENSSL_VERSION_MAJOR >= 3
    EVP_MD_free(m->sha256);
#endif
    if (m->uffd >= 0)
        close(m->uffd);
    if (m->stopfd >= 0)
        close(m->stopfd);
    free(m);
}

static void stop_threads(struct mp *m)
{
    uint64_t one = 1;
    ssize_t wr = write(m->stopfd, &one, sizeof one); /* cannot fail: one add */
    (void)wr;
    for (int t = 0; t < m->nthreads; t++)
        if (m->w[t].started)
            pthread_join(m->w[t].thread, NULL);
}

static void unmap(struct mp *m)
{
    struct uffdio_range r = {.start = (uintptr_t)m->base, .len = m->map_len};
    ioctl(m->uffd, UFFDIO_UNREGISTER, &r);
    munmap(m->base, m->map_len);
}

/* A userfaultfd past the UFFDIO_API handshake: full mode if allowed, else user-mode
 * only (*umo = 1). -errno and ``why`` if neither. */
static int make_uffd(int *umo, char *why, size_t whylen)
{
    int flags = O_CLOEXEC | O_NONBLOCK;
    *umo = 0;
    int fd = (int)syscall(SYS_userfaultfd, flags);
    if (fd < 0 && errno == EPERM) {
        fd = (int)syscall(SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY);
        *umo = 1;
    }
    if (fd < 0) {
        int err = errno;
        snprintf(why, whylen,
                 "userfaultfd: %s (neither full nor user-mode-only fault handling is "
                 "allowed here: vm.unprivileged_userfaultfd, seccomp or the kernel's "
                 "CONFIG_USERFAULTFD)",
                 strerror(err));
        return -err;
    }
    struct uffdio_api api = {.api = UFFD_API, .features = 0};
    if (ioctl(fd, UFFDIO_API, &api) < 0 || api.api != UFFD_API) {
        int err = errno ? errno : EPROTO;
        snprintf(why, whylen, "UFFDIO_API: %s", strerror(err));
        close(fd);
        return -err;
    }
    uint64_t need = 1ull << _UFFDIO_REGISTER | 1ull << _UFFDIO_UNREGISTER;
    if ((api.ioctls & need) != need) {
        snprintf(why, whylen, "UFFDIO_API: no UFFDIO_REGISTER/UNREGISTER");
        close(fd);
        return -EOPNOTSUPP;
    }
    return fd;
}

static int check_config(const struct mp_config *cfg, size_t sys_page, char *why, size_t whylen)
{
    if (!cfg->size)
        snprintf(why, whylen, "size must be > 0");
    else if (!cfg->page_size || cfg->page_size % sys_page || cfg->page_size > (1u << 30))
        snprintf(why, whylen, "page_size %zu: not a multiple of %zu up to 1 GiB",
                 cfg->page_size, sys_page);
    else if (mp_pages(cfg->size, cfg->page_size) > UINT32_MAX)
        snprintf(why, whylen, "more than 2^32 pages");
    else if (cfg->size > SIZE_MAX - cfg->page_size)
        snprintf(why, whylen, "size too large");
    else if (!cfg->ndirs)
        snprintf(why, whylen, "no dirs");
    else if (cfg->threads < 1 || cfg->threads > MP_MAX_THREADS)
        snprintf(why, whylen, "threads %d: not in 1..%d", cfg->threads, MP_MAX_THREADS);
    else if (cfg->ask && (strlen(cfg->ask) >= sizeof((struct sockaddr_un *)0)->sun_path ||
                          cfg->ask_ms < 1 || cfg->ask_ms > 60000))
        snprintf(why, whylen, "ask: a unix socket path and ask_ms in 1..60000");
    else
        return 0;
    return -EINVAL;
}

static int alloc_workers(struct mp *m)
{
    m->w = calloc((size_t)m->nthreads, sizeof *m->w);
    if (!m->w)
        return -ENOMEM;
    for (int t = 0; t < m->nthreads; t++) {
        struct worker *w = &m->w[t];
        w->m = m;
        w->md = EVP_MD_CTX_new();
        w->in = malloc(m->in_cap + 1);
        if (posix_memalign((void **)&w->out, m->sys_page, m->page_size + m->sys_page))
            w->out = NULL;
        w->z = libdeflate_alloc_decompressor();
        if (!w->md || !w->in || !w->out || !w->z)
            return -ENOMEM;
    }
    return 0;
}

/* Map and register the region; 0 or -errno with ``why``. */
static int map_region(struct mp *m, char *why, size_t whylen)
{
    m->base = mmap(NULL, m->map_len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m->base == MAP_FAILED) {
        m->base = NULL;
        int err = errno;
        snprintf(why, whylen, "mmap of %zu bytes: %s", m->map_len, strerror(err));
        return -err;
    }
    /* MADV_DONTFORK: see the header ("Fork"). MADV_NOHUGEPAGE: pages stay 4 KiB PTEs, so
     * a dropped page is 16 PTEs zapped, never a huge page split. PROT_READ only: UFFDIO_COPY
     * and UFFDIO_ZEROPAGE fill a read-only private mapping (the PTE is made writable only
     * if the VMA is: mm/userfaultfd.c, mfill_atomic_install_pte; checked on 6.18 by
     * tests/unit/test_manifest_pager.py), so no write of ours or a reader's can land. */
    struct uffdio_register reg = {.range = {.start = (uintptr_t)m->base, .len = m->map_len},
                                  .mode = UFFDIO_REGISTER_MODE_MISSING};
    uint64_t need = 1ull << _UFFDIO_COPY | 1ull << _UFFDIO_WAKE;
    int err = 0;
    if (madvise(m->base, m->map_len, MADV_DONTFORK) < 0 ||
        ioctl(m->uffd, UFFDIO_REGISTER, &reg) < 0)
        err = errno;
    else if ((reg.ioctls & need) != need)
        err = EOPNOTSUPP;
    if (err) {
        snprintf(why, whylen, "UFFDIO_REGISTER of %zu bytes: %s", m->map_len, strerror(err));
        munmap(m->base, m->map_len);
        m->base = NULL;
        return -err;
    }
    madvise(m->base, m->map_len, MADV_NOHUGEPAGE); /* advice only: fine if refused */
    m->zeropage = (reg.ioctls & (1ull << _UFFDIO_ZEROPAGE)) != 0;
    return 0;
}

static int start_threads(struct mp *m)
{
    /* the handlers take no signal: the process's signals go to threads that run Python */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = 0;
    for (int t = 0; t < m->nthreads && !err; t++) {
        err = pthread_create(&m->w[t].thread, NULL, handler_main, &m->w[t]);
        m->w[t].started = !err;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return -err;
}

int mp_open(const struct mp_config *cfg, struct mp **out, char *why, size_t whylen)
{
    size_t sys_page = (size_t)sysconf(_SC_PAGESIZE);
    int rc = check_config(cfg, sys_page, why, whylen);
    if (rc < 0)
        return rc;
    struct mp *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(why, whylen, "out of memory");
        return -ENOMEM;
    }
    m->uffd = m->stopfd = -1;
    m->size = cfg->size;
    m->page_size = cfg->page_size;
    m->sys_page = sys_page;
    m->npages = mp_pages(cfg->size, cfg->page_size);
    m->map_len = (cfg->size + sys_page - 1) / sys_page * sys_page;
    /* zlib's bound for one deflate call over the page (Python's zlib.compress), with a
     * little slack; a longer file is not such a stream */
    m->in_cap = compressBound((uLong)cfg->page_size) + 256;
    m->nthreads = cfg->threads;
    size_t cap = cfg->cache_bytes / cfg->page_size;
    m->fifo_cap = cap < 1 ? 1 : cap > m->npages ? m->npages : cap;
    m->hashes = malloc(m->npages * MP_HASH_LEN);
    m->dirs = calloc(cfg->ndirs, sizeof *m->dirs);
    m->state = calloc(m->npages, 1);
    m->fifo = calloc(m->fifo_cap + 1, sizeof *m->fifo);
#if OPENSSL_VERSION_MAJOR >= 3
    m->sha256 = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
    m->sha256 = (EVP_MD *)EVP_sha256();
#endif
    m->ask = cfg->ask ? strdup(cfg->ask) : NULL;
    m->ask_ms = cfg->ask_ms;
    rc = m->hashes && m->dirs && m->state && m->fifo && (m->ask || !cfg->ask) ? 0 : -ENOMEM;
    for (size_t d = 0; !rc && d < cfg->ndirs; d++, m->ndirs++)
        if (!(m->dirs[d] = strdup(cfg->dirs[d])))
            rc = -ENOMEM;
    if (!rc)
        rc = alloc_workers(m);
    if (rc < 0) {
        snprintf(why, whylen, "out of memory");
        free_mp(m);
        return rc;
    }
    if (!m->sha256) {
        snprintf(why, whylen, "OpenSSL has no SHA256");
        free_mp(m);
        return -EOPNOTSUPP;
    }
    memcpy(m->hashes, cfg->hashes, m->npages * MP_HASH_LEN);
    pthread_mutex_init(&m->lock, NULL);
    pthread_mutex_init(&m->fail_lock, NULL);

    m->uffd = rc = make_uffd(&m->user_mode_only, why, whylen);
    if (rc >= 0) {
        m->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (m->stopfd < 0) {
            rc = -errno;
            snprintf(why, whylen, "eventfd: %s", strerror(-rc));
        }
    }
    if (rc >= 0)
        rc = map_region(m, why, whylen);
    if (rc >= 0 && (rc = start_threads(m)) < 0) {
        snprintf(why, whylen, "pthread_create: %s", strerror(-rc));
        stop_threads(m);
        unmap(m);
    }
    if (rc < 0) {
        pthread_mutex_destroy(&m->lock);
        pthread_mutex_destroy(&m->fail_lock);
        free_mp(m);
        return rc;
    }
    *out = m;
    return 0;
}

void mp_close(struct mp *m)
{
    if (!m)
        return;
    stop_threads(m);
    unmap(m);
    pthread_mutex_destroy(&m->lock);
    pthread_mutex_destroy(&m->fail_lock);
    free_mp(m);
}

void mp_abandon(struct mp *m)
{
    if (m)
        free_mp(m); /* the handlers' buffers and decompressors here are the child's copies */
}

void *mp_base(const struct mp *m) { return m->base; }

size_t mp_size(const struct mp *m) { return m->size; }

int mp_user_mode_only(const struct mp *m) { return m->user_mode_only; }

int mp_failed(const struct mp *m) { return atomic_load(&((struct mp *)m)->failed); }

const char *mp_failure(const struct mp *m) { return mp_failed(m) ? m->failure : NULL; }

void mp_get_stats(const struct mp *m, struct mp_stats *st)
{
    struct mp *mm = (struct mp *)m;
    st->faults = atomic_load_explicit(&mm->faults, memory_order_relaxed);
    st->fills = atomic_load_explicit(&mm->fills, memory_order_relaxed);
    st->evictions = atomic_load_explicit(&mm->evictions, memory_order_relaxed);
    st->resident_pages = atomic_load_explicit(&mm->resident, memory_order_relaxed);
    st->failures = atomic_load_explicit(&mm->failures, memory_order_relaxed);
    st->asks = atomic_load_explicit(&mm->asks, memory_order_relaxed);
    st->fill_ns = atomic_load_explicit(&mm->fill_ns, memory_order_relaxed);
    st->read_ns = atomic_load_explicit(&mm->read_ns, memory_order_relaxed);
    st->inflate_ns = atomic_load_explicit(&mm->inflate_ns, memory_order_relaxed);
    st->sha_ns = atomic_load_explicit(&mm->sha_ns, memory_order_relaxed);
    st->copy_ns = atomic_load_explicit(&mm->copy_ns, memory_order_relaxed);
    st->user_mode_only = m->user_mode_only;
}
