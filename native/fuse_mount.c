/* fuse_mount.c — mounting: mount(2) with a /dev/fuse fd (root; non-root callers use the
 * pyfuse3 engine), and the lazy unmount that ends the request threads. */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

int fe_mount(const char *path, const char *fsname, int allow_other, int nonempty,
             uint32_t max_read, char *err, size_t errlen)
{
    (void)nonempty; /* a fusermount rule; mount(2) itself mounts over anything */
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, errlen, "open /dev/fuse: %s", strerror(errno));
        return -1;
    }
    char opts[256];
    int n = snprintf(opts, sizeof opts,
                     "fd=%d,rootmode=40000,user_id=%u,group_id=%u,default_permissions%s", fd,
                     (unsigned)getuid(), (unsigned)getgid(),
                     allow_other ? ",allow_other" : "");
    if (max_read)
        n += snprintf(opts + n, sizeof opts - (size_t)n, ",max_read=%u", max_read);
    if (mount(fsname, path, "fuse.kspeedfs", MS_RDONLY | MS_NOSUID | MS_NODEV, opts) < 0) {
        int saved = errno;
        set_err(err, errlen, "mount %s: %s", path, strerror(saved));
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

int fe_unmount(const char *path) { return umount2(path, MNT_DETACH) < 0 ? -errno : 0; }
