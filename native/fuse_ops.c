/* fuse_ops.c — dispatch and the operations answered from the index: attributes, one
 * handler per opcode (READ's is fuse_read.c), each request counted with its latency. */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>

int is_dir(uint32_t mode) { return S_ISDIR(mode); }

/* -------------------------------------------------------------------- attributes */

int valid_entry(const struct fe_engine *e, uint64_t nodeid, uint64_t *entry)
{
    if (nodeid == 0 || nodeid > e->ix.entries)
        return 0;
    *entry = nodeid - 1;
    return 1;
}

static void split_time(double t, uint64_t *sec, uint32_t *nsec)
{
    if (t <= 0) {
        *sec = 0;
        *nsec = 0;
        return;
    }
    *sec = (uint64_t)t;
    *nsec = (uint32_t)((t - (double)*sec) * 1e9);
}

/* st_nlink of a directory: 2 + its subdirectories, counted at its first GETATTR and kept
 * (racing threads store the same value). Counting every directory at start touched every
 * entry's mode, i.e. all of a paged manifest's index. */
static uint32_t dir_nlink(const struct fe_engine *e, uint64_t entry)
{
    const struct fe_index *ix = &e->ix;
    uint32_t n = __atomic_load_n(&e->nlink[entry], __ATOMIC_RELAXED);
    if (n)
        return n;
    uint64_t first = ix->data[entry], count = ix->size[entry];
    if (first > ix->entries)
        first = ix->entries;
    if (count > ix->entries - first)
        count = ix->entries - first;
    n = 2;
    for (uint64_t c = first; c < first + count; c++)
        if (is_dir(ix->mode[c]))
            n++;
    __atomic_store_n(&e->nlink[entry], n, __ATOMIC_RELAXED);
    return n;
}

static void fill_attr(const struct fe_engine *e, uint64_t entry, struct fuse_attr *a)
{
    const struct fe_index *ix = &e->ix;
    uint32_t mode = ix->mode[entry];
    memset(a, 0, sizeof *a);
    a->ino = entry + 1;
    a->size = is_dir(mode) ? 4096 : ix->size[entry];
    a->blocks = (a->size + 511) / 512;
    int64_t t = ix->mtime_ns[entry];
    int64_t sec = t / 1000000000, nsec = t % 1000000000;
    if (nsec < 0) {
        nsec += 1000000000;
        sec -= 1;
    }
    a->atime = a->mtime = a->ctime = (uint64_t)sec;
    a->atimensec = a->mtimensec = a->ctimensec = (uint32_t)nsec;
    a->mode = mode;
    a->nlink = is_dir(mode) ? dir_nlink(e, entry) : 1;
    a->uid = ix->uid[entry];
    a->gid = ix->gid[entry];
    a->blksize = e->blksize;
}

static void fill_entry(const struct fe_engine *e, uint64_t entry, struct fuse_entry_out *o)
{
    memset(o, 0, sizeof *o);
    o->nodeid = entry + 1;
    o->generation = e->opt.generation;
    split_time(e->opt.entry_timeout, &o->entry_valid, &o->entry_valid_nsec);
    split_time(e->opt.attr_timeout, &o->attr_valid, &o->attr_valid_nsec);
    fill_attr(e, entry, &o->attr);
}

/* Name of ``entry`` (bounds-checked; NULL if the index points outside its names). */
static const uint8_t *entry_name(const struct fe_engine *e, uint64_t entry, size_t *len)
{
    uint64_t off = e->ix.name_off[entry], n = e->ix.name_len[entry];
    if (off > e->ix.names_len || n > e->ix.names_len - off)
        return NULL;
    *len = (size_t)n;
    return e->ix.names + off;
}

/* The children of directory ``entry`` as [first, end), clipped to the index. */
static void children(const struct fe_engine *e, uint64_t entry, uint64_t *first, uint64_t *end)
{
    uint64_t f = e->ix.data[entry], n = e->ix.size[entry];
    if (f > e->ix.entries)
        f = e->ix.entries;
    if (n > e->ix.entries - f)
        n = e->ix.entries - f;
    *first = f;
    *end = f + n;
}

/* ---------------------------------------------------------------------- handlers */


static void count(struct fe_worker *w, int op, uint64_t t0, int err);

/* Count ``r`` (once) — before its reply, so a reader that sees the answer sees it counted
 * too, as pyfuse3's boundary.fuse_op does. */
void counted(struct req *r, int err)
{
    if (!r->counted) {
        count(r->w, r->op, r->t0, err);
        r->counted = 1;
    }
}

/* Answer the request ``w`` holds: into its ring entry, or on its /dev/fuse fd. ``err``
 * > 0 answers that errno; else ``iov[1..n)`` is the payload (iov[0] is the header's). */
int worker_reply(struct fe_worker *w, uint64_t unique, int err, struct iovec *iov, int n)
{
    /* fail closed: a page that could not be loaded reads as zeros, so an answer computed
     * since then may be wrong (checked after the answer was made, as fuse_op does) */
    const struct fe_options *o = &w->e->opt;
    if (!err && o->pages_failed && o->pages_failed(o->pages))
        err = EIO;
    if (w->ent)
        return ring_answer(w, unique, err, iov, n);
    if (err)
        return fe_reply_error(w->fd, unique, err);
    return reply_iov(w->fd, unique, iov, n);
}

/* Count, then answer ``r`` with ``buf`` (``err``: count it as the error the caller sees). */
int answer(struct req *r, const void *buf, size_t len, int err)
{
    counted(r, err);
    struct iovec iov[2] = {{0}, {(void *)buf, len}};
    return worker_reply(r->w, r->h->unique, 0, iov, len ? 2 : 1);
}

static int do_lookup(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t parent;
    if (!valid_entry(e, r->h->nodeid, &parent))
        return -ENOENT;
    if (!is_dir(e->ix.mode[parent]))
        return -ENOTDIR;
    size_t nlen = strnlen((const char *)r->arg, r->arglen);
    if (nlen > 255)
        return -ENAMETOOLONG;
    uint64_t lo, hi;
    children(e, parent, &lo, &hi);
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        size_t mlen;
        const uint8_t *m = entry_name(e, mid, &mlen);
        if (!m)
            return -EIO;
        int c = memcmp(m, r->arg, mlen < nlen ? mlen : nlen);
        if (c == 0)
            c = mlen < nlen ? -1 : mlen > nlen;
        if (c < 0)
            lo = mid + 1;
        else if (c > 0)
            hi = mid;
        else {
            struct fuse_entry_out o;
            fill_entry(e, mid, &o);
            return answer(r, &o, sizeof o, 0), 0;
        }
    }
    /* Not there, and never will be (the snapshot is immutable): a negative entry the
     * kernel caches for entry_timeout, so a second miss costs no request. */
    struct fuse_entry_out o = {0};
    split_time(e->opt.entry_timeout, &o.entry_valid, &o.entry_valid_nsec);
    answer(r, &o, sizeof o, 1);
    return REPLIED_ENOENT;
}

static int do_getattr(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    struct fuse_attr_out o = {0};
    split_time(e->opt.attr_timeout, &o.attr_valid, &o.attr_valid_nsec);
    fill_attr(e, entry, &o.attr);
    answer(r, &o, sizeof o, 0);
    return 0;
}

static int do_readlink(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (!S_ISLNK(e->ix.mode[entry]))
        return -EINVAL;
    uint64_t off = e->ix.data[entry], n = e->ix.size[entry];
    if (off > e->ix.names_len || n > e->ix.names_len - off)
        return -EIO;
    answer(r, e->ix.names + off, (size_t)n, 0);
    return 0;
}

/* A new handle in a free slot (NULL: out of memory). */
static struct fe_handle *handle_new(struct fe_engine *e)
{
    struct fe_handle *fh = calloc(1, sizeof *fh);
    if (!fh)
        return NULL;
    fh->prefetched_to = -1;
    pthread_mutex_init(&fh->lock, NULL);
    pthread_mutex_lock(&e->hlock);
    uint32_t i = 0;
    while (i < e->nhslots && e->hslots[i])
        i++;
    if (i == e->nhslots) {
        uint32_t n = e->nhslots ? e->nhslots * 2 : 64;
        struct fe_handle **t = realloc(e->hslots, n * sizeof *t);
        if (!t) {
            pthread_mutex_unlock(&e->hlock);
            pthread_mutex_destroy(&fh->lock);
            free(fh);
            return NULL;
        }
        memset(t + e->nhslots, 0, (n - e->nhslots) * sizeof *t);
        e->hslots = t;
        e->nhslots = n;
    }
    fh->fh = (uint64_t)++e->hgen << 32 | (i + 1);
    e->hslots[i] = fh;
    pthread_mutex_unlock(&e->hlock);
    return fh;
}

/* The handle the kernel calls ``id``, or NULL if it is not one of ours. The kernel
 * sends no READ on a handle after its RELEASE, so the pointer stays valid for the
 * request that asked. */
struct fe_handle *handle_get(struct fe_engine *e, uint64_t id)
{
    uint32_t i = (uint32_t)id;
    struct fe_handle *fh = NULL;
    pthread_mutex_lock(&e->hlock);
    if (i >= 1 && i <= e->nhslots && e->hslots[i - 1] && e->hslots[i - 1]->fh == id)
        fh = e->hslots[i - 1];
    pthread_mutex_unlock(&e->hlock);
    return fh;
}

static void handle_free(struct fe_engine *e, uint64_t id)
{
    uint32_t i = (uint32_t)id;
    struct fe_handle *fh = NULL;
    pthread_mutex_lock(&e->hlock);
    if (i >= 1 && i <= e->nhslots && e->hslots[i - 1] && e->hslots[i - 1]->fh == id) {
        fh = e->hslots[i - 1];
        e->hslots[i - 1] = NULL;
    }
    pthread_mutex_unlock(&e->hlock);
    if (fh) {
        pthread_mutex_destroy(&fh->lock);
        free(fh);
    }
}

static int do_open(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (r->arglen < sizeof(struct fuse_open_in))
        return -EINVAL;
    const struct fuse_open_in *in = (const void *)r->arg;
    if ((in->flags & O_ACCMODE) != O_RDONLY || (in->flags & (O_TRUNC | O_APPEND)))
        return -EROFS;
    if (is_dir(e->ix.mode[entry]))
        return -EISDIR;
    struct fe_handle *fh = handle_new(e);
    if (!fh)
        return -ENOMEM;
    struct fuse_open_out o = {.fh = fh->fh, .open_flags = FOPEN_KEEP_CACHE};
    if (answer(r, &o, sizeof o, 0) < 0)
        handle_free(e, fh->fh); /* interrupted: the kernel never sees this fh */
    return 0;
}

static int do_release(struct req *r)
{
    if (r->arglen >= sizeof(struct fuse_release_in)) {
        handle_free(r->w->e, ((const struct fuse_release_in *)r->arg)->fh);
    }
    answer(r, NULL, 0, 0);
    return 0;
}

static int do_opendir(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (!is_dir(e->ix.mode[entry]))
        return -ENOTDIR;
    /* the listing never changes: the kernel may cache it (and keep it across opens) */
    struct fuse_open_out o = {.fh = 0, .open_flags = FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR};
    answer(r, &o, sizeof o, 0);
    return 0;
}

static int do_readdir(struct req *r, int plus)
{
    struct fe_engine *e = r->w->e;
    uint64_t dir;
    if (!valid_entry(e, r->h->nodeid, &dir))
        return -ENOENT;
    if (!is_dir(e->ix.mode[dir]))
        return -ENOTDIR;
    if (r->arglen < sizeof(struct fuse_read_in))
        return -EINVAL;
    const struct fuse_read_in *in = (const void *)r->arg;
    size_t room = in->size < r->w->outlen ? in->size : r->w->outlen;
    uint64_t first, end;
    children(e, dir, &first, &end);
    size_t used = 0;
    for (uint64_t pos = in->offset; pos < end - first; pos++) {
        uint64_t child = first + pos;
        size_t nlen;
        const uint8_t *name = entry_name(e, child, &nlen);
        if (!name)
            return -EIO;
        size_t head = plus ? FUSE_NAME_OFFSET_DIRENTPLUS : FUSE_NAME_OFFSET;
        size_t rec = FUSE_DIRENT_ALIGN(head + nlen);
        if (used + rec > room)
            break;
        uint8_t *p = r->w->out + used;
        memset(p, 0, rec);
        struct fuse_dirent *d;
        if (plus) {
            struct fuse_direntplus *dp = (void *)p;
            fill_entry(e, child, &dp->entry_out);
            d = &dp->dirent;
        } else {
            d = (void *)p;
        }
        d->ino = child + 1;
        d->off = pos + 1;
        d->namelen = (uint32_t)nlen;
        d->type = (e->ix.mode[child] & S_IFMT) >> 12;
        memcpy(d->name, name, nlen);
        used += rec;
    }
    answer(r, r->w->out, used, 0);
    return 0;
}

static int do_statfs(struct req *r)
{
    struct fe_engine *e = r->w->e;
    struct fuse_statfs_out o = {0};
    o.st.bsize = o.st.frsize = 4096;
    o.st.blocks = (e->opt.dataset_bytes + 4095) / 4096;
    o.st.files = e->ix.entries;
    o.st.namelen = 255;
    answer(r, &o, sizeof o, 0);
    return 0;
}

static int do_xattr(struct req *r, int kind)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!e->opt.xattrs)
        return -ENOSYS; /* answered once: the kernel stops asking */
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (r->arglen < sizeof(struct fuse_getxattr_in))
        return -EINVAL;
    const struct fuse_getxattr_in *in = (const void *)r->arg;
    struct fe_request q = {
        .kind = kind,
        .xattr = {.unique = r->h->unique, .entry = entry, .size = in->size, .t0 = r->t0}};
    if (kind == FE_GETXATTR) {
        const char *name = (const char *)(in + 1);
        size_t n = strnlen(name, r->arglen - sizeof *in);
        if (n >= sizeof q.xattr.name)
            return -ERANGE;
        memcpy(q.xattr.name, name, n);
    }
    r->w->c.queued++;
    int rc = xattr_for_python(r->w, &q);
    return rc < 0 ? rc : QUEUED;
}

/* ---------------------------------------------------------------------- dispatch */

static const uint64_t bounds_ns[FE_BUCKETS - 1] = {100000,     250000,        500000,
                                                   1000000,    2500000,       5000000,
                                                   10000000,   25000000,      50000000,
                                                   100000000,  250000000,     500000000,
                                                   1000000000, 2500000000ULL, 10000000000ULL};

uint64_t fe_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

void count_into(struct fe_counters *c, int op, uint64_t t0, int err)
{
    uint64_t dt = fe_now_ns() - t0;
    int b = 0;
    while (b < FE_BUCKETS - 1 && dt > bounds_ns[b])
        b++;
    c->count[op]++;
    c->ns[op] += dt;
    c->buckets[op][b]++;
    if (err)
        c->errors[op]++;
}

static void count(struct fe_worker *w, int op, uint64_t t0, int err)
{
    count_into(&w->c, op, t0, err);
}

static void dispatch_one(struct fe_worker *w, const uint8_t *buf, size_t n, uint64_t t0);

void dispatch(struct fe_worker *w, const uint8_t *buf, size_t n)
{
    uint64_t t0 = fe_now_ns();
    dispatch_one(w, buf, n, t0);
    if (!w->ent && n >= sizeof(struct fuse_in_header))
        crowd_note(w, ((const struct fuse_in_header *)buf)->pid, t0);
}

static void dispatch_one(struct fe_worker *w, const uint8_t *buf, size_t n, uint64_t t0)
{
    if (n < sizeof(struct fuse_in_header))
        return;
    const struct fuse_in_header *h = (const void *)buf;
    struct req r = {w, h, buf + sizeof *h, n - sizeof *h, FE_OP_OTHER, t0, 0};
    if (!w->ent) {
        solo_note(w, h, n, r.t0);
        if (w != &w->e->workers[0])
            w->c.shared_requests++;
    }
    if (h->unique >> 63)
        w->c.resent++; /* a dead predecessor read it; the kernel sent it again */
    int rc;
    switch (h->opcode) {
    case FUSE_LOOKUP:
        r.op = FE_OP_LOOKUP;
        rc = do_lookup(&r);
        break;
    case FUSE_GETATTR:
        r.op = FE_OP_GETATTR;
        rc = do_getattr(&r);
        break;
    case FUSE_READLINK:
        r.op = FE_OP_READLINK;
        rc = do_readlink(&r);
        break;
    case FUSE_OPEN:
        r.op = FE_OP_OPEN;
        rc = do_open(&r);
        break;
    case FUSE_READ:
        r.op = FE_OP_READ;
        rc = do_read(&r);
        break;
    case FUSE_RELEASE:
        r.op = FE_OP_RELEASE;
        rc = do_release(&r);
        break;
    case FUSE_OPENDIR:
        r.op = FE_OP_OPENDIR;
        rc = do_opendir(&r);
        break;
    case FUSE_READDIR:
        r.op = FE_OP_READDIR;
        rc = do_readdir(&r, 0);
        break;
    case FUSE_READDIRPLUS:
        r.op = FE_OP_READDIR;
        rc = do_readdir(&r, 1);
        break;
    case FUSE_RELEASEDIR:
        r.op = FE_OP_RELEASEDIR;
        answer(&r, NULL, 0, 0);
        rc = 0;
        break;
    case FUSE_STATFS:
        r.op = FE_OP_STATFS;
        rc = do_statfs(&r);
        break;
    case FUSE_GETXATTR:
        r.op = FE_OP_GETXATTR;
        rc = do_xattr(&r, FE_GETXATTR);
        break;
    case FUSE_LISTXATTR:
        r.op = FE_OP_LISTXATTR;
        rc = do_xattr(&r, FE_LISTXATTR);
        break;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET: /* inodes are entry numbers: nothing to forget */
        w->c.count[FE_OP_FORGET]++;
        return;
    case FUSE_INTERRUPT: /* requests are short or queued; the reply comes anyway */
    case FUSE_NOTIFY_REPLY:
        return;
    case FUSE_DESTROY:
        r.op = FE_OP_OTHER;
        answer(&r, NULL, 0, 0);
        rc = 0;
        break;
    case FUSE_SETATTR:
    case FUSE_SYMLINK:
    case FUSE_MKNOD:
    case FUSE_MKDIR:
    case FUSE_UNLINK:
    case FUSE_RMDIR:
    case FUSE_RENAME:
    case FUSE_LINK:
    case FUSE_WRITE:
    case FUSE_SETXATTR:
    case FUSE_REMOVEXATTR:
    case FUSE_CREATE:
    case FUSE_FALLOCATE:
    case FUSE_RENAME2:
    case FUSE_COPY_FILE_RANGE:
    case FUSE_TMPFILE:
        r.op = FE_OP_EROFS;
        rc = -EROFS;
        break;
    default: /* flush, fsync, locks, ioctl, lseek, …: the kernel's own */
        r.op = FE_OP_ENOSYS;
        rc = -ENOSYS;
        break;
    }
    if (rc < 0) {
        counted(&r, r.op != FE_OP_ENOSYS);
        worker_reply(w, h->unique, -rc, NULL, 1);
    } else if (rc != QUEUED) {
        counted(&r, 0); /* answered without answer(): nothing to count late */
    }
}
