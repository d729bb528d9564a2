/*
 * fstier.io._native: the per-file block I/O path in C, a whole batch per
 * call with the GIL released.
 *
 * Python (fstier/io/native.py) converts a job into arrays (names, key hashes,
 * caller buffers) under the GIL; the loop below then runs every block of the
 * batch without touching a Python object, and returns one small tuple per
 * block: (status, errno, bytes, stage/reason, ...). The protocol is the one
 * of fstier/io/_blockio.py, step for step (docs/format.md sections 4 and 5):
 *
 *   store: resolve the block's directory under the base directory with no
 *          symlink in any component (openat2 RESOLVE_BENEATH |
 *          RESOLVE_NO_SYMLINKS, or a walk of O_NOFOLLOW openat calls where
 *          the kernel has no openat2), create it when asked (mkdirat inside
 *          directory fds), skip when a regular file is there, encode the
 *          header (XXH3-64 of the payload and of the header), write an
 *          O_TMPFILE inode (else a unique named temp, O_CREAT|O_EXCL|
 *          O_NOFOLLOW; the root's capabilities say which: F_NO_TMPFILE),
 *          O_DIRECT when enabled and the buffer is aligned
 *          (EINVAL -> one buffered retry), fsync per policy (never
 *          retried), publish with linkat (EEXIST -> link a temp name and
 *          rename it over) or renameat, close, fsync the directory.
 *   load:  openat2 the file (no symlinks, O_NONBLOCK, O_DIRECT when the
 *          buffer is aligned), ONE preadv into [header page, the caller's
 *          whole pages, bounce page, overflow page], then the checks of
 *          docs/format.md section 5 in order; proven corruption returns the
 *          file's (dev, ino) so the caller removes it only if the name still
 *          holds that inode.
 *
 * Nothing here allocates per block: three aligned scratch pages per call.
 *
 * Capabilities are per root, never per process: a filesystem that refuses
 * O_TMPFILE (EOPNOTSUPP: NFS, FUSE; EISDIR: a kernel without it) switches
 * the rest of THIS call (one call is one base directory) to named temps and
 * is reported in the block's result; Python records it in that root's
 * RootCapabilities, whose F_NO_TMPFILE later calls for that root carry. No
 * refusal changes what another root in the process does.
 *
 * Fault injection (tests only): a small rule table, armed from Python with
 * fault_set(); every system call above goes through fx_hook(), which can
 * fail the Nth call of one operation with an errno, delay it, shorten a
 * read or write, or report an error after the call succeeded (a rename on
 * NFS). Unarmed, the hook is one relaxed atomic load.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "_native_xxh3.h"

#ifndef O_TMPFILE
#define O_TMPFILE 0
#endif
#ifndef O_DIRECT
#define O_DIRECT 0
#endif
#ifndef SYS_openat2
#if defined(__x86_64__) || defined(__aarch64__)
#define SYS_openat2 437
#endif
#endif

#define PAGE 4096
#define HDR_CHECKSUM_OFF 136
#define HDR_USED 144
#define MAX_HASH 64
#define MIN_HASH 8
#define MAX_PAYLOAD (1ULL << 36)
#define MAX_NAME 1024

/* flags of store_batch / load_batch */
#define F_CHECKSUM 1
#define F_DIRECT 2
#define F_FSYNC_FILE 4
#define F_FSYNC_DIR 8
#define F_MKDIR 16
#define F_NO_TMPFILE 32 /* the root's capabilities say: named temps */
#define F_DIRECT_COLD 64 /* buffered, but a large file outside the page cache is read with O_DIRECT */

/* F_DIRECT_COLD: the smallest payload read with O_DIRECT when none of its
 * file is in the page cache. On this project's VMs a cold 2 MiB file read
 * 1.3x faster direct than buffered, a 256 KiB one 0.7x (the kernel's
 * readahead wins for small files), so only files of 1 MiB and more. */
#define COLD_DIRECT_MIN ((uint64_t)1 << 20)
static _Atomic uint64_t cold_direct_min = COLD_DIRECT_MIN; /* configure(): tests only */
#ifndef __NR_cachestat
#define __NR_cachestat 451 /* one number on every architecture since Linux 6.5 */
#endif

/* store status / stage codes (fstier/io/native.py has the same tables) */
enum { ST_STORED = 0, ST_SKIPPED = 1, ST_FAILED = 2 };
enum {
    SG_NONE = 0, SG_OPENDIR, SG_STAT, SG_CREATE, SG_WRITE, SG_FSYNC, SG_LINK, SG_CLOSE,
    SG_RENAME, SG_FSYNC_DIR, SG_MKDIR, SG_OPENBASE,
    SG_NSBACK /* a success's mark: stored after its namespace directory was made again (the engine's) */
};
/* load status / reason codes */
enum { LD_LOADED = 0, LD_MISSING = 1, LD_CORRUPT = 2, LD_ERROR = 3 };
enum {
    RS_NONE = 0, RS_SYMLINK, RS_NOT_REGULAR, RS_BAD_SIZE, RS_SHORT_READ, RS_BAD_MAGIC,
    RS_VERSION, RS_HDR_CHECKSUM, RS_BAD_HEADER, RS_BAD_KEY, RS_BAD_KIND, RS_BAD_LENGTH,
    RS_WRONG_KEY, RS_WRONG_NS, RS_WRONG_LENGTH, RS_PAYLOAD_CHECKSUM, RS_OPEN, RS_READ
};

static const uint8_t MAGIC[8] = {'F', 'S', 'T', 'K', 'V', 'B', 'L', 'K'};
static int format_version = 1;

/* ------------------------------------------------------------ fault seam */
enum {
    OP_OPENDIR = 0, OP_OPEN, OP_STAT, OP_WRITE, OP_READ, OP_FSYNC, OP_LINK, OP_RENAME,
    OP_CLOSE, OP_MKDIR, OP_UNLINK, OP_NOWAIT, OP_CACHESTAT, OP_TOUCH, OP_COUNT
};
static const char *const op_names[OP_COUNT] = {"opendir", "open",  "stat",  "write",
                                               "read",    "fsync", "link",  "rename",
                                               "close",   "mkdir", "unlink", "nowait",
                                               "cachestat", "touch"};

typedef struct {
    int op;
    long nth;      /* fire from the nth matching call (1 = the next one) */
    long times;    /* how many calls fire (-1: every call from then on) */
    int err;       /* errno to report (0: none, e.g. only a delay) */
    long delay_ns; /* sleep before the call */
    long short_n;  /* read/write: move at most this many bytes (0: no cap) */
    int after;     /* perform the call, then report err */
    long seen;
} fx_rule;

#define MAX_RULES 16
static fx_rule rules[MAX_RULES];
static int nrules = 0;
static long op_calls[OP_COUNT];
static atomic_int armed = 0;
static pthread_mutex_t rules_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
    int err;
    int after;
    long short_n;
} fx_inject;

static int fx_hook(int op, fx_inject *inj) {
    inj->err = 0;
    inj->after = 0;
    inj->short_n = 0;
    if (!atomic_load_explicit(&armed, memory_order_relaxed)) return 0;
    long delay = 0;
    pthread_mutex_lock(&rules_lock);
    op_calls[op]++;
    for (int i = 0; i < nrules; i++) {
        fx_rule *r = &rules[i];
        if (r->op != op) continue;
        r->seen++;
        if (r->seen < r->nth) continue;
        if (r->times >= 0 && r->seen >= r->nth + r->times) continue;
        if (r->delay_ns > delay) delay = r->delay_ns;
        if (r->err && !inj->err) {
            inj->err = r->err;
            inj->after = r->after;
        }
        if (r->short_n && !inj->short_n) inj->short_n = r->short_n;
    }
    pthread_mutex_unlock(&rules_lock);
    if (delay) {
        struct timespec ts = {delay / 1000000000L, delay % 1000000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    return inj->err && !inj->after ? inj->err : 0;
}

#define FAIL_BEFORE(op)                          \
    fx_inject inj;                               \
    do {                                         \
        int e_ = fx_hook((op), &inj);            \
        if (e_) {                                \
            errno = e_;                          \
            return -1;                           \
        }                                        \
    } while (0)

#define FAIL_AFTER(rc)                           \
    do {                                         \
        if ((rc) >= 0 && inj.err && inj.after) { \
            errno = inj.err;                     \
            return -1;                           \
        }                                        \
    } while (0)

/* ------------------------------------------------------ path resolution */
#ifndef RESOLVE_NO_SYMLINKS
#define RESOLVE_NO_SYMLINKS 0x04
#endif
#ifndef RESOLVE_BENEATH
#define RESOLVE_BENEATH 0x08
#endif
struct fx_open_how {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

static atomic_int use_openat2 = 0;

static int fx_openat2_raw(int dfd, const char *path, int flags, mode_t mode, uint64_t resolve) {
#ifdef SYS_openat2
    struct fx_open_how how;
    int creates = (flags & O_CREAT) || (O_TMPFILE && (flags & O_TMPFILE) == O_TMPFILE);
    how.flags = (uint64_t)(flags | O_CLOEXEC);
    how.mode = creates ? mode : 0;
    how.resolve = resolve;
    return (int)syscall(SYS_openat2, dfd, path, &how, sizeof how);
#else
    (void)dfd; (void)path; (void)flags; (void)mode; (void)resolve;
    errno = ENOSYS;
    return -1;
#endif
}

/* Open `path` relative to `dfd` (AT_FDCWD and an absolute path for the base
 * directory) with no symlink in any component; `beneath`: no escape from dfd
 * either ("..", absolute). Walk fallback: one O_NOFOLLOW openat per
 * component. */
static int fx_resolve(int dfd, const char *path, int flags, mode_t mode, int beneath) {
    if (atomic_load_explicit(&use_openat2, memory_order_relaxed)) {
        uint64_t res = RESOLVE_NO_SYMLINKS | (beneath ? RESOLVE_BENEATH : 0);
        return fx_openat2_raw(dfd, path, flags, mode, res);
    }
    char buf[PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) {
        errno = n ? ENAMETOOLONG : ENOENT;
        return -1;
    }
    memcpy(buf, path, n + 1);
    int cur;
    char *p = buf;
    if (buf[0] == '/') {
        if (beneath) {
            errno = EXDEV;
            return -1;
        }
        cur = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        while (*p == '/') p++;
        if (!*p) {
            int fd = openat(cur, ".", flags | O_CLOEXEC, mode);
            int e = errno;
            close(cur);
            errno = e;
            return fd;
        }
    } else {
        cur = fcntl(dfd, F_DUPFD_CLOEXEC, 0);
    }
    if (cur < 0) return -1;
    for (;;) {
        char *slash = strchr(p, '/');
        if (slash) *slash = 0;
        if (beneath && strcmp(p, "..") == 0) {
            close(cur);
            errno = EXDEV;
            return -1;
        }
        char *next = slash ? slash + 1 : NULL;
        while (next && *next == '/') next++;
        int last = !next || !*next;
        int fd;
        if (last)
            fd = openat(cur, p, flags | O_NOFOLLOW | O_CLOEXEC, mode);
        else
            fd = openat(cur, p, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int e = errno;
        if (fd < 0 && e == ENOTDIR) {
            /* O_DIRECTORY is checked before O_NOFOLLOW: a symlink shows as
             * ENOTDIR; report it as openat2 does (ELOOP) */
            struct stat lst;
            if (fstatat(cur, p, &lst, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(lst.st_mode)) e = ELOOP;
        }
        close(cur);
        if (fd < 0) {
            errno = e;
            return -1;
        }
        if (last) return fd;
        cur = fd;
        p = next;
    }
}

static int x_opendir(int base_fd, const char *rel) {
    FAIL_BEFORE(OP_OPENDIR);
    int fd = rel[0] ? fx_resolve(base_fd, rel, O_RDONLY | O_DIRECTORY, 0, 1)
                    : fcntl(base_fd, F_DUPFD_CLOEXEC, 0);
    if (fd >= 0 && inj.err && inj.after) {
        close(fd);
        errno = inj.err;
        return -1;
    }
    return fd;
}

static int x_openfile(int base_fd, const char *rel, int flags) {
    FAIL_BEFORE(OP_OPEN);
    int fd = fx_resolve(base_fd, rel, flags, 0, 1);
    if (fd >= 0 && inj.err && inj.after) {
        close(fd);
        errno = inj.err;
        return -1;
    }
    return fd;
}

static int x_openat(int dfd, const char *name, int flags, mode_t mode) {
    FAIL_BEFORE(OP_OPEN);
    int fd = openat(dfd, name, flags | O_CLOEXEC, mode);
    if (fd >= 0 && inj.err && inj.after) {
        close(fd);
        errno = inj.err;
        return -1;
    }
    return fd;
}

static int x_fstatat(int dfd, const char *name, struct stat *st) {
    FAIL_BEFORE(OP_STAT);
    int rc = fstatat(dfd, name, st, AT_SYMLINK_NOFOLLOW);
    FAIL_AFTER(rc);
    return rc;
}

static int x_mkdirat(int dfd, const char *name, mode_t mode) {
    FAIL_BEFORE(OP_MKDIR);
    int rc = mkdirat(dfd, name, mode);
    FAIL_AFTER(rc);
    return rc;
}

static int x_fsync(int fd) {
    FAIL_BEFORE(OP_FSYNC);
    int rc = fsync(fd);
    FAIL_AFTER(rc);
    return rc;
}

static int x_close(int fd) {
    fx_inject inj;
    int e = fx_hook(OP_CLOSE, &inj);
    int rc = close(fd); /* the fd is gone whatever close reports */
    if (rc == 0 && (e || (inj.err && inj.after))) {
        errno = inj.err;
        return -1;
    }
    return rc;
}

static int x_unlinkat(int dfd, const char *name) {
    FAIL_BEFORE(OP_UNLINK);
    int rc = unlinkat(dfd, name, 0);
    FAIL_AFTER(rc);
    return rc;
}

static int x_linkfd(int fd, int dfd, const char *name) {
    FAIL_BEFORE(OP_LINK);
    /* /proc/self/fd/N with AT_SYMLINK_FOLLOW needs no privilege, unlike
     * AT_EMPTY_PATH (CAP_DAC_READ_SEARCH). */
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    int rc = linkat(AT_FDCWD, proc, dfd, name, AT_SYMLINK_FOLLOW);
    FAIL_AFTER(rc);
    return rc;
}

static int x_renameat(int dfd, const char *src, const char *dst) {
    FAIL_BEFORE(OP_RENAME);
    int rc = renameat(dfd, src, dfd, dst);
    FAIL_AFTER(rc);
    return rc;
}

/* Cap an iovec list at `cap` bytes (a short read/write injection). */
static int cap_iov(struct iovec *iov, int cnt, long cap) {
    long left = cap;
    for (int i = 0; i < cnt; i++) {
        if ((long)iov[i].iov_len >= left) {
            iov[i].iov_len = (size_t)left;
            return i + 1;
        }
        left -= (long)iov[i].iov_len;
    }
    return cnt;
}

static ssize_t x_pwritev(int fd, struct iovec *iov, int cnt, off_t off) {
    FAIL_BEFORE(OP_WRITE);
    struct iovec tmp[8];
    if (inj.short_n && cnt <= 8) {
        memcpy(tmp, iov, sizeof(struct iovec) * (size_t)cnt);
        cnt = cap_iov(tmp, cnt, inj.short_n);
        iov = tmp;
    }
    ssize_t rc;
    do {
        rc = pwritev(fd, iov, cnt, off);
    } while (rc < 0 && errno == EINTR);
    return rc;
}

/* A batch that starts its helper threads as reads would block (fan_grow,
 * below): set on each of its threads while it runs. */
typedef struct fx_fan fx_fan;
static __thread fx_fan *tl_fan = NULL;
static int fan_may_grow(const fx_fan *f);
static void fan_grow(fx_fan *f);

/* The same growth for a C engine worker (_native_engine.c): set around each
 * key of a job whose further workers are woken only as its reads would
 * block. may_grow is a cheap hint; grow wakes at most one more worker. */
typedef struct {
    int (*may_grow)(void *arg);
    void (*grow)(void *arg);
    void *arg;
} fx_grower;
static __thread const fx_grower *tl_grower = NULL;

static ssize_t x_preadv(int fd, struct iovec *iov, int cnt, off_t off, int direct) {
    FAIL_BEFORE(OP_READ);
    struct iovec tmp[8];
    if (inj.short_n && cnt <= 8) {
        memcpy(tmp, iov, sizeof(struct iovec) * (size_t)cnt);
        cnt = cap_iov(tmp, cnt, inj.short_n);
        iov = tmp;
    }
    ssize_t rc;
    fx_fan *f = tl_fan;
    const fx_grower *g = f ? NULL : tl_grower;
    if (direct && f && fan_may_grow(f)) {
        fan_grow(f); /* a direct read always waits for the device */
        f = NULL;
    }
    if (direct && g && g->may_grow(g->arg)) {
        g->grow(g->arg);
        g = NULL;
    }
#ifdef RWF_NOWAIT
    if ((f && fan_may_grow(f)) || (g && g->may_grow(g->arg))) {
        /* From the page cache only: what is not there would block this
         * thread, so another thread takes the batch's next files first. */
        fx_inject nw;
        if (fx_hook(OP_NOWAIT, &nw)) { /* injected: the page cache lacks it */
            rc = -1;
            errno = EAGAIN;
        } else {
            do {
                rc = preadv2(fd, iov, cnt, off, RWF_NOWAIT);
            } while (rc < 0 && errno == EINTR);
        }
        /* short (EOF, or only a part cached): the caller's next read asks again */
        if (rc >= 0 || (errno != EAGAIN && errno != EOPNOTSUPP && errno != EINVAL)) return rc;
        if (f)
            fan_grow(f);
        else
            g->grow(g->arg);
    }
#endif
    do {
        rc = preadv(fd, iov, cnt, off);
    } while (rc < 0 && errno == EINTR);
    return rc;
}

/* Drop the first n bytes of an iovec list in place; returns the new count. */
static int advance_iov(struct iovec **iovp, int cnt, size_t n) {
    struct iovec *iov = *iovp;
    while (cnt && n >= iov->iov_len) {
        n -= iov->iov_len;
        iov++;
        cnt--;
    }
    if (cnt && n) {
        iov->iov_base = (char *)iov->iov_base + n;
        iov->iov_len -= n;
    }
    *iovp = iov;
    return cnt;
}

/* ------------------------------------------------------------- header */
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline uint16_t get16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static uint64_t header_checksum(uint8_t *h) {
    uint8_t saved[8];
    memcpy(saved, h + HDR_CHECKSUM_OFF, 8);
    memset(h + HDR_CHECKSUM_OFF, 0, 8);
    uint64_t c = fx_xxh3_64(h, PAGE);
    memcpy(h + HDR_CHECKSUM_OFF, saved, 8);
    return c;
}

static void encode_header(uint8_t *h, const uint8_t *khash, int hlen, uint32_t group,
                          const uint8_t *digest, uint64_t plen, uint64_t pages, int kind,
                          uint64_t pcsum, uint64_t created_ns) {
    memset(h, 0, PAGE);
    memcpy(h, MAGIC, 8);
    put16(h + 8, (uint16_t)format_version);
    put16(h + 10, PAGE);
    put16(h + 12, (uint16_t)kind);
    put16(h + 14, (uint16_t)hlen);
    put32(h + 16, group);
    put32(h + 20, 0);
    memcpy(h + 24, digest, 8);
    put64(h + 32, plen);
    put64(h + 40, pages);
    put64(h + 48, pages ? plen / pages : 0);
    put64(h + 56, pcsum);
    put64(h + 64, created_ns);
    memcpy(h + 72, khash, (size_t)hlen);
    put64(h + HDR_CHECKSUM_OFF, header_checksum(h));
}

/* The checks of docs/format.md section 5, steps 2-6, in that order. */
static int check_header(uint8_t *h, const uint8_t *khash, int hlen, uint32_t group,
                        const uint8_t *digest, uint64_t plen, int *kind, uint64_t *pcsum) {
    if (memcmp(h, MAGIC, 8) != 0) return RS_BAD_MAGIC;
    if (get16(h + 8) != format_version) return RS_VERSION;
    if (fx_r64(h + HDR_CHECKSUM_OFF) != header_checksum(h)) return RS_HDR_CHECKSUM;
    if (get16(h + 10) != PAGE || fx_r32(h + 20) != 0) return RS_BAD_HEADER;
    uint16_t fhlen = get16(h + 14);
    uint32_t fgroup = fx_r32(h + 16);
    if (fhlen < MIN_HASH || fhlen > MAX_HASH || fgroup > 65535) return RS_BAD_KEY;
    uint16_t k = get16(h + 12);
    if (k > 1) return RS_BAD_KIND;
    uint64_t fplen = fx_r64(h + 32), pc = fx_r64(h + 40), pb = fx_r64(h + 48);
    __uint128_t prod = (__uint128_t)pc * pb;
    if (fplen > MAX_PAYLOAD || prod != fplen) return RS_BAD_LENGTH;
    if (fhlen != hlen || fgroup != group || memcmp(h + 72, khash, (size_t)hlen) != 0)
        return RS_WRONG_KEY;
    if (memcmp(h + 24, digest, 8) != 0) return RS_WRONG_NS;
    if (fplen != plen) return RS_WRONG_LENGTH;
    *kind = k;
    *pcsum = fx_r64(h + 56);
    return RS_NONE;
}

/* ------------------------------------------------------------- batches */
typedef struct {
    const char *rel; /* "<dir>/<name>" relative to the base directory */
    Py_ssize_t rel_len;
    const uint8_t *khash;
    int hlen;
    uint32_t group;
    Py_buffer buf;
    int have_buf;
    int replace; /* store: write even over a regular file (its last load failed) */
    /* results */
    int status, err, stage;
    int tmpfile_err; /* errno of this block's O_TMPFILE refusal (0: none) */
    uint64_t nbytes;
    uint64_t dev, ino;
    int removed; /* load: the corrupt file (or planted link) at its name was removed (remove_bad) */
    int rm_err;  /* load: errno of a removal that failed for a reason other than "gone" (logged by Python) */
} fx_item;

typedef struct {
    uint8_t *header; /* three aligned pages: header, tail (bounce), overflow */
    uint8_t *tail;
    uint8_t *over;
} fx_scratch;

/* configure(tmpfile=False): a process-wide override for tests only; a
 * refusal never sets it (it is reported per block, see store_once). */
static atomic_int tmpfile_off = 0;
static char host_name[64] = "host";

static void temp_name(char *out, size_t cap, const char *final) {
    uint32_t rnd = 0;
    if (syscall(SYS_getrandom, &rnd, sizeof rnd, 0) != (long)sizeof rnd) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        rnd = (uint32_t)(ts.tv_nsec ^ (ts.tv_sec << 7));
    }
    snprintf(out, cap, ".%s.tmp.%s.%d.%ld.%08x", final, host_name, (int)getpid(),
             (long)syscall(SYS_gettid), rnd);
}

static void discard_at(int dfd, const char *name) {
    int e = errno;
    x_unlinkat(dfd, name);
    errno = e;
}

/* Create the directories of `dir` (relative to base_fd) that are missing,
 * one mkdirat per level inside O_NOFOLLOW directory fds (the first level
 * made in base_fd itself, not a dup of it); returns an fd of `dir` for the
 * caller to close, *fresh = 1 when its last level was created by this call. */
static int make_dirs(int base_fd, const char *dir, int *fresh, int *stage) {
    char buf[PATH_MAX];
    size_t n = strlen(dir);
    if (n >= sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(buf, dir, n + 1);
    int cur = base_fd; /* borrowed, never closed here: no dup per directory made */
    char *p = buf;
    *fresh = 0;
    while (p && *p) {
        char *slash = strchr(p, '/');
        if (slash) *slash = 0;
        if (strcmp(p, "..") == 0 || strcmp(p, ".") == 0) {
            if (cur != base_fd) close(cur);
            errno = EXDEV;
            return -1;
        }
        *fresh = 0;
        if (x_mkdirat(cur, p, 0755) == 0)
            *fresh = 1;
        else if (errno != EEXIST) {
            int e = errno;
            if (cur != base_fd) close(cur);
            *stage = SG_MKDIR;
            errno = e;
            return -1;
        }
        int fd = x_openat(cur, p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0);
        int e = errno;
        if (cur != base_fd) close(cur);
        if (fd < 0) {
            errno = e;
            *stage = SG_OPENDIR;
            return -1;
        }
        cur = fd;
        p = slash ? slash + 1 : NULL;
    }
    return cur != base_fd ? cur : fcntl(base_fd, F_DUPFD_CLOEXEC, 0); /* the caller closes it */
}

/* An O_TMPFILE inode unless `no_tmpfile`; a refusal stores its errno in
 * *refused and falls back to a named temp (`tmp` then holds its name). */
static int create_temp(int dfd, const char *name, int direct, mode_t mode, char *tmp,
                       size_t tmpcap, int no_tmpfile, int *refused) {
    int flags = O_WRONLY | (direct ? O_DIRECT : 0);
    tmp[0] = 0;
    if (O_TMPFILE && !no_tmpfile && !atomic_load(&tmpfile_off)) {
        int fd = x_openat(dfd, ".", flags | O_TMPFILE, mode);
        if (fd >= 0) return fd;
        /* EISDIR: a kernel without O_TMPFILE read it as O_DIRECTORY;
         * EOPNOTSUPP: the filesystem has none (NFS, FUSE). */
        if (errno != EOPNOTSUPP && errno != EISDIR) return -1;
        *refused = errno;
    }
    temp_name(tmp, tmpcap, name);
    int fd = x_openat(dfd, tmp, flags | O_CREAT | O_EXCL | O_NOFOLLOW, mode);
    if (fd < 0 && errno != EEXIST) discard_at(dfd, tmp); /* ramfs + O_DIRECT */
    return fd;
}

static int link_anonymous(int fd, int dfd, const char *name) {
    if (x_linkfd(fd, dfd, name) == 0) return 0;
    if (errno != EEXIST) return -1;
    char tmp[MAX_NAME + 160];
    temp_name(tmp, sizeof tmp, name);
    if (x_linkfd(fd, dfd, tmp) != 0) return -1;
    if (x_renameat(dfd, tmp, name) != 0) {
        discard_at(dfd, tmp);
        return -1;
    }
    return 0;
}

static void store_once(fx_item *it, int dfd, const char *name, struct iovec *iov0, int cnt0,
                       int direct, int flags, mode_t mode) {
    char tmp[MAX_NAME + 160];
    /* a block that saw a refusal (then an O_DIRECT retry) does not ask again */
    int no_tmpfile = (flags & F_NO_TMPFILE) || it->tmpfile_err;
    int fd = create_temp(dfd, name, direct, mode, tmp, sizeof tmp, no_tmpfile, &it->tmpfile_err);
    if (fd < 0) {
        it->status = ST_FAILED;
        it->err = errno;
        it->stage = SG_CREATE;
        return;
    }
    int named = tmp[0] != 0, linked = 0, stage = SG_WRITE;
    struct iovec iovs[8];
    memcpy(iovs, iov0, sizeof(struct iovec) * (size_t)cnt0);
    struct iovec *iov = iovs;
    int cnt = cnt0;
    uint64_t total = 0;
    while (cnt) {
        ssize_t w = x_pwritev(fd, iov, cnt, (off_t)total);
        if (w <= 0) {
            if (w == 0) errno = EIO;
            goto fail_open;
        }
        total += (uint64_t)w;
        cnt = advance_iov(&iov, cnt, (size_t)w);
    }
    if (flags & (F_FSYNC_FILE | F_FSYNC_DIR)) {
        stage = SG_FSYNC; /* never retried: the kernel may have dropped the pages */
        if (x_fsync(fd) != 0) goto fail_open;
    }
    if (!named) {
        stage = SG_LINK;
        if (link_anonymous(fd, dfd, name) != 0) goto fail_open;
        linked = 1;
    }
    stage = SG_CLOSE;
    if (x_close(fd) != 0) goto fail_closed; /* NFS reports deferred write errors here */
    if (named) {
        stage = SG_RENAME;
        if (x_renameat(dfd, tmp, name) != 0) goto fail_closed;
    }
    if (flags & F_FSYNC_DIR) {
        if (x_fsync(dfd) != 0) {
            /* the complete file is visible but not durable: never acknowledged */
            it->status = ST_FAILED;
            it->err = errno;
            it->stage = SG_FSYNC_DIR;
            return;
        }
    }
    it->status = ST_STORED;
    it->nbytes = total;
    return;
fail_open : {
    int e = errno;
    close(fd);
    errno = e;
}
fail_closed : {
    int e = errno;
    if (named)
        discard_at(dfd, tmp);
    else if (linked)
        discard_at(dfd, name); /* withdraw a name whose writes may be lost */
    it->status = ST_FAILED;
    it->err = e;
    it->stage = stage;
}
}

static void store_one(fx_item *it, int base_fd, int flags, mode_t mode, size_t alignment,
                      const uint8_t *digest, uint64_t pages, uint64_t created_ns,
                      fx_scratch *sc) {
    char dir[PATH_MAX];
    const char *rel = it->rel;
    const char *slash = strrchr(rel, '/');
    const char *name = slash ? slash + 1 : rel;
    size_t dlen = slash ? (size_t)(slash - rel) : 0;
    if (dlen >= sizeof dir || strlen(name) > MAX_NAME) {
        it->status = ST_FAILED;
        it->err = ENAMETOOLONG;
        it->stage = SG_OPENDIR;
        return;
    }
    memcpy(dir, rel, dlen);
    dir[dlen] = 0;
    int fresh = 0, stage = SG_OPENDIR;
    int dfd = x_opendir(base_fd, dir);
    if (dfd < 0 && errno == ENOENT && (flags & F_MKDIR) && dlen)
        dfd = make_dirs(base_fd, dir, &fresh, &stage);
    if (dfd < 0) {
        it->status = ST_FAILED;
        it->err = errno;
        it->stage = stage;
        return;
    }
    if (!fresh) {
        struct stat st;
        if (x_fstatat(dfd, name, &st) == 0) {
            if (S_ISREG(st.st_mode) && !it->replace) {
                it->status = ST_SKIPPED;
                close(dfd);
                return;
            }
            /* anything else (a planted symlink) is replaced by the rename */
        } else if (errno != ENOENT) {
            it->status = ST_FAILED;
            it->err = errno;
            it->stage = SG_STAT;
            close(dfd);
            return;
        }
    }
    const uint8_t *payload = (const uint8_t *)it->buf.buf;
    uint64_t n = (uint64_t)it->buf.len;
    uint64_t csum = (flags & F_CHECKSUM) ? fx_xxh3_64(payload, n) : 0;
    encode_header(sc->header, it->khash, it->hlen, it->group, digest, n, pages,
                  (flags & F_CHECKSUM) ? 1 : 0, csum, created_ns);
    uint64_t whole = n - n % PAGE, rest = n - whole;
    struct iovec iov[3];
    int cnt = 0;
    iov[cnt].iov_base = sc->header;
    iov[cnt++].iov_len = PAGE;
    if (whole) {
        iov[cnt].iov_base = (void *)payload;
        iov[cnt++].iov_len = whole;
    }
    if (rest) {
        memcpy(sc->tail, payload + whole, rest);
        memset(sc->tail + rest, 0, PAGE - rest);
        iov[cnt].iov_base = sc->tail;
        iov[cnt++].iov_len = PAGE;
    }
    int aligned = ((uintptr_t)payload % alignment) == 0;
    int direct = (flags & F_DIRECT) && aligned;
    store_once(it, dfd, name, iov, cnt, direct, flags, mode);
    if (direct && it->status == ST_FAILED && it->err == EINVAL) {
        /* a filesystem that passed the probe but refuses this write */
        it->err = 0;
        it->stage = 0;
        store_once(it, dfd, name, iov, cnt, 0, flags, mode);
    }
    close(dfd);
}

/* F_DIRECT_COLD's test: 1 when no page of fd's file is in the page cache
 * (cachestat(2): it starts no readahead, unlike a RWF_NOWAIT read); 0 when
 * some is, or the kernel cannot say (before Linux 6.5: ENOSYS, remembered).
 * An injected "cachestat" error makes it find nothing cached (1), but
 * ENOSYS: a kernel without cachestat (0, not remembered). */
static atomic_int cachestat_missing = 0;
static atomic_long cold_direct_reads = 0; /* loads F_DIRECT_COLD read with O_DIRECT (tests) */

static int file_uncached(int fd) {
    fx_inject inj;
    int injected = fx_hook(OP_CACHESTAT, &inj);
    if (injected) return injected != ENOSYS;
    if (atomic_load(&cachestat_missing)) return 0;
    struct { uint64_t off, len; } range = {0, 0}; /* len 0: to the end of the file */
    struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } cs;
    if (syscall(__NR_cachestat, fd, &range, &cs, 0) != 0) {
        if (errno == ENOSYS) atomic_store(&cachestat_missing, 1);
        return 0;
    }
    return cs.nr_cache == 0;
}

/* Load one item; `direct`: open with O_DIRECT. Returns 1 when the file was
 * read with O_DIRECT (asked, or F_DIRECT_COLD found it outside the cache). */
static int load_once(fx_item *it, int base_fd, int flags, int direct, size_t alignment,
                     const uint8_t *digest, fx_scratch *sc) {
    uint8_t *buf = (uint8_t *)it->buf.buf;
    uint64_t n = (uint64_t)it->buf.len;
    uint64_t whole = n - n % PAGE;
    uint64_t padded = (n + PAGE - 1) & ~(uint64_t)(PAGE - 1);
    uint64_t want = PAGE + padded;
    int oflags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | (direct ? O_DIRECT : 0);
    int fd = x_openfile(base_fd, it->rel, oflags);
    if (fd < 0) {
        it->err = errno;
        if (errno == ENOENT) {
            it->status = LD_MISSING;
        } else if (errno == ELOOP) {
            it->status = LD_CORRUPT; /* planted: the caller removes a link at the name */
            it->stage = RS_SYMLINK;
        } else {
            it->status = LD_ERROR;
            it->stage = RS_OPEN;
        }
        return direct;
    }
    if (!direct && (flags & F_DIRECT_COLD) && n >= atomic_load(&cold_direct_min) &&
        ((uintptr_t)buf % alignment) == 0 && file_uncached(fd)) {
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0 && fcntl(fd, F_SETFL, fl | O_DIRECT) == 0) {
            direct = 1;
            atomic_fetch_add(&cold_direct_reads, 1);
        }
    }
    struct iovec iovs[4];
    int cnt = 0;
    iovs[cnt].iov_base = sc->header;
    iovs[cnt++].iov_len = PAGE;
    if (whole) {
        iovs[cnt].iov_base = buf;
        iovs[cnt++].iov_len = whole;
    }
    if (n > whole) {
        iovs[cnt].iov_base = sc->tail;
        iovs[cnt++].iov_len = PAGE;
    }
    iovs[cnt].iov_base = sc->over;
    iovs[cnt++].iov_len = PAGE;
    struct iovec *iov = iovs;
    uint64_t got = 0;
    struct stat st;
    int reason = RS_NONE;
    for (;;) {
        ssize_t r = x_preadv(fd, iov, cnt, (off_t)got, direct);
        if (r < 0) {
            int e = errno;
            it->err = e;
            it->status = LD_ERROR;
            it->stage = RS_READ;
            if ((e == EISDIR || e == ESPIPE || e == EINVAL || e == ENXIO) && fstat(fd, &st) == 0 &&
                !S_ISREG(st.st_mode))
                it->stage = RS_NOT_REGULAR;
            close(fd);
            return direct;
        }
        if (r == 0) break;
        got += (uint64_t)r;
        if (got >= want) break;
        cnt = advance_iov(&iov, cnt, (size_t)r);
    }
    int kind = 0;
    uint64_t csum = 0;
    if (got != want) {
        if (fstat(fd, &st) != 0) {
            it->err = errno;
            it->status = LD_ERROR;
            it->stage = RS_READ;
            close(fd);
            return direct;
        }
        if (!S_ISREG(st.st_mode)) {
            it->status = LD_ERROR;
            it->stage = RS_NOT_REGULAR;
            close(fd);
            return direct;
        }
        reason = (uint64_t)st.st_size != want ? RS_BAD_SIZE : RS_SHORT_READ;
        it->nbytes = (uint64_t)st.st_size; /* for the detail line */
    } else {
        reason = check_header(sc->header, it->khash, it->hlen, it->group, digest, n, &kind, &csum);
        if (reason == RS_NONE) {
            if (n > whole) memcpy(buf + whole, sc->tail, n - whole);
            if ((flags & F_CHECKSUM) && kind == 1 && fx_xxh3_64(buf, n) != csum)
                reason = RS_PAYLOAD_CHECKSUM;
        }
    }
    if (reason != RS_NONE) {
        it->status = LD_CORRUPT;
        it->stage = reason;
        if (fstat(fd, &st) == 0) {
            it->dev = (uint64_t)st.st_dev;
            it->ino = (uint64_t)st.st_ino;
        }
        close(fd);
        return direct;
    }
    close(fd);
    it->status = LD_LOADED;
    it->nbytes = n;
    return direct;
}

/* THE removal of a load's bad file, as fstier.io.fsops.unlink_if_same and
 * _blockio._remove_planted_link do it on the Python path: the base path is
 * resolved again (not the fd the read used: a base directory renamed out of
 * the root meanwhile, a symlink put at its name, is reached no more) and the
 * name's directory below it, with no symlink in any component,
 * then, through that fd, a proven-corrupt file is unlinked only while the
 * name still holds the inode that was read (a regular file, same dev and
 * ino: a good file renamed over it meanwhile stays), and a planted symlink
 * at the name only while it is a symlink (never its target, never through a
 * symlinked directory). Sets it->removed; it->rm_err for a corrupt file's
 * removal that failed for a reason other than "gone" (ENOENT), which the
 * caller logs as the Python path does (a planted link's failure is not). */
static int open_base(const char *base);

/* x_opendir of `rel` below the base path `base`, resolved from it now with no
 * symlink in any component (the fault seam's one "opendir" per call). */
static int x_opendir_at_base(const char *base, const char *rel) {
    FAIL_BEFORE(OP_OPENDIR);
    int base_fd = open_base(base);
    if (base_fd < 0) return -1;
    int fd = rel[0] ? fx_resolve(base_fd, rel, O_RDONLY | O_DIRECTORY, 0, 1) : base_fd;
    int e = errno;
    if (fd != base_fd) close(base_fd);
    if (fd >= 0 && inj.err && inj.after) {
        close(fd);
        e = inj.err;
        fd = -1;
    }
    errno = e;
    return fd;
}

static void remove_bad(fx_item *it, const char *base) {
    int link = it->stage == RS_SYMLINK;
    if (it->status != LD_CORRUPT || (!link && !it->ino)) return;
    char dir[PATH_MAX];
    const char *slash = strrchr(it->rel, '/');
    const char *name = slash ? slash + 1 : it->rel;
    size_t dlen = slash ? (size_t)(slash - it->rel) : 0;
    if (dlen >= sizeof dir) return;
    memcpy(dir, it->rel, dlen);
    dir[dlen] = 0;
    int dfd = x_opendir_at_base(base, dir);
    struct stat st;
    int rc = dfd < 0 ? -1 : x_fstatat(dfd, name, &st);
    if (rc == 0) {
        int same = link ? S_ISLNK(st.st_mode)
                        : S_ISREG(st.st_mode) && (uint64_t)st.st_ino == it->ino && (uint64_t)st.st_dev == it->dev;
        if (same) {
            rc = x_unlinkat(dfd, name);
            if (rc == 0) it->removed = 1;
        }
    }
    if (rc != 0 && !link && errno != ENOENT) it->rm_err = errno ? errno : EIO;
    if (dfd >= 0) close(dfd);
}

static void load_one(fx_item *it, int base_fd, const char *base, int flags, size_t alignment,
                     const uint8_t *digest, fx_scratch *sc) {
    int direct = (flags & F_DIRECT) && ((uintptr_t)it->buf.buf % alignment) == 0;
    direct = load_once(it, base_fd, flags, direct, alignment, digest, sc);
    if (direct && it->status == LD_ERROR && it->err == EINVAL && it->stage != RS_NOT_REGULAR) {
        /* a filesystem that passed the probe but refuses this read: buffered */
        it->status = 0;
        it->err = 0;
        it->stage = 0;
        it->nbytes = 0;
        load_once(it, base_fd, flags & ~F_DIRECT_COLD, 0, alignment, digest, sc);
    }
    if (it->status == LD_CORRUPT) remove_bad(it, base);
}

/* ------------------------------------------------------- Python glue */
static int scratch_alloc(fx_scratch *sc) {
    void *p = NULL;
    if (posix_memalign(&p, PAGE, 3 * PAGE) != 0) return -1;
    sc->header = (uint8_t *)p;
    sc->tail = sc->header + PAGE;
    sc->over = sc->header + 2 * PAGE;
    return 0;
}

static void items_free(fx_item *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (items[i].have_buf) PyBuffer_Release(&items[i].buf);
    PyMem_Free(items);
}

/* Fill items from (rels, hashes, groups, buffers); every sequence must be a
 * list or tuple of the same length. Holds references through the caller's
 * sequences, which stay alive for the call. */
static fx_item *items_from(PyObject *rels, PyObject *hashes, PyObject *groups, PyObject *bufs,
                           int writable, Py_ssize_t *count) {
    PyObject *seqs[4] = {rels, hashes, groups, bufs};
    for (int s = 0; s < 4; s++) {
        /* lists or tuples only: their items stay alive for the whole call */
        if (seqs[s] && !PyList_Check(seqs[s]) && !PyTuple_Check(seqs[s])) {
            PyErr_SetString(PyExc_TypeError, "rels, hashes, groups and buffers must be lists or tuples");
            return NULL;
        }
    }
    Py_ssize_t n = PySequence_Size(rels);
    if ((hashes && PySequence_Size(hashes) != n) || (groups && PySequence_Size(groups) != n) ||
        (bufs && PySequence_Size(bufs) != n)) {
        PyErr_SetString(PyExc_ValueError, "rels, hashes, groups and buffers differ in length");
        return NULL;
    }
    fx_item *items = PyMem_Calloc((size_t)(n ? n : 1), sizeof(fx_item));
    if (!items) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        fx_item *it = &items[i];
        PyObject *r = PySequence_GetItem(rels, i);
        if (!r) goto fail;
        /* bytes (os.fsencode), never str: a root's path need not be UTF-8 */
        if (!PyBytes_Check(r)) {
            Py_DECREF(r);
            PyErr_Format(PyExc_TypeError, "rels[%zd] must be bytes (os.fsencode)", i);
            goto fail;
        }
        it->rel = PyBytes_AS_STRING(r);
        it->rel_len = PyBytes_GET_SIZE(r);
        Py_DECREF(r); /* the bytes are owned by the caller's sequence */
        if ((size_t)it->rel_len != strlen(it->rel) || it->rel_len == 0 || it->rel[0] == '/') {
            PyErr_Format(PyExc_ValueError, "rels[%zd] must be a relative path without NUL", i);
            goto fail;
        }
        if (hashes) {
            PyObject *h = PySequence_GetItem(hashes, i);
            if (!h) goto fail;
            if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) < MIN_HASH ||
                PyBytes_GET_SIZE(h) > MAX_HASH) {
                Py_DECREF(h);
                PyErr_Format(PyExc_ValueError, "hashes[%zd] must be 8..64 bytes", i);
                goto fail;
            }
            it->khash = (const uint8_t *)PyBytes_AS_STRING(h);
            it->hlen = (int)PyBytes_GET_SIZE(h);
            Py_DECREF(h);
        }
        if (groups) {
            PyObject *g = PySequence_GetItem(groups, i);
            if (!g) goto fail;
            long gv = PyLong_AsLong(g);
            Py_DECREF(g);
            if (gv < 0 || gv > 65535) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "groups[%zd] must be in 0..65535", i);
                goto fail;
            }
            it->group = (uint32_t)gv;
        }
        if (bufs) {
            PyObject *b = PySequence_GetItem(bufs, i);
            if (!b) goto fail;
            int rc = PyObject_GetBuffer(b, &it->buf, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
            Py_DECREF(b);
            if (rc != 0) goto fail;
            it->have_buf = 1;
            if ((uint64_t)it->buf.len > MAX_PAYLOAD) {
                PyErr_Format(PyExc_ValueError, "buffers[%zd] is larger than 2**36 bytes", i);
                goto fail;
            }
        }
    }
    *count = n;
    return items;
fail:
    items_free(items, n);
    return NULL;
}

/* ------------------------------------------------- fan-out inside one call
 * A batch may run on the calling thread and up to `helpers` more threads,
 * started here and joined before the call returns: the items are taken one
 * at a time from a shared counter, each writes only its own fx_item, and
 * no Python object is touched (the GIL stays released). One Python call
 * then moves a whole job with as many reads or writes in flight as the
 * caller asked for, instead of one call and one GIL hand-off per I/O
 * thread. Because every helper is joined, a call returns only once no
 * thread of it can touch a buffer again (a hung helper keeps the call,
 * and so the pool op, running: the pool's timeout and late-return rules
 * hold unchanged). Helpers block every signal (Python's handlers run on
 * the main thread). At most FAN_LIVE_MAX helpers run in the process; past
 * that a call runs with fewer (at worst on its own thread).
 * `eager` helpers start at once; the others only as reads need them: a
 * thread reads with RWF_NOWAIT first (page cache only) and starts one
 * more helper when that read would block. Warm files then cost no more threads than the CPUs can use (a
 * copy and a hash per file are CPU work: 8 threads on 2 CPUs loaded
 * 256 KiB files 25% slower than 2), cold ones get as many reads in flight
 * as the caller allows. */
#define FAN_MAX 64
#define FAN_LIVE_MAX 256
enum { FAN_LOAD = 0, FAN_STORE = 1 };
static atomic_int fan_live = 0;
static atomic_long fan_started = 0; /* helpers started since load (tests) */

struct fx_fan {
    fx_item *items;
    Py_ssize_t n;
    atomic_long next;
    int kind;
    int base_fd;
    const char *base; /* its path: a load's bad file is removed through it resolved again */
    int flags;
    size_t alignment;
    const uint8_t *digest;
    mode_t mode;
    uint64_t pages, created_ns;
    atomic_int no_tmpfile; /* a store's first O_TMPFILE refusal holds for the rest */
    int max_helpers;       /* helpers this call may start in all */
    atomic_int started;    /* helpers started (tids[0..started-1], under mu) */
    pthread_mutex_t mu;
    pthread_t tids[FAN_MAX];
};

static void fan_run(fx_fan *f, fx_scratch *sc) {
    tl_fan = f;
    for (;;) {
        Py_ssize_t i = (Py_ssize_t)atomic_fetch_add(&f->next, 1);
        if (i >= f->n) break;
        fx_item *it = &f->items[i];
        if (f->kind == FAN_LOAD) {
            load_one(it, f->base_fd, f->base, f->flags, f->alignment, f->digest, sc);
        } else {
            int flags = f->flags | (atomic_load(&f->no_tmpfile) ? F_NO_TMPFILE : 0);
            store_one(it, f->base_fd, flags, f->mode, f->alignment, f->digest, f->pages,
                      f->created_ns, sc);
            if (it->tmpfile_err) atomic_store(&f->no_tmpfile, 1);
        }
    }
    tl_fan = NULL;
}

static void *fan_thread(void *arg) {
    fx_fan *f = (fx_fan *)arg;
    fx_scratch sc;
    if (scratch_alloc(&sc) == 0) { /* else: the other threads take its items */
        fan_run(f, &sc);
        free(sc.header);
    }
    atomic_fetch_sub(&fan_live, 1);
    return NULL;
}

/* Whether another helper could still help: one is left to start and a file
 * is left to take. */
static int fan_may_grow(const fx_fan *f) {
    return atomic_load(&f->started) < f->max_helpers &&
           atomic_load(&((fx_fan *)f)->next) < f->n;
}

/* Start up to `count` more helpers (never past max_helpers, FAN_LIVE_MAX).
 * Signals are blocked in them (Python's handlers run on the main thread). */
static void fan_start(fx_fan *f, int count) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_mutex_lock(&f->mu);
    for (int k = 0; k < count; k++) {
        int idx = atomic_load(&f->started);
        if (idx >= f->max_helpers) break;
        if (atomic_fetch_add(&fan_live, 1) >= FAN_LIVE_MAX ||
            pthread_create(&f->tids[idx], NULL, fan_thread, f) != 0) {
            atomic_fetch_sub(&fan_live, 1);
            f->max_helpers = idx; /* no more: the threads already running finish the batch */
            break;
        }
        atomic_store(&f->started, idx + 1);
        atomic_fetch_add(&fan_started, 1);
    }
    pthread_mutex_unlock(&f->mu);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void fan_grow(fx_fan *f) {
    if (fan_may_grow(f)) fan_start(f, 1);
}

/* Run every item of f on this thread and up to `helpers` more: `eager` of
 * them at once, the rest one per read that finds its file outside the page
 * cache (x_preadv). Every helper is joined before this returns. GIL released. */
static void fan_all(fx_fan *f, int helpers, int eager, fx_scratch *sc) {
    if (helpers > FAN_MAX) helpers = FAN_MAX;
    if ((Py_ssize_t)helpers > f->n - 1) helpers = f->n > 1 ? (int)(f->n - 1) : 0;
    if (helpers < 0) helpers = 0;
    f->max_helpers = helpers;
    atomic_init(&f->started, 0);
    pthread_mutex_init(&f->mu, NULL);
    if (eager > 0) fan_start(f, eager);
    fan_run(f, sc);
    /* A helper may start another until the files run out; join until none is left. */
    for (int joined = 0;;) {
        pthread_mutex_lock(&f->mu);
        int started = atomic_load(&f->started);
        pthread_mutex_unlock(&f->mu);
        if (joined >= started) break;
        while (joined < started) pthread_join(f->tids[joined++], NULL);
    }
    pthread_mutex_destroy(&f->mu);
}

static void fan_atfork_child(void) { atomic_store(&fan_live, 0); }

static PyObject *py_cold_direct_reads(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromLong(atomic_load(&cold_direct_reads));
}

static PyObject *py_fan_started(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromLong(atomic_load(&fan_started));
}

static int open_base(const char *base) { return fx_resolve(AT_FDCWD, base, O_RDONLY | O_DIRECTORY, 0, 0); }

static PyObject *py_store_batch(PyObject *self, PyObject *args) {
    (void)self;
    const char *base;
    PyObject *rels, *hashes, *groups, *bufs;
    Py_buffer digest;
    unsigned long long pages, created_ns;
    int flags, mode, helpers = 0;
    Py_ssize_t alignment;
    if (!PyArg_ParseTuple(args, "yOOOOy*KiiKn|i", &base, &rels, &hashes, &groups, &bufs, &digest,
                          &pages, &flags, &mode, &created_ns, &alignment, &helpers))
        return NULL;
    if (digest.len != 8 || alignment < 1 || PAGE % alignment || pages < 1) {
        PyBuffer_Release(&digest);
        PyErr_SetString(PyExc_ValueError, "digest must be 8 bytes, alignment divide 4096, pages >= 1");
        return NULL;
    }
    Py_ssize_t n = 0;
    fx_item *items = items_from(rels, hashes, groups, bufs, 0, &n);
    if (!items) {
        PyBuffer_Release(&digest);
        return NULL;
    }
    fx_scratch sc;
    if (scratch_alloc(&sc) != 0) {
        items_free(items, n);
        PyBuffer_Release(&digest);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    int base_fd = open_base(base);
    int base_err = errno;
    if (base_fd < 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            items[i].status = ST_FAILED;
            items[i].err = base_err;
            items[i].stage = SG_OPENBASE;
        }
    } else {
        /* one call is one root: its first O_TMPFILE refusal holds for the rest */
        fx_fan f = {.items = items, .n = n, .kind = FAN_STORE, .base_fd = base_fd,
                    .flags = flags, .alignment = (size_t)alignment,
                    .digest = (const uint8_t *)digest.buf, .mode = (mode_t)mode,
                    .pages = pages, .created_ns = created_ns};
        atomic_init(&f.next, 0);
        atomic_init(&f.no_tmpfile, 0);
        fan_all(&f, helpers, helpers, &sc); /* a write cannot ask whether it would block */
    }
    if (base_fd >= 0) close(base_fd);
    Py_END_ALLOW_THREADS
    free(sc.header);
    PyBuffer_Release(&digest);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        fx_item *it = &items[i];
        PyObject *t = Py_BuildValue("(iiKii)", it->status, it->err, (unsigned long long)it->nbytes,
                                    it->stage, it->tmpfile_err);
        if (!t) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, t);
    }
    items_free(items, n);
    return out;
}

static PyObject *py_load_batch(PyObject *self, PyObject *args) {
    (void)self;
    const char *base;
    PyObject *rels, *hashes, *groups, *bufs;
    Py_buffer digest;
    int flags, helpers = 0, eager = -1;
    Py_ssize_t alignment;
    if (!PyArg_ParseTuple(args, "yOOOOy*in|ii", &base, &rels, &hashes, &groups, &bufs, &digest,
                          &flags, &alignment, &helpers, &eager))
        return NULL;
    if (digest.len != 8 || alignment < 1 || PAGE % alignment) {
        PyBuffer_Release(&digest);
        PyErr_SetString(PyExc_ValueError, "digest must be 8 bytes and alignment divide 4096");
        return NULL;
    }
    Py_ssize_t n = 0;
    fx_item *items = items_from(rels, hashes, groups, bufs, 1, &n);
    if (!items) {
        PyBuffer_Release(&digest);
        return NULL;
    }
    fx_scratch sc;
    if (scratch_alloc(&sc) != 0) {
        items_free(items, n);
        PyBuffer_Release(&digest);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    int base_fd = open_base(base);
    int base_err = errno;
    if (base_fd < 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            items[i].err = base_err;
            items[i].status = base_err == ENOENT ? LD_MISSING : LD_ERROR;
            items[i].stage = base_err == ELOOP ? RS_SYMLINK : RS_OPEN;
            if (base_err == ELOOP) items[i].status = LD_CORRUPT;
        }
    } else {
        fx_fan f = {.items = items, .n = n, .kind = FAN_LOAD, .base_fd = base_fd, .base = base,
                    .flags = flags, .alignment = (size_t)alignment,
                    .digest = (const uint8_t *)digest.buf};
        atomic_init(&f.next, 0);
        atomic_init(&f.no_tmpfile, 0);
        fan_all(&f, helpers, eager < 0 ? helpers : eager, &sc);
    }
    if (base_fd >= 0) close(base_fd);
    Py_END_ALLOW_THREADS
    free(sc.header);
    PyBuffer_Release(&digest);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        fx_item *it = &items[i];
        PyObject *t = Py_BuildValue("(iiKiii)", it->status, it->err, (unsigned long long)it->nbytes,
                                    it->stage, it->removed, it->rm_err);
        if (!t) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, t);
    }
    items_free(items, n);
    return out;
}

/* Presence of each rel below base: resolved with no symlink in any
 * component (a file reached through a symlinked fan-out directory is not
 * present: test_contract_block_store's symlinked-directory case), then
 * fstat (O_PATH never blocks on a FIFO); 1 = a regular file. With prefix
 * it stops after the first miss. Returns how many answers it wrote; runs
 * without the GIL (no Python object touched). */
static Py_ssize_t lookup_run(const char *base, const char *const *rels, Py_ssize_t n, int prefix,
                             uint8_t *res) {
    Py_ssize_t done = n;
    memset(res, 0, (size_t)n);
    int base_fd = open_base(base);
    for (Py_ssize_t i = 0; base_fd >= 0 && i < n; i++) {
        struct stat st;
        fx_inject inj;
        int ok = 0;
        if (fx_hook(OP_STAT, &inj) == 0) {
            int fd = fx_resolve(base_fd, rels[i], O_PATH | O_NOFOLLOW, 0, 1);
            if (fd >= 0) {
                ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
                close(fd);
            }
        }
        res[i] = (uint8_t)ok;
        if (!ok && prefix) {
            done = i + 1;
            break;
        }
    }
    if (base_fd >= 0) close(base_fd);
    return done;
}

#ifndef RESOLVE_CACHED
#define RESOLVE_CACHED 0x20
#endif
#ifndef AT_STATX_DONT_SYNC
#define AT_STATX_DONT_SYNC 0x4000
#endif
/* 0 once the kernel refused RESOLVE_CACHED (EINVAL: before Linux 5.12) */
static atomic_int cached_ok = 1;

/* The probe answered from the kernel's caches alone, on the caller's thread
 * with the GIL held (lookup_batch and lookup_within try it first). openat2
 * with RESOLVE_CACHED fails with EAGAIN rather than read a directory or
 * revalidate a dentry with a server, and statx with AT_STATX_DONT_SYNC
 * takes the inode's cached type (a file's type never changes), so no step
 * waits on a device or a mount: microseconds per key. The caller then never
 * gives the GIL away, and never waits the switch interval (5 ms) to take it
 * back from a scheduler thread that never sleeps: in vLLM's in-process
 * engine every prompt's lookup paid it. Same answers as lookup_run (the
 * base and every component reached with no symlink, a regular file). Returns
 * how many answers it wrote, or -1 when some key needs I/O, fault injection
 * is armed, or the kernel lacks openat2 or RESOLVE_CACHED: the caller then
 * probes every key the slow way. Only where the caller says the caches are
 * the truth (`cached`: a local filesystem, whose entries no other host
 * changes): on FUSE, NFS or CephFS a cached entry can name a file another
 * host removed, which the slow path's fstat asks the server about
 * (tests/sharedfs: host b's gc, host a's lookup). */
static Py_ssize_t lookup_cached(const char *base, const fx_item *items, Py_ssize_t n, int prefix,
                                uint8_t *res) {
#if defined(SYS_openat2) && defined(SYS_statx)
    if (!atomic_load_explicit(&use_openat2, memory_order_relaxed) ||
        !atomic_load_explicit(&cached_ok, memory_order_relaxed) ||
        atomic_load_explicit(&armed, memory_order_relaxed))
        return -1;
    int base_fd = fx_openat2_raw(AT_FDCWD, base, O_PATH | O_DIRECTORY, 0, RESOLVE_NO_SYMLINKS | RESOLVE_CACHED);
    if (base_fd < 0) {
        if (errno == EINVAL) atomic_store(&cached_ok, 0);
        return -1; /* a missing base is the slow path's to report (it answers all absent) */
    }
    Py_ssize_t done = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = 0;
        int fd = fx_openat2_raw(base_fd, items[i].rel, O_PATH | O_NOFOLLOW, 0,
                                RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH | RESOLVE_CACHED);
        if (fd < 0 && errno == EAGAIN) {
            done = -1;
            break;
        }
        if (fd >= 0) {
            struct statx stx;
            if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE, &stx) != 0) {
                close(fd);
                done = -1; /* leave the answer to the slow path's fstat */
                break;
            }
            ok = (stx.stx_mask & STATX_TYPE) && S_ISREG(stx.stx_mode);
            close(fd);
        }
        res[i] = (uint8_t)ok;
        if (!ok && prefix) {
            done = i + 1;
            break;
        }
    }
    close(base_fd);
    return done;
#else
    (void)base; (void)items; (void)n; (void)prefix; (void)res;
    return -1;
#endif
}

static PyObject *py_lookup_batch(PyObject *self, PyObject *args) {
    (void)self;
    const char *base;
    PyObject *rels;
    int prefix, cached = 0;
    if (!PyArg_ParseTuple(args, "yOp|p", &base, &rels, &prefix, &cached)) return NULL;
    Py_ssize_t n = 0;
    fx_item *items = items_from(rels, NULL, NULL, NULL, 0, &n);
    if (!items) return NULL;
    const char **names = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *names);
    PyObject *out = names ? PyBytes_FromStringAndSize(NULL, n) : PyErr_NoMemory();
    if (!out) {
        PyMem_Free(names);
        items_free(items, n);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) names[i] = items[i].rel;
    uint8_t *res = (uint8_t *)PyBytes_AS_STRING(out);
    Py_ssize_t done = cached ? lookup_cached(base, items, n, prefix, res) : -1;
    if (done < 0) {
        Py_BEGIN_ALLOW_THREADS
        done = lookup_run(base, names, n, prefix, res);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(names);
    items_free(items, n);
    if (done < n && _PyBytes_Resize(&out, done) != 0) return NULL;
    return out;
}

/* lookup_within: lookup_batch with a deadline kept in C. A probe the
 * caches answer (lookup_cached) returns at once; any other runs on
 * a detached C thread that owns copies of its inputs; the caller waits on
 * a condition variable with the GIL released ONCE and takes it back ONCE
 * (a probe handed to a Python thread costs two more GIL hand-offs, each up
 * to the switch interval behind a scheduler that never sleeps). Past the
 * deadline the caller gets None and the thread, abandoned, frees the job
 * when its system call returns; while LK_MAX_STUCK such threads are still
 * stuck (a dead mount) no new one is started: None at once. Exactly one of
 * waiter and thread frees the job (decided under the job's mutex). */
#define LK_MAX_STUCK 4
/* The longest wait: threading.TIMEOUT_MAX's 2**63 ns in seconds. A longer
 * deadline (inf included) is clamped: the deadline's tv_sec stays far from
 * overflow and its tv_nsec in [0, 1e9), which pthread_cond_timedwait needs. */
#define LK_MAX_WAIT_S 9223372036.0
static atomic_int lk_stuck = 0;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int finished, abandoned, prefix;
    Py_ssize_t n, done;
    const char **rels; /* into blob */
    char *blob;        /* base\0rel0\0rel1\0... */
    uint8_t *res;
} lk_job;

static void lk_free(lk_job *j) {
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j->rels);
    free(j->blob);
    free(j->res);
    free(j);
}

static void *lk_thread(void *arg) {
    lk_job *j = arg;
    Py_ssize_t done = lookup_run(j->blob, j->rels, j->n, j->prefix, j->res);
    pthread_mutex_lock(&j->mu);
    j->done = done;
    j->finished = 1;
    int abandoned = j->abandoned;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (abandoned) {
        atomic_fetch_sub(&lk_stuck, 1);
        lk_free(j);
    }
    return NULL;
}

static lk_job *lk_new(const char *base, fx_item *items, Py_ssize_t n, int prefix) {
    lk_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    size_t total = strlen(base) + 1;
    for (Py_ssize_t i = 0; i < n; i++) total += (size_t)items[i].rel_len + 1;
    j->blob = malloc(total);
    j->rels = malloc((size_t)(n ? n : 1) * sizeof *j->rels);
    j->res = malloc((size_t)(n ? n : 1));
    pthread_condattr_t ca;
    int cv_ok = pthread_condattr_init(&ca) == 0;
    if (cv_ok) {
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        cv_ok = pthread_cond_init(&j->cv, &ca) == 0;
        pthread_condattr_destroy(&ca);
    }
    if (!j->blob || !j->rels || !j->res || !cv_ok || pthread_mutex_init(&j->mu, NULL) != 0) {
        if (cv_ok) pthread_cond_destroy(&j->cv);
        free(j->rels);
        free(j->blob);
        free(j->res);
        free(j);
        return NULL;
    }
    char *p = j->blob;
    size_t blen = strlen(base) + 1;
    memcpy(p, base, blen);
    p += blen;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(p, items[i].rel, (size_t)items[i].rel_len + 1);
        j->rels[i] = p;
        p += items[i].rel_len + 1;
    }
    j->n = n;
    j->prefix = prefix;
    return j;
}

static PyObject *py_lookup_within(PyObject *self, PyObject *args) {
    (void)self;
    const char *base;
    PyObject *rels;
    int prefix, cached = 0;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "yOpd|p", &base, &rels, &prefix, &timeout_s, &cached)) return NULL;
    if (!(timeout_s >= 0)) {
        PyErr_SetString(PyExc_ValueError, "lookup_within: timeout_s must be seconds >= 0 (not nan)");
        return NULL;
    }
    if (timeout_s > LK_MAX_WAIT_S) timeout_s = LK_MAX_WAIT_S; /* inf included: no overflow below */
    Py_ssize_t n = 0;
    fx_item *items = items_from(rels, NULL, NULL, NULL, 0, &n);
    if (!items) return NULL;
    if (cached) {
        PyObject *fast = PyBytes_FromStringAndSize(NULL, n);
        if (!fast) {
            items_free(items, n);
            return NULL;
        }
        Py_ssize_t quick = lookup_cached(base, items, n, prefix, (uint8_t *)PyBytes_AS_STRING(fast));
        if (quick >= 0) { /* answered from the caches: no thread, no GIL release */
            items_free(items, n);
            if (quick < n && _PyBytes_Resize(&fast, quick) != 0) return NULL;
            return fast;
        }
        Py_DECREF(fast);
    }
    if (atomic_load(&lk_stuck) >= LK_MAX_STUCK) {
        items_free(items, n);
        Py_RETURN_NONE;
    }
    lk_job *j = lk_new(base, items, n, prefix);
    items_free(items, n);
    if (!j) return PyErr_NoMemory();
    int finished = 0, started;
    Py_BEGIN_ALLOW_THREADS
    pthread_attr_t attr;
    pthread_t tid;
    started = pthread_attr_init(&attr) == 0;
    if (started) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        started = pthread_create(&tid, &attr, lk_thread, j) == 0;
        pthread_attr_destroy(&attr);
    }
    if (started) {
        struct timespec dl;
        clock_gettime(CLOCK_MONOTONIC, &dl);
        double whole = (double)(long)timeout_s;
        dl.tv_sec += (time_t)whole;
        dl.tv_nsec += (long)((timeout_s - whole) * 1e9);
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec += 1;
            dl.tv_nsec -= 1000000000L;
        }
        pthread_mutex_lock(&j->mu);
        int rc = 0;
        /* Any error ends the wait as a timeout would (EINVAL from a bad
         * deadline once spun here forever, holding the job's mutex). */
        while (!j->finished && rc == 0) rc = pthread_cond_timedwait(&j->cv, &j->mu, &dl);
        finished = j->finished;
        if (!finished) {
            j->abandoned = 1;
            atomic_fetch_add(&lk_stuck, 1);
        }
        pthread_mutex_unlock(&j->mu);
    }
    Py_END_ALLOW_THREADS
    if (!started) {
        lk_free(j);
        Py_RETURN_NONE; /* no thread to be had: absent, as past the deadline */
    }
    if (!finished) Py_RETURN_NONE; /* the thread frees the job */
    PyObject *out = PyBytes_FromStringAndSize((const char *)j->res, j->done);
    lk_free(j);
    return out;
}

/* A forked child has none of its parent's stuck threads (their jobs are
 * leaked there, never touched): it starts with a count of 0. */
static void lk_atfork_child(void) { atomic_store(&lk_stuck, 0); }

static PyObject *py_lookup_stuck(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromLong(atomic_load(&lk_stuck));
}

/* The start of a per-name batch call taking (base, rels): the parsed base,
 * the items and a zeroed result of one byte per name (its bytes object,
 * returned; NULL with an exception set on failure). */
static PyObject *name_batch_start(PyObject *args, const char **base, fx_item **items, Py_ssize_t *n,
                                  uint8_t **res) {
    PyObject *rels;
    if (!PyArg_ParseTuple(args, "yO", base, &rels)) return NULL;
    *n = 0;
    *items = items_from(rels, NULL, NULL, NULL, 0, n);
    if (!*items) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, *n);
    if (!out) {
        items_free(*items, *n);
        return NULL;
    }
    *res = (uint8_t *)PyBytes_AS_STRING(out);
    memset(*res, 0, (size_t)*n);
    return out;
}

/* Set each block file's mtime to now (its LRU recency), one call per batch (touch_one per name; the C
 * engine's touch jobs run touch_one too):
 * the directory resolved below the base with no symlink (reused while the
 * names share it), the file opened O_NOFOLLOW|O_NONBLOCK, touched only when
 * it is a regular file with one link (a second link is someone else's name
 * for the inode), through its fd. Returns bytes (1: touched). */
static int touch_one(int base_fd, const char *rel) {
    /* resolved below base_fd with no symlink in any component; O_NONBLOCK:
     * a FIFO planted at the name never blocks the open */
    fx_inject inj; /* the fault seam's own "touch" op: a rule for "open" never meets a recency touch */
    if (fx_hook(OP_TOUCH, &inj)) return 0;
    int fd = fx_resolve(base_fd, rel, O_RDONLY | O_NOFOLLOW | O_NONBLOCK, 0, 1);
    if (fd < 0) return 0;
    struct stat st;
    int done = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 && futimens(fd, NULL) == 0;
    close(fd);
    return done;
}

static PyObject *py_touch_batch(PyObject *self, PyObject *args) {
    (void)self;
    const char *base;
    fx_item *items;
    Py_ssize_t n;
    uint8_t *res;
    PyObject *out = name_batch_start(args, &base, &items, &n, &res);
    if (!out) return NULL;
    Py_BEGIN_ALLOW_THREADS
    int base_fd = open_base(base);
    for (Py_ssize_t i = 0; base_fd >= 0 && i < n; i++) res[i] = (uint8_t)touch_one(base_fd, items[i].rel);
    if (base_fd >= 0) close(base_fd);
    Py_END_ALLOW_THREADS
    items_free(items, n);
    return out;
}

/* Remove each block file's name, one call per batch: its directory resolved
 * below the base with no symlink in any component (reused while the names
 * share it), then unlinkat (a symlink at the name is removed itself, never
 * followed; a directory there stays). Returns bytes (1: the name was
 * unlinked; 0: nothing there, or it could not be removed). */
static PyObject *py_remove_batch(PyObject *self, PyObject *args) {
    (void)self;
    const char *base;
    fx_item *items;
    Py_ssize_t n;
    uint8_t *res;
    PyObject *out = name_batch_start(args, &base, &items, &n, &res);
    if (!out) return NULL;
    Py_BEGIN_ALLOW_THREADS
    int base_fd = open_base(base);
    int dfd = -1;
    char dir[PATH_MAX], held[PATH_MAX];
    held[0] = 0;
    for (Py_ssize_t i = 0; base_fd >= 0 && i < n; i++) {
        const char *rel = items[i].rel;
        const char *slash = strrchr(rel, '/');
        size_t dlen = slash ? (size_t)(slash - rel) : 0;
        if (dlen >= sizeof dir) continue;
        memcpy(dir, rel, dlen);
        dir[dlen] = 0;
        if (dfd < 0 || strcmp(dir, held) != 0) {
            if (dfd >= 0) close(dfd);
            dfd = x_opendir(base_fd, dir);
            memcpy(held, dir, dlen + 1);
            if (dfd < 0) {
                held[0] = 0;
                continue;
            }
        }
        if (x_unlinkat(dfd, slash ? slash + 1 : rel) == 0) res[i] = 1;
    }
    if (dfd >= 0) close(dfd);
    if (base_fd >= 0) close(base_fd);
    Py_END_ALLOW_THREADS
    items_free(items, n);
    return out;
}

static PyObject *py_xxh3_64(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) != 0) return NULL;
    uint64_t h;
    if (b.len >= (1 << 20)) {
        Py_BEGIN_ALLOW_THREADS
        h = fx_xxh3_64(b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else {
        h = fx_xxh3_64(b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_xxh3_64_impl(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    int impl;
    if (!PyArg_ParseTuple(args, "y*i", &b, &impl)) return NULL;
    if (impl < 0 || impl > fx_impl) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "impl must be in 0..%d on this CPU", fx_impl);
        return NULL;
    }
    uint64_t h = fx_xxh3_64_impl((const uint8_t *)b.buf, (size_t)b.len, impl);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    int hw = 1;
    if (!PyArg_ParseTuple(args, "y*|p", &b, &hw)) return NULL;
    uint32_t c;
#if defined(__x86_64__)
    if (hw && __builtin_cpu_supports("sse4.2"))
        c = fx_crc32c_hw((const uint8_t *)b.buf, (size_t)b.len);
    else
#endif
        c = fx_crc32c_table((const uint8_t *)b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* Time `reps` checksums of a buffer without the GIL: (seconds, last value).
 * kind 0 xxh3 (best impl), 1 crc32c hw, 2 crc32c table. */
static PyObject *py_checksum_bench(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    int kind;
    Py_ssize_t reps;
    if (!PyArg_ParseTuple(args, "y*in", &b, &kind, &reps)) return NULL;
    uint64_t v = 0;
    struct timespec t0, t1;
    Py_BEGIN_ALLOW_THREADS
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t i = 0; i < reps; i++) {
        if (kind == 0)
            v ^= fx_xxh3_64(b.buf, (size_t)b.len);
#if defined(__x86_64__)
        else if (kind == 1 && __builtin_cpu_supports("sse4.2"))
            v ^= fx_crc32c_hw((const uint8_t *)b.buf, (size_t)b.len);
#endif
        else
            v ^= fx_crc32c_table((const uint8_t *)b.buf, (size_t)b.len);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    return Py_BuildValue("(dK)", s, (unsigned long long)v);
}

static int op_index(const char *name) {
    for (int i = 0; i < OP_COUNT; i++)
        if (strcmp(op_names[i], name) == 0) return i;
    return -1;
}

static PyObject *py_fault_set(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"op", "err", "nth", "times", "delay_s", "short", "after", NULL};
    const char *op;
    int err = 0, after = 0;
    long nth = 1, times = 1, short_n = 0;
    double delay = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|illdlp", kwlist, &op, &err, &nth, &times, &delay,
                                     &short_n, &after))
        return NULL;
    int idx = op_index(op);
    if (idx < 0) {
        PyErr_Format(PyExc_ValueError, "unknown op %R for fault_set", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    if (nth < 1 || delay < 0 || short_n < 0 || err < 0) {
        PyErr_SetString(PyExc_ValueError, "fault_set: nth >= 1, delay_s >= 0, short >= 0, err >= 0");
        return NULL;
    }
    pthread_mutex_lock(&rules_lock);
    if (nrules == MAX_RULES) {
        pthread_mutex_unlock(&rules_lock);
        PyErr_SetString(PyExc_RuntimeError, "fault_set: rule table full (fault_clear() first)");
        return NULL;
    }
    fx_rule *r = &rules[nrules++];
    memset(r, 0, sizeof *r);
    r->op = idx;
    r->err = err;
    r->nth = nth;
    r->times = times;
    r->delay_ns = (long)(delay * 1e9);
    r->short_n = short_n;
    r->after = after;
    atomic_store(&armed, 1);
    pthread_mutex_unlock(&rules_lock);
    Py_RETURN_NONE;
}

static PyObject *py_fault_clear(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pthread_mutex_lock(&rules_lock);
    nrules = 0;
    memset(op_calls, 0, sizeof op_calls);
    atomic_store(&armed, 0);
    pthread_mutex_unlock(&rules_lock);
    Py_RETURN_NONE;
}

static PyObject *py_fault_count(PyObject *self, PyObject *arg) {
    (void)self;
    const char *op = PyUnicode_AsUTF8(arg);
    if (!op) return NULL;
    int idx = op_index(op);
    if (idx < 0) {
        PyErr_Format(PyExc_ValueError, "unknown op %R", arg);
        return NULL;
    }
    pthread_mutex_lock(&rules_lock);
    long c = op_calls[idx];
    pthread_mutex_unlock(&rules_lock);
    return PyLong_FromLong(c);
}

static PyObject *py_configure(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"host", "openat2", "tmpfile", "format_version", "cold_direct_min", NULL};
    const char *host = NULL;
    int o2 = -1, tmpf = -1, ver = -1;
    long long cold_min = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ziiiL", kwlist, &host, &o2, &tmpf, &ver, &cold_min))
        return NULL;
    if (cold_min >= 0) atomic_store(&cold_direct_min, (uint64_t)cold_min);
    if (host) snprintf(host_name, sizeof host_name, "%s", host);
    if (o2 == 1) {
        int fd = fx_openat2_raw(AT_FDCWD, "/", O_RDONLY | O_DIRECTORY, 0, RESOLVE_NO_SYMLINKS);
        if (fd >= 0) close(fd);
        atomic_store(&use_openat2, fd >= 0);
    } else if (o2 == 0) {
        atomic_store(&use_openat2, 0);
    }
    if (tmpf >= 0) atomic_store(&tmpfile_off, !tmpf || !O_TMPFILE);
    if (ver > 0) format_version = ver;
    return Py_BuildValue("{s:s,s:O,s:O,s:i,s:K,s:s}", "host", host_name, "openat2",
                         atomic_load(&use_openat2) ? Py_True : Py_False, "tmpfile",
                         atomic_load(&tmpfile_off) || !O_TMPFILE ? Py_False : Py_True, "format_version",
                         format_version, "cold_direct_min",
                         (unsigned long long)atomic_load(&cold_direct_min), "xxh3_impl",
                         fx_impl == 2 ? "avx2" : fx_impl == 1 ? "sse2" : "scalar");
}

/* The job engine (persistent workers, deadlines, fences): its own file. */
#include "_native_engine.c"

static PyMethodDef methods[] = {
    ENGINE_METHODS
    {"store_batch", py_store_batch, METH_VARARGS,
     "store_batch(base, rels, hashes, groups, payloads, digest, page_count, flags, mode, "
     "created_ns, alignment, helpers=0) -> [(status, errno, nbytes, stage, tmpfile_refused_errno)] "
     "(helpers: up to this many more threads, started at once and joined before the call "
     "returns)"},
    {"load_batch", py_load_batch, METH_VARARGS,
     "load_batch(base, rels, hashes, groups, buffers, digest, flags, alignment, helpers=0, "
     "eager=helpers) -> [(status, errno, nbytes, reason, dev, ino)] (helpers: as store_batch's, "
     "eager of them started at once, the rest as reads would block)"},
    {"touch_batch", py_touch_batch, METH_VARARGS,
     "touch_batch(base, rels) -> bytes (1: a regular file with one link had its mtime set to now)"},
    {"remove_batch", py_remove_batch, METH_VARARGS,
     "remove_batch(base, rels) -> bytes (1: the name was unlinked)"},
    {"lookup_batch", py_lookup_batch, METH_VARARGS,
     "lookup_batch(base, rels, prefix, cached=False) -> bytes (1: a regular file is there)"},
    {"lookup_within", py_lookup_within, METH_VARARGS,
     "lookup_within(base, rels, prefix, timeout_s, cached=False) -> bytes | None (lookup_batch on a C thread, "
     "waited for at most timeout_s; None past it)"},
    {"lookup_stuck", py_lookup_stuck, METH_NOARGS,
     "lookup_stuck() -> int (lookup_within threads abandoned past their deadline, still running)"},
    {"fan_started", py_fan_started, METH_NOARGS,
     "fan_started() -> int (helper threads started by store_batch/load_batch since load; tests)"},
    {"cold_direct_reads", py_cold_direct_reads, METH_NOARGS,
     "cold_direct_reads() -> int (loads F_DIRECT_COLD read with O_DIRECT since load; tests)"},
    {"xxh3_64", py_xxh3_64, METH_O, "XXH3-64 (seed 0) of a buffer"},
    {"xxh3_64_impl", py_xxh3_64_impl, METH_VARARGS,
     "xxh3_64_impl(buf, impl): 0 scalar, 1 sse2, 2 avx2 (tests)"},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(buf, hw=True): CRC32C (measurement only)"},
    {"checksum_bench", py_checksum_bench, METH_VARARGS,
     "checksum_bench(buf, kind, reps) -> (seconds, value)"},
    {"fault_set", (PyCFunction)(void (*)(void))py_fault_set, METH_VARARGS | METH_KEYWORDS,
     "fault_set(op, err=0, nth=1, times=1, delay_s=0, short=0, after=False) (tests)"},
    {"fault_clear", py_fault_clear, METH_NOARGS, "disarm every fault rule"},
    {"fault_count", py_fault_count, METH_O, "calls of op seen while armed"},
    {"configure", (PyCFunction)(void (*)(void))py_configure, METH_VARARGS | METH_KEYWORDS,
     "configure(host=None, openat2=-1, tmpfile=-1, format_version=-1, cold_direct_min=-1) -> "
     "settings (tmpfile, cold_direct_min: process-wide overrides for tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native",
                                    "fstier's native block I/O path (see _native.c)", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    fx_pick_impl();
    fx_crc_init();
    int fd = fx_openat2_raw(AT_FDCWD, "/", O_RDONLY | O_DIRECTORY, 0, RESOLVE_NO_SYMLINKS);
    if (fd >= 0) close(fd);
    atomic_store(&use_openat2, fd >= 0);
    pthread_atfork(NULL, NULL, lk_atfork_child);
    pthread_atfork(NULL, NULL, fan_atfork_child);
    pthread_atfork(NULL, NULL, ce_atfork_child);
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    PyModule_AddIntConstant(m, "F_CHECKSUM", F_CHECKSUM);
    PyModule_AddIntConstant(m, "F_DIRECT", F_DIRECT);
    PyModule_AddIntConstant(m, "F_DIRECT_COLD", F_DIRECT_COLD);
    PyModule_AddIntConstant(m, "COLD_DIRECT_MIN", (long)COLD_DIRECT_MIN);
    PyModule_AddIntConstant(m, "F_FSYNC_FILE", F_FSYNC_FILE);
    PyModule_AddIntConstant(m, "F_FSYNC_DIR", F_FSYNC_DIR);
    PyModule_AddIntConstant(m, "F_MKDIR", F_MKDIR);
    PyModule_AddIntConstant(m, "F_NO_TMPFILE", F_NO_TMPFILE);
    return m;
}
