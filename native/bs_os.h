/* What differs between operating systems, in one place (as bitsplit_llama/_platform.py is for the
 * Python side): locks, condition variables, threads, one-time initialisation, yielding the core,
 * 64-byte-aligned buffers, the monotonic clock and read-only file mapping. Linux and the other POSIX
 * systems use pthreads and mmap (inline here, so that nothing changes there); Windows (MinGW-w64 gcc
 * or clang) uses Win32's slim reader/writer locks, condition variables, one-time initialisation,
 * threads and file mapping, in os.c, so that <windows.h> (its macros: min, max, near, far, ERROR...)
 * reaches no other file of the library. Nothing here calls another file of the library (os.c is the
 * bottom of native/README.md's order). */
#ifndef BS_OS_H
#define BS_OS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(_WIN32)

/* the Win32 objects are one pointer each and zero when initialised statically (SRWLOCK_INIT,
 * CONDITION_VARIABLE_INIT, INIT_ONCE_STATIC_INIT); os.c checks these sizes against <windows.h> */
typedef struct { void * p; } bs_mutex;
typedef struct { void * p; } bs_cond;
typedef struct { void * p; } bs_once;
typedef void * bs_thread; /* a thread's HANDLE */
#define BS_ONCE_INIT {0}

void bs_mutex_init(bs_mutex * m);
void bs_mutex_lock(bs_mutex * m);
void bs_mutex_unlock(bs_mutex * m);
void bs_mutex_destroy(bs_mutex * m);
void bs_cond_init(bs_cond * c);
void bs_cond_wait(bs_cond * c, bs_mutex * m);
void bs_cond_signal(bs_cond * c);
void bs_cond_broadcast(bs_cond * c);
void bs_cond_destroy(bs_cond * c);
/* 0 on success */
int bs_thread_create(bs_thread * t, void * (*fn)(void *), void * arg);
void bs_thread_join(bs_thread t);
void bs_once_run(bs_once * once, void (*fn)(void));
void bs_yield(void);

#else /* POSIX */

#include <pthread.h>
#include <sched.h>

typedef pthread_mutex_t bs_mutex;
typedef pthread_cond_t bs_cond;
typedef pthread_once_t bs_once;
typedef pthread_t bs_thread;
#define BS_ONCE_INIT PTHREAD_ONCE_INIT

static inline void bs_mutex_init(bs_mutex * m) { pthread_mutex_init(m, NULL); }
static inline void bs_mutex_lock(bs_mutex * m) { pthread_mutex_lock(m); }
static inline void bs_mutex_unlock(bs_mutex * m) { pthread_mutex_unlock(m); }
static inline void bs_mutex_destroy(bs_mutex * m) { pthread_mutex_destroy(m); }
static inline void bs_cond_init(bs_cond * c) { pthread_cond_init(c, NULL); }
static inline void bs_cond_wait(bs_cond * c, bs_mutex * m) { pthread_cond_wait(c, m); }
static inline void bs_cond_signal(bs_cond * c) { pthread_cond_signal(c); }
static inline void bs_cond_broadcast(bs_cond * c) { pthread_cond_broadcast(c); }
static inline void bs_cond_destroy(bs_cond * c) { pthread_cond_destroy(c); }
static inline int bs_thread_create(bs_thread * t, void * (*fn)(void *), void * arg) {
    return pthread_create(t, NULL, fn, arg);
}
static inline void bs_thread_join(bs_thread t) { pthread_join(t, NULL); }
static inline void bs_once_run(bs_once * once, void (*fn)(void)) { pthread_once(once, fn); }
static inline void bs_yield(void) { sched_yield(); }

#endif

/* size bytes aligned to align (a power of two), NULL when out of memory; freed by bs_aligned_free
 * (os.c: posix_memalign, where the sanitizer tests inject failures; Windows: _aligned_malloc) */
void * bs_aligned_alloc(size_t align, size_t size);
void bs_aligned_free(void * p);

/* os.c: n bytes written to the standard error as they are (async-signal-safe: no stdio), and the
 * process ended at once with status code (no atexit handlers, no stdio flush) */
void bs_stderr_write(const char * s, size_t n);
_Noreturn void bs_exit_now(int code);

/* os.c: nanoseconds of a monotonic clock */
uint64_t bs_now_ns(void);

/* os.c: path (UTF-8) mapped read-only whole, shared with the page cache (no copy): *addr, *size.
 * Returns 0, or 1 when it cannot be opened, is not a regular file or cannot be mapped, 2 when it is
 * empty; what went wrong in why (a short phrase, no path). Unmapped by bs_unmap_file. */
int bs_map_file(const char * path, void ** addr, size_t * size, char * why, size_t why_size);
void bs_unmap_file(void * addr, size_t size);

#endif /* BS_OS_H */
