/* A pool of worker threads whose caller never waits for a thread that took no work.
 *
 * Why not an OpenMP parallel region: its end is a barrier every thread of the team must reach,
 * so an op that a running thread could finish alone still waits for a thread whose core another
 * process holds (ConvNeXt-T b1 on a shared 2-core box: ~60 such joins per encode). Sleeping at
 * once (OMP_WAIT_POLICY=PASSIVE) lets the scheduler move the late thread to the caller's freed
 * core, but costs every op a wake-up through the hypervisor (65 ms per encode on two quiet threads
 * against 51 ms spinning); spinning makes the wait for a late thread cost its whole time slice
 * (120 -> 400 ms per encode under other jobs, 2-core Xeon, 2026-11-29).
 *
 * Here the caller publishes a job (tasks 0..n-1), takes tasks itself, and returns once every task
 * is finished: a worker that wakes late finds none left and is not waited for. Workers spin a
 * short while after a job (the next op follows within microseconds), yielding their core, then
 * sleep on a futex. One job at a time: a second caller (another Python thread) runs its tasks
 * itself. After fork() the child has no workers and starts its own on first use. Elsewhere
 * than Linux the tasks run in an OpenMP loop. */
#include "vec.h"

#ifdef __linux__
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define POOL_MAX_WORKERS 255
#define POOL_THREAD_NAME "convkernels"
/* pauses a worker spins for the next job before sleeping (~13 ns each on the 2026 Xeon, ~45 on
 * Skylake: 0.1-0.4 ms, a few Python ops' gaps), yielding its core every POOL_YIELD_EVERY */
#define POOL_SPIN 8000
/* a spin-wait hint: x86's pause, Arm's yield (the extension also builds on Linux on Arm) */
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__) || defined(__arm__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif
#define POOL_YIELD_EVERY 512

typedef struct {
    ck_task_fn fn;
    void *ctx;
    Py_ssize_t ntasks;
    _Atomic Py_ssize_t next, done;
} pool_job;

static struct {
    pthread_mutex_t lock; /* one job at a time */
    _Atomic(pool_job *) current;
    _Atomic int active;   /* workers between reading `current` and leaving the job */
    _Atomic unsigned seq; /* futex word: bumped for every job */
    _Atomic int sleepers;
    int workers;          /* started in this process */
} pool = {PTHREAD_MUTEX_INITIALIZER};

static void futex_wait(_Atomic unsigned *addr, unsigned val)
{
    syscall(SYS_futex, (unsigned *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic unsigned *addr) { syscall(SYS_futex, (unsigned *)addr, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0); }

static void run_tasks(pool_job *job)
{
    for (;;) {
        Py_ssize_t t = atomic_fetch_add(&job->next, 1);
        if (t >= job->ntasks) return;
        job->fn(job->ctx, t);
        atomic_fetch_add(&job->done, 1);
    }
}

/* take part in the job now published, if any; the caller waits for `active` to drain before its
 * job (on its stack) goes away, so the pointer stays valid between the two atomics */
static void join_current(void)
{
    atomic_fetch_add(&pool.active, 1);
    pool_job *job = atomic_load(&pool.current);
    if (job) run_tasks(job);
    atomic_fetch_sub(&pool.active, 1);
}

static void *worker_main(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), POOL_THREAD_NAME); /* what top, gdb and the tests show */
    unsigned last = 0; /* `seq` of the last job looked at */
    for (;;) {
        unsigned now = atomic_load(&pool.seq);
        if (now != last) {
            join_current();
            last = now;
            continue;
        }
        int got = 0;
        for (int i = 1; i <= POOL_SPIN && !got; i++) {
            cpu_relax();
            if (atomic_load_explicit(&pool.seq, memory_order_relaxed) != last) got = 1;
            else if (i % POOL_YIELD_EVERY == 0) sched_yield();
        }
        if (got) continue;
        atomic_fetch_add(&pool.sleepers, 1);
        if (atomic_load(&pool.seq) == last) futex_wait(&pool.seq, last);
        atomic_fetch_sub(&pool.sleepers, 1);
    }
    return NULL;
}

/* a fork()ed child has none of the workers, and no job: a parent thread may have been inside one
 * (holding the lock, counted in `active`), which would otherwise block the child's first job */
static void forget_workers(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pool.lock = fresh;
    pool.workers = 0;
    atomic_store(&pool.current, NULL);
    atomic_store(&pool.active, 0);
    atomic_store(&pool.sleepers, 0);
}

static void start_workers(int want)
{
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_workers);
        registered = 1;
    }
    while (pool.workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer helpers; the caller does the rest */
        pool.workers++;
    }
}

void ck_pool_run(ck_task_fn fn, void *ctx, Py_ssize_t ntasks)
{
    int threads = CK_THREADS();
    if (ntasks <= 0) return;
    if (threads < 2 || ntasks < 2 || pthread_mutex_trylock(&pool.lock) != 0) {
        for (Py_ssize_t t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    start_workers(threads - 1 < POOL_MAX_WORKERS ? threads - 1 : POOL_MAX_WORKERS);
    pool_job job = {fn, ctx, ntasks, 0, 0};
    atomic_store(&pool.current, &job);
    atomic_fetch_add(&pool.seq, 1);
    if (atomic_load(&pool.sleepers) > 0) futex_wake(&pool.seq);
    run_tasks(&job);
    /* only tasks a worker is running are waited for */
    for (unsigned i = 1; atomic_load(&job.done) < ntasks; i++) {
        cpu_relax();
        if (i % POOL_YIELD_EVERY == 0) sched_yield();
    }
    atomic_store(&pool.current, NULL);
    for (unsigned i = 1; atomic_load(&pool.active) > 0; i++) { /* workers still holding &job */
        cpu_relax();
        if (i % POOL_YIELD_EVERY == 0) sched_yield();
    }
    pthread_mutex_unlock(&pool.lock);
}

#else
void ck_pool_run(ck_task_fn fn, void *ctx, Py_ssize_t ntasks)
{
#pragma omp parallel for schedule(dynamic, 1) if (ntasks > 1)
    for (Py_ssize_t t = 0; t < ntasks; t++) fn(ctx, t);
}
#endif
