/*
 * The native job engine: persistent C worker threads that move whole jobs
 * of block stores and loads, with deadlines and fences kept in C. Included
 * by _native.c (it reuses that file's per-key work: store_one, load_one,
 * items_from, open_base, the fault seam), exposed as engine_* functions.
 *
 * - An engine has `read` and `write` priority workers (pthreads, started
 *   once, every signal blocked). Loads queue on the read queue, stores on
 *   the write queue; a read worker takes from the read queue first and from
 *   the write queue only when it is empty, a write worker the reverse. A
 *   worker takes the NEXT KEY of the first queued job with room (a job runs
 *   on at most its `spread` workers at once, its keys taken in order), so
 *   an idle worker joins any job: no thread is started or joined per call. Workers never take the GIL
 *   and touch no Python object: a job's buffers were pinned (Py_buffer) at
 *   submit and are released at collect, under the GIL.
 * - submit (engine_submit): one call per job with its keys (relative paths,
 *   hashes, groups), buffers, kind, flags, deadline and a 64-bit tag.
 * - completion: a finished job (and later a released one, see below) is
 *   appended to the engine's completion list and the engine's eventfd is
 *   written, or, for a job submitted with a notify fd (a caller's own
 *   eventfd, e.g. LMCache's: the job holds a dup of it until it is freed),
 *   that fd instead, in C under the mutex once the event is queued, so a
 *   caller woken by it always finds the event; engine_collect returns one compact tuple per event: uniform
 *   jobs one shared per-key tuple, others a byte per key naming one of a
 *   few shared success tuples, with a tuple only for each key that failed
 *   (ce_mixed), and a mark byte per key only when some key did not complete
 *   (timed out, expired, cancelled).
 * - a load's proven-corrupt file (or a planted link at its name) is removed
 *   by the worker that read it (remove_bad, _native.c), before the job is
 *   published: its summary says whether it was. A store that failed ENOENT
 *   (its namespace removed under the tier) is stored once more after the
 *   directories below the root and the manifest are made again
 *   (ce_store_again, from what engine_namespace registered per block store).
 * - touch jobs (engine_touch: the recency flush) queue on the write queue
 *   and set each name's mtime (touch_one, _native.c), with a deadline as a
 *   store's.
 * - deadlines: a watchdog thread wakes at the earliest deadline of a job in
 *   flight. A job past it completes at once: keys running then are marked
 *   timed out (their slots fenced by the caller), keys not started expire
 *   and never run. Each worker stuck in a timed-out key is replaced by a new
 *   one; when the job's last late key returns (its result dropped) a
 *   "released" event is queued: from then on no thread can touch a buffer
 *   of the job. The watchdog's clock is injectable (engine_clock): a test
 *   sets a manual time and moves it.
 * - fork: a child never inherits workers or jobs; every engine call in a
 *   process other than the one that made the engine fails: the atfork
 *   handler moves the process's generation on, and each engine records the
 *   generation it was made in.
 *
 * Invariants: every job and queue field changes under the engine's mutex;
 * a job is published exactly once; a key given up on never publishes; the
 * job's memory (and its pinned buffers) is freed only at collect, after the
 * job was published and every late key returned.
 *
 * Costs: per key one mutex acquisition to take it and one to finish it; one
 * eventfd write per published event; the watchdog scans the jobs in flight
 * once per wake-up (at a deadline or a submit with an earlier one).
 */
#include <poll.h>
#include <sys/eventfd.h>

enum { CE_LOAD = 0, CE_STORE = 1, CE_TOUCH = 2 /* engine_touch: mtimes (the recency flush), write queue */ };
/* per-key state */
enum { KS_QUEUED = 0, KS_RUNNING, KS_DONE, KS_TIMED_OUT, KS_EXPIRED, KS_CANCELLED };
/* mark bytes of a summary: what stands for a key that returned nothing */
enum { MK_DONE = 0, MK_TIMED_OUT = 1, MK_EXPIRED = 2, MK_CANCELLED = 3 };
enum { EV_DONE = 0, EV_RELEASED = 1 };

typedef struct ce_job ce_job;
struct ce_job {
    ce_job *qnext;             /* in its queue */
    ce_job *fprev, *fnext;     /* in the engine's in-flight list */
    unsigned long long tag;
    int kind;
    int flags;
    mode_t mode;
    size_t alignment;
    uint64_t pages, created_ns;
    uint8_t digest[8];
    char *base;
    int base_state; /* 0: not opened, 1: being opened, 2: opened (base_fd, base_err) */
    int base_fd, base_err;
    fx_item *items;
    Py_ssize_t n;
    PyObject *hold; /* the caller's sequences: item names and hashes point into them */
    uint8_t *kstate;
    Py_ssize_t next;    /* next key to take */
    Py_ssize_t active;  /* keys taken and not returned (workers in the job) */
    Py_ssize_t spread;  /* at most this many workers in the job at once */
    Py_ssize_t left;    /* keys with no result yet */
    long late;          /* timed-out keys still running */
    double deadline;    /* engine clock; INFINITY: none */
    double t_submit, t_end;
    int queued, published, timed_out, in_flight, had_late;
    atomic_int no_tmpfile;
    atomic_int lazy; /* a buffered load: more workers woken only as its reads would block (ce_wake) */
    Py_ssize_t woken;  /* workers signalled for it (ce_wake, ce_grow): a lazy job's never past its spread */
    int notify_fd; /* the caller's eventfd (a dup) written at its events, or -1 */
};

/* A block store's namespace as engine_namespace registered it: what a store
 * needs to make the directories again when they were removed under it. */
typedef struct ce_ns {
    struct ce_ns *next;
    char *base;     /* the blocks directory (a job's base) */
    char *root;     /* the tier's root, never created here */
    char *ns;       /* the namespace directory, relative to root (one component) */
    char *rest;     /* the blocks directory relative to the namespace's ("" when it is the namespace) */
    char *manifest; /* the manifest's name in the namespace directory */
    char *data;     /* and its bytes */
    size_t len;
} ce_ns;

typedef struct ce_event {
    struct ce_event *next;
    ce_job *job;
    int kind;
} ce_event;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, tick, base_cv, gone;
    ce_job *qhead[2], *qtail[2];
    long qkeys[2];       /* keys waiting in each queue */
    ce_job *flight;      /* jobs with a deadline not yet published */
    ce_event *ev_head, *ev_tail;
    long events;
    int efd;
    int threads[2];      /* configured read, write workers */
    int live;            /* workers running (stuck ones included) */
    int stuck;
    int idle;            /* workers waiting for a key */
    int cpus;            /* CPUs this process may run on: a buffered load's workers woken at once */
    long woken;          /* workers signalled for jobs, at submit and as reads would block (tests) */
    int closed;
    int manual;          /* manual clock (tests) */
    double manual_now;
    long timeouts;
    long jobs;           /* jobs submitted and not yet freed */
    int generation;      /* ce_generation of the process that made it */
    int watchdog_live;
    pthread_t watchdog;
    ce_ns *spaces;       /* engine_namespace's, never removed before the engine is freed */
} ce_engine;

typedef struct {
    ce_engine *e;
    int priority; /* 0 read, 1 write */
} ce_worker_arg;

/* A process's generation: a forked child's is one more than its parent's,
 * so an engine made before the fork (its workers exist only in the parent)
 * is foreign in the child, while one the child makes is its own. */
static atomic_int ce_generation = 0;

static void ce_atfork_child(void) { atomic_fetch_add(&ce_generation, 1); }

static double ce_real_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double ce_now(ce_engine *e) { return e->manual ? e->manual_now : ce_real_now(); }

static void ce_signal(ce_engine *e) {
    uint64_t one = 1;
    ssize_t w = write(e->efd, &one, sizeof one);
    (void)w; /* EAGAIN: the counter is already non-zero, a reader wakes anyway */
}

/* Queue an event (mutex held). 0: queued, the engine's eventfd to be
 * written by the caller; 1: queued and the job's notify fd written. */
static int ce_push(ce_engine *e, ce_job *j, int kind) {
    ce_event *ev = malloc(sizeof *ev);
    if (!ev) return -1; /* never expected; the job then stays until shutdown */
    ev->next = NULL;
    ev->job = j;
    ev->kind = kind;
    if (e->ev_tail)
        e->ev_tail->next = ev;
    else
        e->ev_head = ev;
    e->ev_tail = ev;
    e->events++;
    if (j->notify_fd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(j->notify_fd, &one, sizeof one);
        (void)w; /* EAGAIN: the counter is already non-zero, the caller wakes anyway */
        return 1;
    }
    return 0;
}

static void ce_unqueue(ce_engine *e, ce_job *j) {
    int q = j->kind == CE_LOAD ? 0 : 1;
    ce_job **pp = &e->qhead[q], *prev = NULL;
    while (*pp && *pp != j) {
        prev = *pp;
        pp = &(*pp)->qnext;
    }
    if (*pp) {
        *pp = j->qnext;
        if (e->qtail[q] == j) e->qtail[q] = prev;
    }
    j->qnext = NULL;
    e->qkeys[q] -= j->n - j->next;
    j->queued = 0;
}

static void ce_unflight(ce_engine *e, ce_job *j) {
    if (!j->in_flight) return;
    if (j->fprev) j->fprev->fnext = j->fnext;
    else e->flight = j->fnext;
    if (j->fnext) j->fnext->fprev = j->fprev;
    j->fprev = j->fnext = NULL;
    j->in_flight = 0;
}

/* Publish j (mutex held); 1: the caller signals the engine's eventfd after
 * unlocking (0: the job's own notify fd was written). */
static int ce_publish(ce_engine *e, ce_job *j) {
    j->published = 1;
    j->t_end = ce_real_now();
    ce_unflight(e, j);
    return ce_push(e, j, EV_DONE) != 1;
}

/* Queue job j's n keys on queue q (0 reads, 1 writes) and, with a deadline,
 * put it in flight for the watchdog (woken to plan its next wake-up). Under
 * e->mu. */
static void ce_enqueue(ce_engine *e, ce_job *j, int q, Py_ssize_t n, int deadline) {
    if (e->qtail[q])
        e->qtail[q]->qnext = j;
    else
        e->qhead[q] = j;
    e->qtail[q] = j;
    e->qkeys[q] += n;
    j->queued = 1;
    if (deadline) {
        j->fnext = e->flight;
        if (e->flight) e->flight->fprev = j;
        e->flight = j;
        j->in_flight = 1;
        pthread_cond_signal(&e->tick);
    }
}

/* Wake the idle workers a new job j of n keys may use (mutex held): its
 * spread, but for a buffered load no more than the CPUs at first. Warm
 * files are a copy and a hash each, CPU work: 8 workers on 2 CPUs woken per
 * 32-key job loaded cached 256 KiB chunks with 16 thread wake-ups and
 * ~15-25% more CPU per task than 2 (bench_lmcache_floor.py --timeline).
 * Its further workers are woken one per read that would block (ce_grow,
 * through x_preadv's RWF_NOWAIT attempt), so cold files still get the
 * job's spread of reads in flight; a direct load and a store wake them all. */
static void ce_wake(ce_engine *e, ce_job *j, Py_ssize_t n) {
    Py_ssize_t wake = j->spread < n ? j->spread : n;
    if (j->kind == CE_LOAD && !(j->flags & F_DIRECT) && wake > e->cpus) {
        atomic_store(&j->lazy, 1);
        wake = e->cpus;
    }
    for (wake = wake < e->idle ? wake : e->idle; wake > 0; wake--) {
        pthread_cond_signal(&e->work);
        e->woken++;
        j->woken++;
    }
}

typedef struct {
    ce_engine *e;
    ce_job *j;
} ce_grow_arg;

static int ce_may_grow(void *arg) { return atomic_load_explicit(&((ce_grow_arg *)arg)->j->lazy, memory_order_relaxed); }

/* A read of a lazy job would block: wake one more idle worker while the
 * job has keys to take and room (its spread). No key left to take, its
 * whole spread at work (a worker stays in the job until its keys run out)
 * or signalled (a woken worker may not have run yet: on a busy CPU every
 * read of the first worker would wake another): stop asking, so its later
 * reads make no page-cache-only attempt first. */
static void ce_grow(void *arg) {
    ce_engine *e = ((ce_grow_arg *)arg)->e;
    ce_job *j = ((ce_grow_arg *)arg)->j;
    pthread_mutex_lock(&e->mu);
    if (j->next >= j->n || j->active >= j->spread || j->woken >= j->spread) {
        atomic_store(&j->lazy, 0);
    } else if (e->idle > 0) {
        pthread_cond_signal(&e->work);
        e->woken++;
        j->woken++;
    }
    pthread_mutex_unlock(&e->mu);
}

static void *ce_worker(void *arg);

/* Start a worker of `priority` (mutex held). 0 on success. */
static int ce_spawn(ce_engine *e, int priority) {
    ce_worker_arg *a = malloc(sizeof *a);
    if (!a) return -1;
    a->e = e;
    a->priority = priority;
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&t, &at, ce_worker, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        free(a);
        return -1;
    }
    e->live++;
    return 0;
}

/* The next key for a worker of `priority` (mutex held): its job, or NULL.
 * A job runs on at most `spread` workers at once (its keys in order on one
 * worker when spread is 1); a worker passes a full job for the next one.
 * The cap holds on an otherwise idle engine too: letting idle workers join
 * a job past its spread read cold 64 KiB files 0.41-0.71 GB/s against
 * 0.77-0.83 with the cap (64-key jobs, this 2-CPU VM; docs/performance.md). */
static ce_job *ce_take(ce_engine *e, int priority, Py_ssize_t *idx) {
    for (int k = 0; k < 2; k++) {
        int q = k == 0 ? priority : 1 - priority;
        ce_job *prev = NULL, *j = e->qhead[q];
        while (j && j->active >= j->spread) {
            prev = j;
            j = j->qnext;
        }
        if (!j) continue;
        *idx = j->next++;
        j->kstate[*idx] = KS_RUNNING;
        j->active++;
        e->qkeys[q]--;
        if (j->next == j->n) { /* its last key started: it leaves the queue */
            if (prev)
                prev->qnext = j->qnext;
            else
                e->qhead[q] = j->qnext;
            if (e->qtail[q] == j) e->qtail[q] = prev;
            j->qnext = NULL;
            j->queued = 0;
        }
        return j;
    }
    return NULL;
}

/* The job's base directory fd, opened by the first of its keys to run. */
static int ce_base(ce_engine *e, ce_job *j, int *err) {
    pthread_mutex_lock(&e->mu);
    while (j->base_state == 1) pthread_cond_wait(&e->base_cv, &e->mu);
    if (j->base_state == 2) {
        *err = j->base_err;
        int fd = j->base_fd;
        pthread_mutex_unlock(&e->mu);
        return fd;
    }
    j->base_state = 1;
    pthread_mutex_unlock(&e->mu);
    int fd = open_base(j->base);
    int er = fd < 0 ? errno : 0;
    pthread_mutex_lock(&e->mu);
    j->base_fd = fd;
    j->base_err = er;
    j->base_state = 2;
    pthread_cond_broadcast(&e->base_cv);
    pthread_mutex_unlock(&e->mu);
    *err = er;
    return fd;
}

/* The namespace registered for `base`, or NULL (entries are immutable and
 * live as long as the engine, so the pointer stays good unlocked). */
static ce_ns *ce_ns_find(ce_engine *e, const char *base) {
    pthread_mutex_lock(&e->mu);
    ce_ns *ns = e->spaces;
    while (ns && strcmp(ns->base, base) != 0) ns = ns->next;
    pthread_mutex_unlock(&e->mu);
    return ns;
}

/* Write the manifest into a namespace directory (ns_fd), as
 * fstier.io.fsops.atomic_write does (a temp name beside it, written, fsynced,
 * renamed over the name, the directory fsynced; mode 0644, its default).
 * 0 once it is in place, else the errno with *stage the step that failed. */
static int ce_write_manifest(int ns_fd, const ce_ns *ns, int *stage) {
    char tmp[MAX_NAME + 160];
    temp_name(tmp, sizeof tmp, ns->manifest);
    int fd = x_openat(ns_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644);
    if (fd < 0) {
        *stage = SG_CREATE;
        return errno ? errno : EIO;
    }
    size_t done = 0;
    int err = 0;
    while (done < ns->len) {
        ssize_t w = write(fd, ns->data + done, ns->len - done);
        if (w <= 0 && !(w < 0 && errno == EINTR)) {
            err = w < 0 ? errno : EIO;
            break;
        }
        if (w > 0) done += (size_t)w;
    }
    *stage = SG_WRITE;
    if (!err && x_fsync(fd) != 0) {
        err = errno ? errno : EIO;
        *stage = SG_FSYNC;
    }
    if (x_close(fd) != 0 && !err) {
        err = errno ? errno : EIO;
        *stage = SG_CLOSE;
    }
    if (!err && x_renameat(ns_fd, tmp, ns->manifest) != 0) {
        err = errno ? errno : EIO;
        *stage = SG_RENAME;
    }
    if (err) {
        discard_at(ns_fd, tmp);
        return err;
    }
    x_fsync(ns_fd);
    return 0;
}

/* A store that failed ENOENT (its namespace or blocks directory was removed
 * under the running tier: an operator's rm -rf) is stored once more, as
 * BlockStore._store_one does on the Python path: the directories from the
 * namespace's down are made again below the root (resolved with no
 * symlink; mode 0755, each level opened O_NOFOLLOW; the root itself is
 * never created), the manifest written when this call made the namespace
 * directory, then the key stored through a fresh base fd. Such a key's
 * success carries the stage SG_NSBACK (Python logs the re-creation). */
static void ce_store_again(ce_engine *e, ce_job *j, fx_item *it, fx_scratch *sc) {
    ce_ns *ns = ce_ns_find(e, j->base);
    if (!ns) return;
    int root_fd = open_base(ns->root);
    if (root_fd < 0) return;
    int fresh = 0, stage = 0, dummy = 0;
    int ns_fd = make_dirs(root_fd, ns->ns, &fresh, &stage);
    if (ns_fd < 0) {
        close(root_fd);
        return;
    }
    /* No key is stored into a namespace directory without its manifest (a
     * scan treats one as foreign, its blocks never counted or evicted): one
     * made here, or found without one (another worker's, whose manifest is
     * not in place yet or failed), gets it first; when that fails the
     * key fails with the manifest's errno (not ENOENT: no hand-back stores
     * it either) and a directory made here is removed again (still empty). */
    struct stat mst;
    int absent = fresh || (x_fstatat(ns_fd, ns->manifest, &mst) != 0 && errno == ENOENT);
    int err = absent ? ce_write_manifest(ns_fd, ns, &stage) : 0;
    if (err && fresh) unlinkat(root_fd, ns->ns, AT_REMOVEDIR);
    close(root_fd);
    if (err) {
        close(ns_fd);
        it->err = err;
        it->stage = stage;
        return;
    }
    int dfd = ns->rest[0] ? make_dirs(ns_fd, ns->rest, &dummy, &stage) : -1;
    if (dfd >= 0) close(dfd);
    close(ns_fd);
    int base_fd = open_base(j->base);
    if (base_fd < 0) return;
    it->status = it->err = it->stage = 0;
    it->nbytes = 0;
    int flags = j->flags | (atomic_load(&j->no_tmpfile) ? F_NO_TMPFILE : 0);
    store_one(it, base_fd, flags, j->mode, j->alignment, j->digest, j->pages, j->created_ns, sc);
    close(base_fd);
    if (it->tmpfile_err) atomic_store(&j->no_tmpfile, 1);
    if (fresh && it->status != ST_FAILED) it->stage = SG_NSBACK;
}

static void ce_run_key(ce_engine *e, ce_job *j, Py_ssize_t i, fx_scratch *sc) {
    fx_item *it = &j->items[i];
    int err = 0;
    int base_fd = ce_base(e, j, &err);
    if (j->kind == CE_TOUCH) {
        it->status = base_fd >= 0 && touch_one(base_fd, it->rel) ? 0 : 1; /* 1: not touched */
        return;
    }
    if (base_fd < 0) {
        it->err = err;
        if (j->kind == CE_STORE) {
            it->status = ST_FAILED;
            it->stage = SG_OPENBASE;
            if (err == ENOENT) ce_store_again(e, j, it, sc);
        } else {
            it->status = err == ENOENT ? LD_MISSING : LD_ERROR;
            it->stage = err == ELOOP ? RS_SYMLINK : RS_OPEN;
            if (err == ELOOP) it->status = LD_CORRUPT;
        }
        return;
    }
    if (j->kind == CE_LOAD) {
        load_one(it, base_fd, j->base, j->flags, j->alignment, j->digest, sc);
    } else {
        int flags = j->flags | (atomic_load(&j->no_tmpfile) ? F_NO_TMPFILE : 0);
        store_one(it, base_fd, flags, j->mode, j->alignment, j->digest, j->pages, j->created_ns, sc);
        if (it->tmpfile_err) atomic_store(&j->no_tmpfile, 1);
        if (it->status == ST_FAILED && it->err == ENOENT) ce_store_again(e, j, it, sc);
    }
}

/* Close the job's base fd once no key of it can run any more (mutex held;
 * returns the fd to close after unlocking, or -1). */
static int ce_base_done(ce_job *j) {
    if (j->active == 0 && j->next >= j->n && j->base_state == 2 && j->base_fd >= 0) {
        int fd = j->base_fd;
        j->base_fd = -1;
        return fd;
    }
    return -1;
}

static void *ce_worker(void *arg) {
    ce_worker_arg *a = (ce_worker_arg *)arg;
    ce_engine *e = a->e;
    int priority = a->priority;
    free(a);
    pthread_setname_np(pthread_self(), priority ? "fstier-cwrite" : "fstier-cread"); /* seen by top -H, perf */
    fx_scratch sc;
    int have_sc = scratch_alloc(&sc) == 0;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        Py_ssize_t i = 0;
        ce_job *j = NULL;
        while (!e->closed && !(have_sc && (j = ce_take(e, priority, &i)))) {
            e->idle++;
            pthread_cond_wait(&e->work, &e->mu);
            e->idle--;
        }
        if (!j) break; /* closed */
        pthread_mutex_unlock(&e->mu);
        ce_grow_arg ga = {e, j};
        fx_grower grower = {ce_may_grow, ce_grow, &ga};
        tl_grower = atomic_load(&j->lazy) ? &grower : NULL;
        ce_run_key(e, j, i, &sc);
        tl_grower = NULL;
        pthread_mutex_lock(&e->mu);
        j->active--;
        int fd = ce_base_done(j), signal = 0, retire = 0;
        if (j->kstate[i] == KS_TIMED_OUT) { /* given up on: the result is dropped */
            e->stuck--;
            j->late--;
            retire = 1; /* a replacement serves the queues already */
            if (j->late == 0) signal = ce_push(e, j, EV_RELEASED) == 0;
        } else {
            j->kstate[i] = KS_DONE;
            if (--j->left == 0 && !j->published) signal = ce_publish(e, j);
        }
        if (fd >= 0 || signal) {
            pthread_mutex_unlock(&e->mu);
            if (fd >= 0) close(fd);
            if (signal) ce_signal(e);
            pthread_mutex_lock(&e->mu);
        }
        if (retire) break;
    }
    e->live--;
    pthread_cond_broadcast(&e->gone);
    pthread_mutex_unlock(&e->mu);
    if (have_sc) free(sc.header);
    return NULL;
}

/* j is past its deadline (mutex held): running keys time out, queued ones
 * expire; the job is published. Returns 1 when an event was queued. */
static int ce_expire(ce_engine *e, ce_job *j) {
    if (j->queued) ce_unqueue(e, j);
    for (Py_ssize_t i = 0; i < j->n; i++) {
        if (j->kstate[i] == KS_RUNNING) {
            j->kstate[i] = KS_TIMED_OUT;
            j->late++;
            j->had_late = 1;
            e->stuck++;
            e->timeouts++;
            if (!e->closed) ce_spawn(e, j->kind == CE_LOAD ? 0 : 1);
        } else if (j->kstate[i] == KS_QUEUED) {
            j->kstate[i] = KS_EXPIRED;
            e->timeouts++;
        }
    }
    j->next = j->n;
    j->left = 0;
    j->timed_out = 1;
    return ce_publish(e, j);
}

static void *ce_watch(void *arg) {
    ce_engine *e = (ce_engine *)arg;
    pthread_setname_np(pthread_self(), "fstier-cwatch");
    pthread_mutex_lock(&e->mu);
    while (!e->closed) {
        double now = ce_now(e), next = INFINITY;
        int fired = 0;
        for (ce_job *j = e->flight, *nx; j; j = nx) {
            nx = j->fnext;
            if (j->deadline <= now)
                fired |= ce_expire(e, j);
            else if (j->deadline < next)
                next = j->deadline;
        }
        if (fired) {
            pthread_mutex_unlock(&e->mu);
            ce_signal(e);
            pthread_mutex_lock(&e->mu);
            continue;
        }
        /* A manual clock moves only by engine_clock, which wakes this
         * thread; otherwise sleep until the earliest deadline (at most 1 s). */
        double wait = e->manual || next == INFINITY ? 1.0 : next - now;
        if (wait > 1.0) wait = 1.0;
        if (wait < 0.0001) wait = 0.0001;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        long long ns = (long long)ts.tv_nsec + (long long)(wait * 1e9);
        ts.tv_sec += (time_t)(ns / 1000000000LL);
        ts.tv_nsec = (long)(ns % 1000000000LL);
        pthread_cond_timedwait(&e->tick, &e->mu, &ts);
    }
    e->watchdog_live = 0;
    pthread_cond_broadcast(&e->gone);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* ------------------------------------------------------- Python glue */
#define CE_CAPSULE "fstier.io._native.engine"

static ce_engine *ce_get(PyObject *cap) {
    ce_engine *e = (ce_engine *)PyCapsule_GetPointer(cap, CE_CAPSULE);
    if (!e) return NULL;
    if (e->generation != atomic_load(&ce_generation)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this native engine belongs to the parent process; a forked child builds its own");
        return NULL;
    }
    return e;
}

static void ce_job_free(ce_job *j) { /* GIL held */
    if (j->notify_fd >= 0) close(j->notify_fd);
    if (j->items) items_free(j->items, j->n);
    Py_XDECREF(j->hold);
    if (j->base_fd >= 0) close(j->base_fd);
    free(j->kstate);
    free(j->base);
    free(j);
}

/* The capsule's destructor (GIL held): once no thread of the engine runs,
 * its undelivered events and jobs, eventfd and struct are freed; while a
 * worker is still stuck in a late key the engine is left to it (a leak of
 * one struct per engine whose mount hung, never a use after free). In a
 * forked child the parent's engine is never touched. */
static void ce_capsule_free(PyObject *cap) {
    ce_engine *e = (ce_engine *)PyCapsule_GetPointer(cap, CE_CAPSULE);
    if (!e || e->generation != atomic_load(&ce_generation)) {
        PyErr_Clear();
        return;
    }
    pthread_mutex_lock(&e->mu);
    int idle = e->closed && e->live == 0 && !e->watchdog_live;
    ce_event *ev = idle ? e->ev_head : NULL;
    if (idle) e->ev_head = e->ev_tail = NULL;
    pthread_mutex_unlock(&e->mu);
    if (!idle) return;
    while (ev) {
        ce_event *nx = ev->next;
        ce_job *j = ev->job;
        if (ev->kind == EV_RELEASED || !j->had_late) ce_job_free(j);
        free(ev);
        ev = nx;
    }
    while (e->spaces) {
        ce_ns *nx = e->spaces->next;
        free(e->spaces);
        e->spaces = nx;
    }
    close(e->efd);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->tick);
    pthread_cond_destroy(&e->base_cv);
    pthread_cond_destroy(&e->gone);
    free(e);
}

static PyObject *py_engine_new(PyObject *self, PyObject *args) {
    (void)self;
    int rt, wt;
    if (!PyArg_ParseTuple(args, "ii", &rt, &wt)) return NULL;
    if (rt < 1 || wt < 1 || rt > 1024 || wt > 1024) {
        PyErr_Format(PyExc_ValueError, "an engine needs 1..1024 read and write threads, got %d and %d", rt, wt);
        return NULL;
    }
    ce_engine *e = calloc(1, sizeof *e);
    if (!e) return PyErr_NoMemory();
    e->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->efd < 0) {
        free(e);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* the watchdog's timed waits */
    pthread_cond_init(&e->tick, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&e->base_cv, NULL);
    pthread_cond_init(&e->gone, NULL);
    e->threads[0] = rt;
    e->threads[1] = wt;
    cpu_set_t cpus;
    e->cpus = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (e->cpus < 1) e->cpus = 1;
    e->generation = atomic_load(&ce_generation);
    pthread_mutex_lock(&e->mu);
    int ok = 1;
    for (int i = 0; ok && i < rt; i++) ok = ce_spawn(e, 0) == 0;
    for (int i = 0; ok && i < wt; i++) ok = ce_spawn(e, 1) == 0;
    if (ok) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        ok = pthread_create(&e->watchdog, &at, ce_watch, e) == 0;
        pthread_attr_destroy(&at);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        e->watchdog_live = ok;
    }
    if (!ok) e->closed = 1;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
    if (!ok) {
        /* the started workers exit; the struct is left to them (never freed) */
        PyErr_SetString(PyExc_OSError, "could not start the engine's threads");
        return NULL;
    }
    PyObject *cap = PyCapsule_New(e, CE_CAPSULE, ce_capsule_free);
    if (!cap) { /* the threads run on; the struct is theirs (never freed) */
        pthread_mutex_lock(&e->mu);
        e->closed = 1;
        pthread_cond_broadcast(&e->work);
        pthread_cond_broadcast(&e->tick);
        pthread_mutex_unlock(&e->mu);
    }
    return cap;
}

/* THE path codec's names (fstier.file_mapper.encode: "<hex[:3]>/<hex>-g<group>.bin"),
 * formatted here for a job submitted without them: a new list of bytes, one
 * per key; test_engine_names.py pins it against encode for many keys and groups. */
#define CE_FANOUT_HEX 3
static PyObject *ce_names(PyObject *hashes, PyObject *groups) {
    if ((!PyList_Check(hashes) && !PyTuple_Check(hashes)) || (!PyList_Check(groups) && !PyTuple_Check(groups))) {
        PyErr_SetString(PyExc_TypeError, "hashes and groups must be lists or tuples");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (PySequence_Fast_GET_SIZE(groups) != n) {
        PyErr_SetString(PyExc_ValueError, "hashes and groups differ in length");
        return NULL;
    }
    static const char hexd[] = "0123456789abcdef";
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, i), *g = PySequence_Fast_GET_ITEM(groups, i);
        if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) < MIN_HASH || PyBytes_GET_SIZE(h) > MAX_HASH) {
            PyErr_Format(PyExc_ValueError, "hashes[%zd] must be 8..64 bytes", i);
            Py_CLEAR(out);
            break;
        }
        long gv = PyLong_Check(g) ? PyLong_AsLong(g) : -1;
        if (gv < 0 || gv > 65535) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "groups[%zd] must be an int in 0..65535", i);
            Py_CLEAR(out);
            break;
        }
        const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(h);
        Py_ssize_t hl = PyBytes_GET_SIZE(h);
        char name[CE_FANOUT_HEX + 1 + 2 * MAX_HASH + 16], *w = name + CE_FANOUT_HEX + 1;
        for (Py_ssize_t k = 0; k < hl; k++) {
            w[2 * k] = hexd[b[k] >> 4];
            w[2 * k + 1] = hexd[b[k] & 15];
        }
        memcpy(name, w, CE_FANOUT_HEX);
        name[CE_FANOUT_HEX] = '/';
        int len = CE_FANOUT_HEX + 1 + (int)(2 * hl);
        len += snprintf(name + len, sizeof name - (size_t)len, "-g%ld.bin", gv);
        PyObject *t = PyBytes_FromStringAndSize(name, len);
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *py_engine_names(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *hashes, *groups;
    if (!PyArg_ParseTuple(args, "OO", &hashes, &groups)) return NULL;
    return ce_names(hashes, groups);
}

/* Mark the caller's job record taken: its "accepted" attribute set True just
 * before the engine's lock is taken, set back to False where the job is then
 * refused (engine shut down). No Python line runs between this write and the
 * take, so an interrupt or a signal handler's exception in the caller, which
 * lands only at a bytecode boundary, finds the record marked exactly when the
 * engine has the job (the tier gives a job back only when it is not). The
 * write back to False replaces an existing key and cannot fail. */
static int ce_mark(PyObject *job, PyObject *value) {
    return job == NULL || job == Py_None ? 0 : PyObject_SetAttrString(job, "accepted", value);
}

static PyObject *py_engine_submit(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap, *rels, *hashes, *groups, *bufs, *replace;
    unsigned long long tag, pages, created_ns;
    int kind, flags, mode;
    const char *base;
    Py_buffer digest;
    Py_ssize_t alignment;
    double timeout_s;
    Py_ssize_t spread = 0;
    int notify_fd = -1;
    PyObject *record = NULL; /* the caller's job record: marked accepted when taken (ce_mark) */
    if (!PyArg_ParseTuple(args, "OKiyOOOOOy*KiiKnd|niO", &cap, &tag, &kind, &base, &rels, &hashes, &groups,
                          &bufs, &replace, &digest, &pages, &flags, &mode, &created_ns, &alignment,
                          &timeout_s, &spread, &notify_fd, &record))
        return NULL;
    ce_engine *e = ce_get(cap);
    ce_job *j = NULL;
    PyObject *named = NULL; /* the names formatted here when rels is None */
    PyObject *own_rels = NULL, *own_hashes = NULL; /* tuples of the caller's lists, held by the job */
    if (!e) goto fail;
    if (rels == Py_None) {
        rels = named = ce_names(hashes, groups);
        if (!named) goto fail;
    } else if (PyList_Check(rels)) { /* the caller's list may change while the job runs: its names held apart */
        rels = own_rels = PyList_AsTuple(rels);
        if (!rels) goto fail;
    }
    if (PyList_Check(hashes)) { /* so may its hashes list (the items point into the bytes it holds) */
        hashes = own_hashes = PyList_AsTuple(hashes);
        if (!hashes) goto fail;
    }
    if ((kind != CE_LOAD && kind != CE_STORE) || digest.len != 8 || alignment < 1 || PAGE % alignment ||
        (kind == CE_STORE && pages < 1)) {
        PyErr_SetString(PyExc_ValueError,
                        "kind must be 0 (load) or 1 (store), digest 8 bytes, alignment divide 4096, pages >= 1");
        goto fail;
    }
    j = calloc(1, sizeof *j);
    if (!j) {
        PyErr_NoMemory();
        goto fail;
    }
    j->base_fd = -1;
    j->notify_fd = -1;
    if (notify_fd >= 0 && (j->notify_fd = fcntl(notify_fd, F_DUPFD_CLOEXEC, 0)) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    j->base = strdup(base);
    Py_ssize_t n = 0;
    j->items = items_from(rels, hashes, groups, bufs, kind == CE_LOAD, &n);
    if (j->items) j->n = n; /* before any failure: ce_job_free releases the buffers items_from took */
    if (!j->items || !j->base) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto fail;
    }
    if (replace != Py_None) {
        if (!PyList_Check(replace) && !PyTuple_Check(replace)) {
            PyErr_SetString(PyExc_TypeError, "replace must be None, a list or a tuple");
            goto fail;
        }
        if (PySequence_Size(replace) != n) {
            PyErr_SetString(PyExc_ValueError, "replace differs in length from rels");
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int t = PyObject_IsTrue(PySequence_Fast_GET_ITEM(replace, i));
            if (t < 0) goto fail;
            j->items[i].replace = t;
        }
    }
    j->kstate = calloc((size_t)(n ? n : 1), 1);
    j->hold = Py_BuildValue("(OOOO)", rels, hashes, groups, bufs);
    if (!j->kstate || !j->hold) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto fail;
    }
    memcpy(j->digest, digest.buf, 8);
    PyBuffer_Release(&digest);
    j->tag = tag;
    j->kind = kind;
    j->flags = flags;
    j->mode = (mode_t)mode;
    j->alignment = (size_t)alignment;
    j->pages = pages;
    j->created_ns = created_ns;
    j->left = n;
    j->spread = spread >= 1 ? spread : n; /* 0: every worker may join */
    atomic_init(&j->no_tmpfile, 0);
    atomic_init(&j->lazy, 0);
    j->t_submit = ce_real_now();
    if (ce_mark(record, Py_True) < 0) goto fail;
    int signal = 0;
    pthread_mutex_lock(&e->mu);
    if (e->closed) {
        pthread_mutex_unlock(&e->mu);
        ce_mark(record, Py_False);
        PyErr_SetString(PyExc_RuntimeError, "the native engine is shut down; cannot submit");
        ce_job_free(j);
        Py_XDECREF(named);
        Py_XDECREF(own_rels);
        Py_XDECREF(own_hashes);
        return NULL;
    }
    e->jobs++;
    j->deadline = timeout_s >= 0 ? ce_now(e) + timeout_s : INFINITY;
    if (n == 0) {
        signal = ce_publish(e, j);
    } else {
        ce_enqueue(e, j, kind == CE_LOAD ? 0 : 1, n, timeout_s >= 0);
        /* wake as many idle workers as can join the job (its spread), no
         * more: a broadcast woke all 12 workers of the default engine for a
         * 16-key job that 4 may run, 8 of them only to wait again; a
         * buffered load's beyond the CPUs as its reads would block (ce_wake) */
        ce_wake(e, j, n);
    }
    pthread_mutex_unlock(&e->mu);
    if (signal) ce_signal(e);
    Py_XDECREF(named); /* the job holds its own references */
    Py_XDECREF(own_rels);
    Py_XDECREF(own_hashes);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&digest);
    if (j) ce_job_free(j);
    Py_XDECREF(named);
    Py_XDECREF(own_rels);
    Py_XDECREF(own_hashes);
    return NULL;
}

static PyObject *ce_raw(ce_job *j, fx_item *it) {
    if (j->kind == CE_STORE)
        return Py_BuildValue("(iiKii)", it->status, it->err, (unsigned long long)it->nbytes, it->stage,
                             it->tmpfile_err);
    return Py_BuildValue("(iiKiii)", it->status, it->err, (unsigned long long)it->nbytes, it->stage, it->removed,
                         it->rm_err);
}

static int ce_same(const fx_item *a, const fx_item *b) {
    return a->status == b->status && a->err == b->err && a->nbytes == b->nbytes && a->stage == b->stage &&
           a->tmpfile_err == b->tmpfile_err && a->dev == b->dev && a->ino == b->ino && a->removed == b->removed &&
           a->rm_err == b->rm_err;
}

/* A mixed job's summary classes: at most CE_CLASSES distinct successes
 * (past that a success is listed with the failures); CE_NONE: no class. */
#define CE_CLASSES 16
#define CE_NONE 255

/* A key's result that is one of a few shared outcomes (it needs no per-key
 * judging): a load LOADED, a store STORED or SKIPPED with no O_TMPFILE
 * refusal to record. */
static int ce_success(const ce_job *j, const fx_item *it) {
    if (j->kind == CE_LOAD) return it->status == LD_LOADED;
    return it->status != ST_FAILED && !it->tmpfile_err && it->stage == SG_NONE;
}

/* A job that was not uniform, summarised without a tuple per key:
 * (codes, classes, failures). codes: one byte per key, the index of its
 * success in classes (the distinct success tuples, ce_raw's shape), or
 * CE_NONE: a key that returned nothing (see the marks) or one listed in
 * failures, ((key index, ce_raw tuple), ...) in key order (its first item is
 * the job's first failure). Python judges the classes once each and only
 * the failures per key. */
static PyObject *ce_mixed(ce_job *j) {
    PyObject *codes = PyBytes_FromStringAndSize(NULL, j->n), *classes = PyList_New(0), *fails = PyList_New(0);
    if (!codes || !classes || !fails) goto fail;
    uint8_t *c = (uint8_t *)PyBytes_AS_STRING(codes);
    Py_ssize_t cls[CE_CLASSES], ncls = 0;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        fx_item *it = &j->items[i];
        c[i] = CE_NONE;
        if (j->kstate[i] != KS_DONE) continue;
        if (ce_success(j, it)) {
            Py_ssize_t k = 0;
            while (k < ncls && !ce_same(&j->items[cls[k]], it)) k++;
            if (k == ncls && ncls < CE_CLASSES) {
                PyObject *t = ce_raw(j, it);
                if (!t || PyList_Append(classes, t) != 0) {
                    Py_XDECREF(t);
                    goto fail;
                }
                Py_DECREF(t);
                cls[ncls++] = i;
            }
            if (k < ncls) {
                c[i] = (uint8_t)k;
                continue;
            }
        }
        PyObject *t = ce_raw(j, it);
        PyObject *f = t ? Py_BuildValue("(nN)", i, t) : NULL;
        if (!f || PyList_Append(fails, f) != 0) {
            Py_XDECREF(f);
            goto fail;
        }
        Py_DECREF(f);
    }
    return Py_BuildValue("(NNN)", codes, classes, fails);
fail:
    Py_XDECREF(codes);
    Py_XDECREF(classes);
    Py_XDECREF(fails);
    return NULL;
}

/* One published job's summary: (tag, EV_DONE, seconds, uniform, per_key, marks); per_key: ce_mixed's. */
static PyObject *ce_summary(ce_job *j) {
    PyObject *uniform = Py_None, *per_key = Py_None, *marks = Py_None;
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    int all_done = 1, same = 1;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        if (j->kstate[i] != KS_DONE) all_done = 0;
        else if (i && j->kstate[0] == KS_DONE && !ce_same(&j->items[0], &j->items[i])) same = 0;
    }
    if (all_done && same && j->n) {
        Py_DECREF(uniform);
        uniform = ce_raw(j, &j->items[0]);
    } else if (j->n) {
        Py_DECREF(per_key);
        per_key = ce_mixed(j);
        if (!all_done) {
            Py_DECREF(marks);
            marks = PyBytes_FromStringAndSize(NULL, j->n);
            if (marks) {
                char *m = PyBytes_AS_STRING(marks);
                for (Py_ssize_t i = 0; i < j->n; i++) {
                    int s = j->kstate[i];
                    m[i] = (char)(s == KS_DONE ? MK_DONE : s == KS_TIMED_OUT ? MK_TIMED_OUT
                                                         : s == KS_EXPIRED ? MK_EXPIRED : MK_CANCELLED);
                }
            }
        }
    }
    if (!uniform || !per_key || !marks) {
        Py_XDECREF(uniform);
        Py_XDECREF(per_key);
        Py_XDECREF(marks);
        return NULL;
    }
    return Py_BuildValue("(KidNNN)", j->tag, EV_DONE, j->t_end - j->t_submit, uniform, per_key, marks);
}

static PyObject *py_engine_collect(PyObject *self, PyObject *cap) {
    (void)self;
    ce_engine *e = ce_get(cap);
    if (!e) return NULL;
    uint64_t drained;
    ssize_t r = read(e->efd, &drained, sizeof drained);
    (void)r;
    pthread_mutex_lock(&e->mu);
    ce_event *ev = e->ev_head;
    e->ev_head = e->ev_tail = NULL;
    e->events = 0;
    pthread_mutex_unlock(&e->mu);
    PyObject *out = PyList_New(0);
    while (ev) {
        ce_event *nx = ev->next;
        ce_job *j = ev->job;
        PyObject *t = NULL;
        if (out) t = ev->kind == EV_DONE ? ce_summary(j) : Py_BuildValue("(Ki)", j->tag, EV_RELEASED);
        if (out && (!t || PyList_Append(out, t) != 0)) Py_CLEAR(out);
        Py_XDECREF(t);
        /* Free the job once no thread can touch it: at its EV_DONE, or,
         * when keys of it ran past the deadline, at its EV_RELEASED (always
         * queued after its EV_DONE). */
        pthread_mutex_lock(&e->mu);
        int free_it = ev->kind == EV_RELEASED || !j->had_late;
        if (free_it) e->jobs--;
        pthread_mutex_unlock(&e->mu);
        if (free_it) ce_job_free(j);
        free(ev);
        ev = nx;
    }
    return out;
}

static PyObject *py_engine_wait(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "Od", &cap, &timeout_s)) return NULL;
    ce_engine *e = ce_get(cap);
    if (!e) return NULL;
    struct pollfd p = {.fd = e->efd, .events = POLLIN};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = poll(&p, 1, timeout_s < 0 ? -1 : (int)(timeout_s * 1000));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rc > 0);
}

static PyObject *py_engine_fd(PyObject *self, PyObject *cap) {
    (void)self;
    ce_engine *e = ce_get(cap);
    return e ? PyLong_FromLong(e->efd) : NULL;
}

/* engine_clock(engine, now_s=None): the watchdog's clock now; with now_s a
 * number, the clock becomes manual at that time (tests). */
static PyObject *py_engine_clock(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap, *now = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &cap, &now)) return NULL;
    ce_engine *e = ce_get(cap);
    if (!e) return NULL;
    double v = 0;
    if (now != Py_None) {
        v = PyFloat_AsDouble(now);
        if (v == -1.0 && PyErr_Occurred()) return NULL;
    }
    pthread_mutex_lock(&e->mu);
    if (now != Py_None) {
        e->manual = 1;
        e->manual_now = v;
        pthread_cond_signal(&e->tick);
    }
    v = ce_now(e);
    pthread_mutex_unlock(&e->mu);
    return PyFloat_FromDouble(v);
}

static PyObject *py_engine_info(PyObject *self, PyObject *cap) {
    (void)self;
    ce_engine *e = ce_get(cap);
    if (!e) return NULL;
    /* copied under the lock, built after it: an allocation may run the
     * collector, whose finalizers may call into this engine (and take mu) */
    pthread_mutex_lock(&e->mu);
    int live = e->live, stuck = e->stuck, closed = e->closed, watchdog = e->watchdog_live, manual = e->manual;
    int cpus = e->cpus;
    long qr = e->qkeys[0], qw = e->qkeys[1], timeouts = e->timeouts, jobs = e->jobs, woken = e->woken;
    pthread_mutex_unlock(&e->mu);
    return Py_BuildValue("{s:i,s:i,s:l,s:l,s:i,s:l,s:l,s:i,s:i,s:l,s:i}", "live", live, "stuck", stuck,
                         "queued_read", qr, "queued_write", qw, "closed", closed, "timeouts", timeouts, "jobs",
                         jobs, "watchdog", watchdog, "manual_clock", manual, "woken", woken, "cpus", cpus);
}

/* engine_shutdown(engine, timeout_s): queued keys are cancelled (their jobs
 * published), running ones finish; waits up to timeout_s for every worker
 * not stuck in a timed-out key, and the watchdog, to exit. True when they did. */
static PyObject *py_engine_shutdown(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "Od", &cap, &timeout_s)) return NULL;
    ce_engine *e = ce_get(cap);
    if (!e) return NULL;
    int done;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->mu);
    int signal = 0;
    if (!e->closed) {
        e->closed = 1;
        for (int q = 0; q < 2; q++) {
            while (e->qhead[q]) {
                ce_job *j = e->qhead[q];
                ce_unqueue(e, j);
                for (Py_ssize_t i = j->next; i < j->n; i++)
                    if (j->kstate[i] == KS_QUEUED) j->kstate[i] = KS_CANCELLED;
                j->left -= j->n - j->next;
                j->next = j->n;
                if (j->left == 0 && !j->published) {
                    ce_publish(e, j);
                    signal = 1;
                }
            }
        }
        pthread_cond_broadcast(&e->work);
        pthread_cond_broadcast(&e->tick);
    }
    double end = ce_real_now() + (timeout_s < 0 ? 1e9 : timeout_s);
    while ((e->live > e->stuck || e->watchdog_live) && ce_real_now() < end) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&e->gone, &e->mu, &ts);
    }
    done = e->live <= e->stuck && !e->watchdog_live;
    pthread_mutex_unlock(&e->mu);
    (void)signal;
    ce_signal(e); /* wakes the completion thread at once, events or not */
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

/* engine_cancel(engine, tag) -> bool: the job's keys not started are
 * cancelled (its caller left); the job is published once its running keys
 * returned. False when no queued job has that tag. */
static PyObject *py_engine_cancel(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap;
    unsigned long long tag;
    if (!PyArg_ParseTuple(args, "OK", &cap, &tag)) return NULL;
    ce_engine *e = ce_get(cap);
    if (!e) return NULL;
    int found = 0, signal = 0;
    pthread_mutex_lock(&e->mu);
    for (int q = 0; q < 2 && !found; q++) {
        for (ce_job *j = e->qhead[q]; j; j = j->qnext) {
            if (j->tag != tag) continue;
            found = 1;
            ce_unqueue(e, j);
            for (Py_ssize_t i = j->next; i < j->n; i++) j->kstate[i] = KS_CANCELLED;
            j->left -= j->n - j->next;
            j->next = j->n;
            if (j->left == 0 && !j->published) {
                ce_publish(e, j);
                signal = 1;
            }
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    if (signal) ce_signal(e);
    return PyBool_FromLong(found);
}

/* engine_touch(engine, tag, base, rels, timeout_s): queue a touch job (the
 * recency flush): each name's mtime set to now by touch_one (_native.c:
 * resolved below base with no symlink, only a regular file with one link),
 * on the write queue, its names in order on one worker; a deadline as a
 * store's (timeout_s < 0: none). Its events are the engine's (no notify fd);
 * its summary's per-key status is 0 where a file was touched. */
static PyObject *py_engine_touch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap, *rels;
    unsigned long long tag;
    const char *base;
    double timeout_s;
    PyObject *record = NULL; /* the caller's job record: marked accepted when taken (ce_mark) */
    if (!PyArg_ParseTuple(args, "OKyOd|O", &cap, &tag, &base, &rels, &timeout_s, &record)) return NULL;
    ce_engine *e = ce_get(cap);
    if (!e) return NULL;
    /* the caller's list may change while the job runs (the items point into
     * the bytes it holds): the job holds a tuple of them instead */
    PyObject *own = PyList_Check(rels) ? PyList_AsTuple(rels) : NULL;
    if (own)
        rels = own;
    else if (PyErr_Occurred())
        return NULL;
    ce_job *j = calloc(1, sizeof *j);
    if (!j) {
        Py_XDECREF(own);
        return PyErr_NoMemory();
    }
    j->base_fd = j->notify_fd = -1;
    j->kind = CE_TOUCH;
    j->tag = tag;
    j->alignment = 1;
    j->base = strdup(base);
    j->items = items_from(rels, NULL, NULL, NULL, 0, &j->n);
    j->kstate = j->items ? calloc((size_t)(j->n ? j->n : 1), 1) : NULL;
    j->hold = j->kstate ? Py_BuildValue("(O)", rels) : NULL;
    Py_XDECREF(own); /* held by the job now, when it was made */
    if (!j->base || !j->hold) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        ce_job_free(j);
        return NULL;
    }
    j->left = j->n;
    j->spread = 1;
    atomic_init(&j->no_tmpfile, 0);
    j->t_submit = ce_real_now();
    if (ce_mark(record, Py_True) < 0) {
        ce_job_free(j);
        return NULL;
    }
    int signal = 0;
    pthread_mutex_lock(&e->mu);
    if (e->closed) {
        pthread_mutex_unlock(&e->mu);
        ce_mark(record, Py_False);
        ce_job_free(j);
        PyErr_SetString(PyExc_RuntimeError, "the native engine is shut down; cannot submit");
        return NULL;
    }
    e->jobs++;
    j->deadline = timeout_s >= 0 ? ce_now(e) + timeout_s : INFINITY;
    if (j->n == 0) {
        signal = ce_publish(e, j);
    } else {
        ce_enqueue(e, j, 1, j->n, timeout_s >= 0);
        if (e->idle) pthread_cond_signal(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
    if (signal) ce_signal(e);
    Py_RETURN_NONE;
}

/* engine_namespace(engine, base, root, ns, rest, manifest_name, manifest): register
 * the namespace of the block store whose blocks directory is `base` (see
 * ce_ns; ce_store_again uses it). One allocation holds the strings; a
 * registration equal to one held is not added again. */
static PyObject *py_engine_namespace(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cap;
    const char *base, *root, *nsdir, *rest, *mname;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "Oyyyyyy*", &cap, &base, &root, &nsdir, &rest, &mname, &data)) return NULL;
    ce_engine *e = ce_get(cap);
    if (!e || !nsdir[0] || strchr(nsdir, '/') || rest[0] == '/' || !mname[0] || strchr(mname, '/')) {
        if (e) PyErr_SetString(PyExc_ValueError, "ns and manifest_name must be one component, rest relative");
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *parts[5] = {base, root, nsdir, rest, mname};
    size_t size = sizeof(ce_ns) + (size_t)data.len + 1;
    for (int k = 0; k < 5; k++) size += strlen(parts[k]) + 1;
    ce_ns *ns = calloc(1, size);
    if (!ns) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    char *w = (char *)(ns + 1), **dst[5] = {&ns->base, &ns->root, &ns->ns, &ns->rest, &ns->manifest};
    for (int k = 0; k < 5; k++) {
        *dst[k] = w;
        w = stpcpy(w, parts[k]) + 1;
    }
    ns->data = w;
    memcpy(w, data.buf, (size_t)data.len);
    ns->len = (size_t)data.len;
    PyBuffer_Release(&data);
    pthread_mutex_lock(&e->mu);
    ce_ns *had = e->spaces;
    while (had && !(strcmp(had->base, ns->base) == 0 && strcmp(had->root, ns->root) == 0 &&
                    strcmp(had->ns, ns->ns) == 0 && strcmp(had->rest, ns->rest) == 0 &&
                    strcmp(had->manifest, ns->manifest) == 0 && had->len == ns->len &&
                    memcmp(had->data, ns->data, ns->len) == 0))
        had = had->next;
    if (!had) {
        ns->next = e->spaces;
        e->spaces = ns;
    }
    pthread_mutex_unlock(&e->mu);
    if (had) free(ns);
    return PyBool_FromLong(!had);
}

#define ENGINE_METHODS                                                                                        \
    {"engine_new", py_engine_new, METH_VARARGS,                                                               \
     "engine_new(read_threads, write_threads) -> engine: persistent C workers and a watchdog"},               \
    {"engine_submit", py_engine_submit, METH_VARARGS,                                                         \
     "engine_submit(engine, tag, kind, base, rels, hashes, groups, buffers, replace, digest, pages, flags, "  \
     "mode, created_ns, alignment, timeout_s, spread=0, notify_fd=-1, record=None): queue one job (kind 0 "  \
     "load, 1 store; timeout_s < 0: none; spread: at most this many workers in it at once, 0: any; notify_fd: "\
     "an eventfd written at its events instead of the engine's, dup'ed; rels None: the codec's names, "       \
     "formatted in C; record: its .accepted set True as the engine takes the job)"},                         \
    {"engine_names", py_engine_names, METH_VARARGS,                                                           \
     "engine_names(hashes, groups) -> [bytes]: file_mapper.encode's names, formatted in C"},                  \
    {"engine_collect", py_engine_collect, METH_O,                                                             \
     "engine_collect(engine) -> [(tag, 0, seconds, uniform, (codes, classes, failures), marks) | (tag, 1)]"}, \
    {"engine_wait", py_engine_wait, METH_VARARGS,                                                             \
     "engine_wait(engine, timeout_s) -> bool: until an event is queued (GIL released)"},                      \
    {"engine_cancel", py_engine_cancel, METH_VARARGS,                                                         \
     "engine_cancel(engine, tag) -> bool: cancel a queued job's keys not started"},                           \
    {"engine_fd", py_engine_fd, METH_O, "engine_fd(engine) -> its eventfd"},                                  \
    {"engine_touch", py_engine_touch, METH_VARARGS,                                                           \
     "engine_touch(engine, tag, base, rels, timeout_s, record=None): queue a touch job (mtimes to now)"}, \
    {"engine_namespace", py_engine_namespace, METH_VARARGS,                                                   \
     "engine_namespace(engine, base, root, ns, rest, manifest_name, manifest) -> bool: what a store whose "    \
     "directories were removed under it makes again (True: registered, False: held already)"},                \
    {"engine_clock", py_engine_clock, METH_VARARGS,                                                           \
     "engine_clock(engine, now_s=None) -> the watchdog's time; now_s makes it a manual clock (tests)"},       \
    {"engine_info", py_engine_info, METH_O, "engine_info(engine) -> counters"},                               \
    {"engine_shutdown", py_engine_shutdown, METH_VARARGS,                                                     \
     "engine_shutdown(engine, timeout_s) -> bool: cancel queued keys, stop the workers"},
