/*
 * ramfs_c: a do-nothing read-only FUSE filesystem in C (libfuse3 low level) that
 * serves a copy of a source directory from RAM. It is the benchmark suite's ceiling
 * of *any* FUSE daemon on this machine: no Python, no locks,
 * every byte already in memory, one fuse_reply_buf per READ, the session loop
 * that is fastest here (single-threaded by default; see main()).
 *
 * A file's bytes start on a page: the kernel copies a reply into the page cache a page
 * at a time, and malloc's 16-byte-aligned bytes made every page two short copies. With
 * malloc this daemon used 0.165-0.186 CPU-s per GB of psync 1 MiB sequential reads,
 * page-aligned 0.144-0.151 (3 alternating rounds of 4 passes; the suite's ceiling was
 * once the malloc'd one, and kspeedfs's chunks were misaligned alike).
 *
 * Usage: ramfs_c SOURCE MOUNTPOINT        (stays in the foreground; fusermount3 -u stops it)
 *
 * It makes the same promises to the kernel as kspeedfs: read-only, entry/attr
 * timeouts of a day, keep_cache on every open, READDIRPLUS always (pyfuse3 clears
 * READDIRPLUS_AUTO, so we do too). The sysfs knobs (max_background,
 * congestion_threshold, read_ahead_kb) are set by the suite after the mount is live,
 * with the same values as kspeedfs, through kspeedfs.fuse.tuning.
 *
 * Layout: one array of nodes, inode = index + 1 (FUSE_ROOT_ID = 1 is the source
 * root). A directory's children are sorted by name, so lookup is a binary search,
 * and a 10^6-entry directory costs log2(10^6) compares per lookup. Nothing changes
 * after loading, so no locks: every handler only reads.
 *
 * Build: gcc -O2 -Wall ramfs_c.c $(pkg-config --cflags --libs fuse3) -o ramfs_c
 */
#define FUSE_USE_VERSION 34
#define _GNU_SOURCE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TIMEOUT 86400.0

struct node {
    char *name;            /* NUL-terminated; "" for the root */
    struct stat st;        /* st_ino rewritten to our inode number */
    char *data;            /* file bytes or symlink target */
    size_t *children;      /* directories: node indexes, sorted by name */
    size_t nchildren;
};

static struct node *nodes;
static size_t nnodes, cap;

static size_t add_node(const char *name, const struct stat *st)
{
    if (nnodes == cap) {
        cap = cap ? cap * 2 : 1024;
        nodes = realloc(nodes, cap * sizeof(*nodes));
        if (!nodes) { perror("realloc"); exit(1); }
    }
    struct node *n = &nodes[nnodes];
    memset(n, 0, sizeof(*n));
    n->name = strdup(name);
    n->st = *st;
    n->st.st_ino = nnodes + 1;
    return nnodes++;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(nodes[*(const size_t *)a].name, nodes[*(const size_t *)b].name);
}

static int read_all(const char *path, char *buf, size_t len)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW);
    if (fd < 0) return -1;
    size_t done = 0;
    while (done < len) {
        ssize_t got = read(fd, buf + done, len - done);
        if (got <= 0) { close(fd); return -1; }
        done += got;
    }
    close(fd);
    return 0;
}

/* Load the directory at ``path`` (already node ``self``) and everything below it. */
static void load_dir(const char *path, size_t self)
{
    DIR *d = opendir(path);
    if (!d) { perror(path); exit(1); }
    size_t ccap = 0, *kids = NULL, nk = 0;
    struct dirent *de;
    char sub[PATH_MAX];
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        snprintf(sub, sizeof(sub), "%s/%s", path, de->d_name);
        struct stat st;
        if (lstat(sub, &st)) { perror(sub); exit(1); }
        size_t k = add_node(de->d_name, &st);
        if (S_ISREG(st.st_mode) && st.st_size) {
            void *data = NULL;      /* on a page: see the file comment */
            if (posix_memalign(&data, 4096, st.st_size) || read_all(sub, data, st.st_size)) {
                perror(sub);
                exit(1);
            }
            nodes[k].data = data;
        } else if (S_ISLNK(st.st_mode)) {
            nodes[k].data = calloc(1, st.st_size + 1);
            if (readlink(sub, nodes[k].data, st.st_size) < 0) { perror(sub); exit(1); }
        }
        if (nk == ccap) {
            ccap = ccap ? ccap * 2 : 16;
            kids = realloc(kids, ccap * sizeof(*kids));
        }
        kids[nk++] = k;
    }
    closedir(d);
    /* nodes may have moved (realloc): index, never pointers, across the recursion */
    for (size_t i = 0; i < nk; i++)
        if (S_ISDIR(nodes[kids[i]].st.st_mode)) {
            snprintf(sub, sizeof(sub), "%s/%s", path, nodes[kids[i]].name);
            load_dir(sub, kids[i]);
        }
    qsort(kids, nk, sizeof(*kids), by_name);
    nodes[self].children = kids;
    nodes[self].nchildren = nk;
}

static struct node *get(fuse_ino_t ino)
{
    return ino >= 1 && ino <= nnodes ? &nodes[ino - 1] : NULL;
}

static void fill_entry(struct fuse_entry_param *e, struct node *n)
{
    memset(e, 0, sizeof(*e));
    e->ino = n->st.st_ino;
    e->attr = n->st;
    e->attr_timeout = TIMEOUT;
    e->entry_timeout = TIMEOUT;
}

static void rc_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    /* as pyfuse3: READDIRPLUS for every readdir, not the kernel's adaptive choice */
    conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
}

static void rc_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct node *p = get(parent);
    if (!p) { fuse_reply_err(req, ENOENT); return; }
    if (!S_ISDIR(p->st.st_mode)) { fuse_reply_err(req, ENOTDIR); return; }
    size_t lo = 0, hi = p->nchildren;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(nodes[p->children[mid]].name, name);
        if (c == 0) {
            struct fuse_entry_param e;
            fill_entry(&e, &nodes[p->children[mid]]);
            fuse_reply_entry(req, &e);
            return;
        }
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    fuse_reply_err(req, ENOENT);
}

static void rc_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    struct node *n = get(ino);
    if (!n) fuse_reply_err(req, ENOENT);
    else fuse_reply_attr(req, &n->st, TIMEOUT);
}

static void rc_readlink(fuse_req_t req, fuse_ino_t ino)
{
    struct node *n = get(ino);
    if (!n) fuse_reply_err(req, ENOENT);
    else if (!S_ISLNK(n->st.st_mode)) fuse_reply_err(req, EINVAL);
    else fuse_reply_readlink(req, n->data);
}

static void rc_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct node *n = get(ino);
    if (!n) fuse_reply_err(req, ENOENT);
    else if (!S_ISDIR(n->st.st_mode)) fuse_reply_err(req, ENOTDIR);
    else { fi->keep_cache = 1; fuse_reply_open(req, fi); }
}

/* Offsets are child position + 1, as in kspeedfs: the stream resumes anywhere. */
static void do_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, int plus)
{
    struct node *d = get(ino);
    if (!d) { fuse_reply_err(req, ENOENT); return; }
    char *buf = malloc(size);
    if (!buf) { fuse_reply_err(req, ENOMEM); return; }
    size_t used = 0;
    for (size_t pos = off; pos < d->nchildren; pos++) {
        struct node *c = &nodes[d->children[pos]];
        size_t want;
        if (plus) {
            struct fuse_entry_param e;
            fill_entry(&e, c);
            want = fuse_add_direntry_plus(req, buf + used, size - used, c->name, &e, pos + 1);
        } else {
            want = fuse_add_direntry(req, buf + used, size - used, c->name, &c->st, pos + 1);
        }
        if (want > size - used)
            break;
        used += want;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
}

static void rc_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)fi;
    do_readdir(req, ino, size, off, 0);
}

static void rc_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)fi;
    do_readdir(req, ino, size, off, 1);
}

static void rc_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct node *n = get(ino);
    if (!n) fuse_reply_err(req, ENOENT);
    else if (S_ISDIR(n->st.st_mode)) fuse_reply_err(req, EISDIR);
    else if ((fi->flags & O_ACCMODE) != O_RDONLY) fuse_reply_err(req, EROFS);
    else { fi->keep_cache = 1; fuse_reply_open(req, fi); }
}

static void rc_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)fi;
    struct node *n = get(ino);
    if (!n) { fuse_reply_err(req, ENOENT); return; }
    size_t len = n->st.st_size;
    if ((size_t)off >= len) { fuse_reply_buf(req, NULL, 0); return; }
    if (size > len - off) size = len - off;
    fuse_reply_buf(req, n->data + off, size);
}

static void rc_statfs(fuse_req_t req, fuse_ino_t ino)
{
    (void)ino;
    struct statvfs s;
    memset(&s, 0, sizeof(s));
    s.f_bsize = s.f_frsize = 4096;
    s.f_files = nnodes;
    s.f_namemax = 255;
    fuse_reply_statfs(req, &s);
}

static const struct fuse_lowlevel_ops ops = {
    .init = rc_init,
    .lookup = rc_lookup,
    .getattr = rc_getattr,
    .readlink = rc_readlink,
    .opendir = rc_opendir,
    .readdir = rc_readdir,
    .readdirplus = rc_readdirplus,
    .open = rc_open,
    .read = rc_read,
    .statfs = rc_statfs,
};

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOURCE MOUNTPOINT\n", argv[0]);
        return 2;
    }
    struct stat st;
    if (lstat(argv[1], &st) || !S_ISDIR(st.st_mode)) { perror(argv[1]); return 1; }
    add_node("", &st);
    load_dir(argv[1], 0);
    fprintf(stderr, "ramfs_c: %zu entries loaded from %s\n", nnodes, argv[1]);

    char *fuse_argv[] = {argv[0], "-o", "ro,fsname=ramfs_c,subtype=ramfs_c,default_permissions", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (!se) return 1;
    if (fuse_set_signal_handlers(se)) return 1;
    if (fuse_session_mount(se, argv[2])) return 1;
    /* Default: the single-threaded loop. RAMFS_C_THREADS=N (N > 1) runs libfuse's
     * multi-threaded loop with N workers (RAMFS_C_CLONE_FD=1: a cloned /dev/fuse fd per
     * worker). On the 2-vCPU bench VM the MT loop was 2x *slower* (8 readers of small
     * files: ~9k files/s single-threaded vs 2-5k with 4 or 16 workers; cross-CPU
     * wake-ups per request), so the ceiling is the single-threaded loop here. */
    const char *threads = getenv("RAMFS_C_THREADS");
    int ret;
    if (!threads || atoi(threads) <= 1) {
        ret = fuse_session_loop(se);
    } else {
        struct fuse_loop_config *cfg = fuse_loop_cfg_create();
        fuse_loop_cfg_set_clone_fd(cfg, getenv("RAMFS_C_CLONE_FD") ? 1 : 0);
        fuse_loop_cfg_set_max_threads(cfg, atoi(threads));
        fuse_loop_cfg_set_idle_threads(cfg, atoi(threads));
        ret = fuse_session_loop_mt(se, cfg);
        fuse_loop_cfg_destroy(cfg);
    }
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    fuse_opt_free_args(&args);
    return ret ? 1 : 0;
}
