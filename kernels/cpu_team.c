/* Our own thread team for the fused steps' parallel loops (the layers, the final logits, drafting's rows; the
 * products and attention called inside PyTorch's per-operation forward stay on OpenMP's team, that of the code around
 * them): the calling thread and workers of our own, which busy-wait while a call runs, go to sleep a few milliseconds
 * after it ends (at once when a service says so), and join a call late without holding it up.
 *
 * Why: a step calls the kernels a few times (the fused layers, the final logits, drafting's rows) and spends the
 * rest of its time elsewhere: in Python, and through the services in the request manager, Redis and the client,
 * processes that share the same few cores. OpenMP's workers (GNU libgomp, the runtime torch loads) busy-wait after
 * every parallel region until GOMP_SPINCOUNT runs out, and the same count bounds their waits at the barriers inside a
 * region: on the 2-core machines of BENCHMARKS.md the verifier's worker spun through the whole gap between steps (91 %
 * of a core), so the other processes of a step took turns on the one core left; a small count made every barrier of
 * a forward sleep and wake instead. Here a worker spins IDLE_SPIN_NS after a call (catching the next call of the same
 * step, and of the next step in process: the draft head's steps in process were 5 % slower with 1 ms) and then
 * sleeps until team_run wakes it; a service that knows its next call is a network round trip away
 * sends the workers to sleep at once (team_rest, after a reply) and wakes them when a message arrives (team_wake), so
 * that they are up by the time its model call starts. Waking a sleeping thread takes tens to hundreds of
 * microseconds (a virtual machine's idle CPU must be woken first), so a call does not wait for a sleeping worker:
 * each loop is shared by the threads that have *joined* the call when the loop begins (the caller, the workers that
 * were busy-waiting when it started, and those that woke up since), each taking a contiguous share, as OpenMP's
 * static schedule; a worker that wakes mid-call skips the loops already done and joins from the next loop on.
 *
 * Terms: a *call* is one team_run: its task runs on every thread that joins it, the caller as thread 0, each worker
 * under the next number (its *rank*); its loops are TEAM_FOR loops, the same sequence on every thread; a loop's
 * *phase* is its number in the pool's count of loops, and its *sharers* the ranks below the count of threads joined
 * when it began. Share r of n iterations split s ways is [n r / s, n (r + 1) / s): only which thread computes an
 * output depends on the threads, never a reduction's order, so every result is the same whatever the threads and
 * their timing (the kernels' exactness across steps holds on this team as on OpenMP's).
 *
 * One call at a time: a second thread's team_run waits for the first to end (the machine's cores are the team's).
 * After fork() the child has no workers; it starts its own when it first calls (pthread_atfork).
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cpu_kernels.h"

#define TEAM_THREAD_NAME "specinfer-team"  /* the workers' name in /proc (top -H, py-spy) */
#define TEAM_MAX 255                        /* threads of a call at most (a phase's sharers fit its word's low byte) */
#define PHASE_MASK 0xffffffu                /* phases are counted in the word's upper 24 bits (wrapping) */
#define IDLE_SPIN_NS 5000000L               /* a worker's busy wait for the next call before it sleeps */
#define LOOP_SPIN_NS 20000000L              /* at a loop's end, for another thread's chunk (then sleeps) */

/* A futex word and how many threads sleep (or are about to) on it. */
typedef struct {
    atomic_uint value;
    atomic_int sleepers;
} Word;

static struct {
    pthread_mutex_t call;          /* held by the calling thread for a whole call */
    int workers;                   /* workers started (ids 1 .. workers) */
    unsigned born[TEAM_MAX];       /* each worker's call count when started: the calls it may join come after */
    pthread_t threads[TEAM_MAX];
    TeamTask task;                 /* the current call's (valid while `open`) */
    void *arg;
    int size;
    unsigned first_phase;          /* the phase of the call's first loop */
    Word calls;                    /* bumped once a call, and by team_wake: the idle workers' wake-up */
    atomic_int rest;               /* set by team_rest: idle workers sleep at once; cleared by the next wake-up */
    atomic_int open;               /* 1 while the current call takes workers */
    atomic_int inside;             /* workers inside the current call's task (the caller waits for them to leave) */
    atomic_int spinning;           /* workers busy-waiting for a call (those a call counts on from its first loop) */
    atomic_int joined;             /* threads in the current call: the next worker to join takes this rank */
    _Alignas(64) Word phase;       /* the current phase << 8 | its sharers (a line of its own, with `done`) */
    atomic_int done;               /* sharers done with the current phase */
} pool = {PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t once = PTHREAD_ONCE_INIT;

static long futex(Word *word, int op, unsigned value) {
    return syscall(SYS_futex, (unsigned *)&word->value, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Busy-waits while the word is `seen`, for up to spin_ns, or until *stop (NULL: none) is set. */
static void spin_while(Word *word, unsigned seen, long spin_ns, const atomic_int *stop) {
    long start = 0;
    for (unsigned i = 0; atomic_load_explicit(&word->value, memory_order_acquire) == seen; i++) {
        if (stop && atomic_load_explicit(stop, memory_order_relaxed)) break;
        if ((i & 63) == 0) {
            const long t = now_ns();
            if (!start)
                start = t;
            else if (t - start > spin_ns)
                break;
        }
        _mm_pause();
    }
}

/* Returns once the word is no longer `seen`: busy-waits up to spin_ns, then sleeps on it. The sleepers count tells
 * wakers whether a futex wake is needed: a sleeper counts itself before it checks the word (seq_cst), a waker
 * changes the word before it reads the count, so one of the two sees the other. */
static void await_change(Word *word, unsigned seen, long spin_ns) {
    spin_while(word, seen, spin_ns, NULL);
    while (atomic_load(&word->value) == seen) {
        atomic_fetch_add(&word->sleepers, 1);
        if (atomic_load(&word->value) == seen) futex(word, FUTEX_WAIT, seen);
        atomic_fetch_sub(&word->sleepers, 1);
    }
}

/* Adds 1 to the word and wakes whoever sleeps on it. */
static void bump(Word *word) {
    atomic_fetch_add(&word->value, 1);
    if (atomic_load(&word->sleepers)) futex(word, FUTEX_WAKE, INT_MAX);
}

void team_begin(Team *team) {
    if (team->size == 1) {  /* alone: the whole loop, no pool */
        team->share = 1;
        return;
    }
    const unsigned word = atomic_load(&pool.phase.value);
    team->word = word;
    if ((word >> 8) != (team->phase & PHASE_MASK)) {  /* behind: this loop is done already */
        team->share = 0;
        return;
    }
    const int sharers = (int)(word & 0xffu);
    team->share = team->id < sharers ? sharers : 0;  /* a thread that joined after it began waits for its end */
}

void team_end(Team *team) {
    if (team->size == 1) return;
    const unsigned phase = team->phase++ & PHASE_MASK;
    if ((team->word >> 8) != phase) return;  /* behind: nothing to wait for */
    if (team->share && atomic_fetch_add(&pool.done, 1) == team->share - 1) {  /* the last sharer: the next loop */
        atomic_store(&pool.done, 0);
        const int joined = atomic_load(&pool.joined), sharers = joined < team->size ? joined : team->size;
        atomic_store(&pool.phase.value, ((phase + 1) & PHASE_MASK) << 8 | (unsigned)sharers);
        if (atomic_load(&pool.phase.sleepers)) futex(&pool.phase, FUTEX_WAKE, INT_MAX);
        return;
    }
    await_change(&pool.phase, team->word, LOOP_SPIN_NS);
}

/* Returns once a call (or team_wake) bumped `calls` past `seen`: busy-waits up to spin_ns (counted in `spinning`,
 * and ended early by team_rest), then sleeps. */
static void await_call(unsigned seen, long spin_ns) {
    atomic_fetch_add(&pool.spinning, 1);
    spin_while(&pool.calls, seen, spin_ns, &pool.rest);
    atomic_fetch_sub(&pool.spinning, 1);
    await_change(&pool.calls, seen, 0);
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    pthread_setname_np(pthread_self(), TEAM_THREAD_NAME);
    unsigned seen = pool.born[id];
    long spin = IDLE_SPIN_NS;
    for (;;) {
        await_call(seen, spin);
        seen = atomic_load(&pool.calls.value);
        atomic_fetch_add(&pool.inside, 1);
        const int open = atomic_load(&pool.open);  /* the call is still on (Dekker with team_run's close) */
        int joins = 0;
        if (open) {
            const int rank = atomic_fetch_add(&pool.joined, 1);
            joins = rank < pool.size;
            if (joins) {
                Team team = {rank, pool.size, pool.first_phase, 0, 0};
                pool.task(&team, pool.arg);
            }
        }
        atomic_fetch_sub(&pool.inside, 1);
        spin = open && !joins ? 0 : IDLE_SPIN_NS;  /* a call of fewer threads: back to sleep */
    }
    return NULL;
}

static void forget_workers(void) {  /* the child of a fork(): its parent's workers are not its own */
    pthread_mutex_init(&pool.call, NULL);
    pool.workers = 0;
    atomic_store(&pool.inside, 0);
    atomic_store(&pool.open, 0);
    atomic_store(&pool.spinning, 0);
    atomic_store(&pool.done, 0);  /* a call the parent had under way is not the child's */
    atomic_store(&pool.calls.sleepers, 0);
    atomic_store(&pool.phase.sleepers, 0);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

/* Starts workers up to `wanted` (fewer where the system refuses a thread). Workers block every signal: Python's
 * handlers run on its main thread, and a signal delivered to a worker would be lost to it. */
static void start_workers(int wanted) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.workers < wanted) {
        const int id = pool.workers + 1;
        pool.born[id] = atomic_load(&pool.calls.value);
        if (pthread_create(&pool.threads[id], &attr, worker, (void *)(intptr_t)id)) break;
        pool.workers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

void team_wake(void) {
    if (!pool.workers) return;
    atomic_store(&pool.rest, 0);
    bump(&pool.calls);  /* no call open: the workers wake, find none, and spin for the next */
}

void team_rest(void) { atomic_store(&pool.rest, 1); }

void team_run(int threads, TeamTask task, void *arg) {
    if (threads <= 1) {
        Team alone = {0, 1, 0, 0, 0};
        task(&alone, arg);
        return;
    }
    pthread_once(&once, register_fork_handler);
    pthread_mutex_lock(&pool.call);
    threads = threads < TEAM_MAX ? threads : TEAM_MAX;
    start_workers(threads - 1);
    pool.task = task, pool.arg = arg, pool.size = threads;
    /* the first loop's sharers: the caller and the workers busy-waiting now (they join within a microsecond; one
     * that falls asleep meanwhile is woken by the bump below and joins late, the only wait for a wake-up) */
    const int awake = atomic_load(&pool.spinning), sharers = 1 + (awake < threads - 1 ? awake : threads - 1);
    const unsigned phase = atomic_load(&pool.phase.value) >> 8;
    pool.first_phase = phase;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.joined, 1);
    atomic_store(&pool.phase.value, phase << 8 | (unsigned)sharers);
    atomic_store(&pool.open, 1);
    atomic_store(&pool.rest, 0);
    bump(&pool.calls);  /* publishes the call (seq_cst) */
    Team caller = {0, threads, phase, 0, 0};
    task(&caller, arg);  /* returns when every loop is done */
    atomic_store(&pool.open, 0);
    while (atomic_load(&pool.inside)) _mm_pause();  /* workers in the task are leaving it: every phase is over */
    pthread_mutex_unlock(&pool.call);
}

int team_workers(void) { return pool.workers; }

/* The CPU time the workers have used, in seconds (what tests and diagnostics read to see them sleep). */
double team_cpu_seconds(void) {
    double total = 0.0;
    pthread_mutex_lock(&pool.call);
    for (int id = 1; id <= pool.workers; id++) {
        clockid_t clock;
        struct timespec ts;
        if (!pthread_getcpuclockid(pool.threads[id], &clock) && !clock_gettime(clock, &ts))
            total += (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
    pthread_mutex_unlock(&pool.call);
    return total;
}
