/*
 * The C ceiling for fstier's per-file path: the publish protocol and the
 * cold read, in plain C with no checksum, no header encoding and no Python.
 * benchmarks/bench_vllm_tier.py builds it (cc -O2) and runs it in the same
 * run as the tiers, so FstierTier's figures are read as a fraction of it.
 *
 *   ceiling_loop store DIR FILES BYTES THREADS FANOUT DIRECT
 *     FANOUT "existing": DIR/<hhh>/ directories (4096) made before the timed
 *            loop, every store goes into an existing directory (format v2);
 *            "perfile": every store makes its own leaf directory first
 *            (DIR/<hhh>/<hh>/ of format v1 at cache sizes below ~1e7 files).
 *            "flat": one directory DIR/flat (CEILING_OFFSET=N names files from
 *            N on, so a second run adds to a directory already holding N).
 *            "lazy": the directories of "existing", each made by the first
 *            store into it (open; on ENOENT mkdir, then open), as fstier's
 *            store makes them in a fresh root.
 *     Per file: O_TMPFILE (O_DIRECT when DIRECT=1) in the directory, one
 *     pwrite of 4096 + BYTES rounded up to 4096, linkat to its name, close.
 *   ceiling_loop load DIR FILES BYTES THREADS FANOUT DIRECT
 *     Per file: open (O_DIRECT when DIRECT=1), one pread, close.
 *
 * Prints one JSON line: files, seconds, files_per_s, gb_per_s,
 * user_us_per_file, sys_us_per_file.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static const char *dir;
static long files, bytes, nthreads;
static int perfile, flat, lazy, direct, loading;
static long offset;
static size_t fbytes;

static void name_of(long i, char *d, size_t dn, char *f, size_t fn) {
    /* a spread of hex names, like hashes: multiplicative mix of i */
    uint64_t h = (uint64_t)(i + offset) * 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    i += offset;
    if (flat)
        snprintf(d, dn, "%s/flat", dir);
    else if (perfile)
        snprintf(d, dn, "%s/%03llx/%02llx", dir, (unsigned long long)(h >> 52),
                 (unsigned long long)((h >> 44) & 0xff));
    else
        snprintf(d, dn, "%s/%03llx", dir, (unsigned long long)(h >> 52));
    snprintf(f, fn, "%016llx-%ld.bin", (unsigned long long)h, i);
}

static void *worker(void *arg) {
    long t = (long)arg;
    void *buf;
    if (posix_memalign(&buf, 4096, fbytes)) return (void *)1;
    memset(buf, (int)t + 1, fbytes);
    char d[4096], f[256], path[4400], proc[64];
    for (long i = t; i < files; i += nthreads) {
        name_of(i, d, sizeof d, f, sizeof f);
        if (loading) {
            snprintf(path, sizeof path, "%s/%s", d, f);
            int fd = open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
            if (fd < 0 || pread(fd, buf, fbytes, 0) != (ssize_t)fbytes) return (void *)2;
            close(fd);
            continue;
        }
        if (perfile) {
            char parent[4096];
            snprintf(parent, sizeof parent, "%s", d);
            *strrchr(parent, '/') = 0;
            mkdir(parent, 0755);
            if (mkdir(d, 0755) != 0 && errno != EEXIST) return (void *)3;
        }
        int dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0 && errno == ENOENT && lazy) {
            if (mkdir(d, 0755) != 0 && errno != EEXIST) return (void *)3;
            dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        }
        if (dfd < 0) return (void *)4;
        int fd = openat(dfd, ".", O_WRONLY | O_TMPFILE | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
        if (fd < 0 || pwrite(fd, buf, fbytes, 0) != (ssize_t)fbytes) return (void *)5;
        snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
        if (linkat(AT_FDCWD, proc, dfd, f, AT_SYMLINK_FOLLOW) != 0) return (void *)6;
        close(fd);
        close(dfd);
    }
    free(buf);
    return NULL;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double tv(struct timeval t) { return (double)t.tv_sec + (double)t.tv_usec * 1e-6; }

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s store|load DIR FILES BYTES THREADS existing|perfile|flat|lazy DIRECT\n",
                argv[0]);
        return 2;
    }
    loading = strcmp(argv[1], "load") == 0;
    dir = argv[2];
    files = atol(argv[3]);
    bytes = atol(argv[4]);
    nthreads = atol(argv[5]);
    perfile = strcmp(argv[6], "perfile") == 0;
    flat = strcmp(argv[6], "flat") == 0;
    lazy = strcmp(argv[6], "lazy") == 0;
    offset = getenv("CEILING_OFFSET") ? atol(getenv("CEILING_OFFSET")) : 0;
    direct = atoi(argv[7]);
    fbytes = 4096 + (((size_t)bytes + 4095) & ~(size_t)4095);
    if (!loading && flat) {
        char d[4096];
        snprintf(d, sizeof d, "%s/flat", dir);
        mkdir(d, 0755);
    }
    if (!loading && !perfile && !flat && !lazy) {
        char d[4096];
        for (int i = 0; i < 4096; i++) {
            snprintf(d, sizeof d, "%s/%03x", dir, i);
            mkdir(d, 0755);
        }
    }
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    double t0 = now();
    pthread_t th[256];
    if (nthreads < 1 || nthreads > 256) return 2;
    for (long t = 0; t < nthreads; t++) pthread_create(&th[t], NULL, worker, (void *)t);
    int bad = 0;
    for (long t = 0; t < nthreads; t++) {
        void *rc;
        pthread_join(th[t], &rc);
        if (rc) bad = (int)(long)rc;
    }
    double s = now() - t0;
    getrusage(RUSAGE_SELF, &r1);
    if (bad) {
        fprintf(stderr, "ceiling_loop: step %d failed: %s\n", bad, strerror(errno));
        return 1;
    }
    printf("{\"files\": %ld, \"seconds\": %.6f, \"files_per_s\": %.1f, \"gb_per_s\": %.4f, "
           "\"user_us_per_file\": %.2f, \"sys_us_per_file\": %.2f}\n",
           files, s, files / s, (double)files * (double)bytes / s / 1e9,
           (tv(r1.ru_utime) - tv(r0.ru_utime)) * 1e6 / files,
           (tv(r1.ru_stime) - tv(r0.ru_stime)) * 1e6 / files);
    return 0;
}
