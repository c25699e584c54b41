/*
 * The operating system's services the library uses (bs_os.h): on Windows the Win32 locks,
 * condition variables, threads, one-time initialisation, aligned buffers and file mapping; on every
 * system the monotonic clock and read-only file mapping. Calls no other file of the library (the
 * bottom of native/README.md's order).
 */
#define _GNU_SOURCE
#include "bs_os.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#if defined(_WIN32)

#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <malloc.h>
#include <process.h>
#include <windows.h>

_Static_assert(sizeof(bs_mutex) == sizeof(SRWLOCK), "bs_mutex holds an SRWLOCK");
_Static_assert(sizeof(bs_cond) == sizeof(CONDITION_VARIABLE), "bs_cond holds a CONDITION_VARIABLE");
_Static_assert(sizeof(bs_once) == sizeof(INIT_ONCE), "bs_once holds an INIT_ONCE");

void bs_mutex_init(bs_mutex * m) { InitializeSRWLock((PSRWLOCK)m); }
void bs_mutex_lock(bs_mutex * m) { AcquireSRWLockExclusive((PSRWLOCK)m); }
void bs_mutex_unlock(bs_mutex * m) { ReleaseSRWLockExclusive((PSRWLOCK)m); }
void bs_mutex_destroy(bs_mutex * m) { (void)m; /* an SRWLOCK holds no resource */ }
void bs_cond_init(bs_cond * c) { InitializeConditionVariable((PCONDITION_VARIABLE)c); }
void bs_cond_wait(bs_cond * c, bs_mutex * m) {
    SleepConditionVariableSRW((PCONDITION_VARIABLE)c, (PSRWLOCK)m, INFINITE, 0);
}
void bs_cond_signal(bs_cond * c) { WakeConditionVariable((PCONDITION_VARIABLE)c); }
void bs_cond_broadcast(bs_cond * c) { WakeAllConditionVariable((PCONDITION_VARIABLE)c); }
void bs_cond_destroy(bs_cond * c) { (void)c; }

typedef struct {
    void * (*fn)(void *);
    void * arg;
} thread_start;

static unsigned __stdcall thread_main(void * p) {
    thread_start s = *(thread_start *)p;
    free(p);
    s.fn(s.arg);
    return 0;
}

int bs_thread_create(bs_thread * t, void * (*fn)(void *), void * arg) {
    thread_start * s = malloc(sizeof(*s));
    if (s == NULL) {
        return ENOMEM;
    }
    s->fn = fn;
    s->arg = arg;
    /* _beginthreadex, not CreateThread: the C runtime's per-thread state is set up for the thread */
    uintptr_t h = _beginthreadex(NULL, 0, thread_main, s, 0, NULL);
    if (h == 0) {
        free(s);
        return EAGAIN;
    }
    *t = (bs_thread)h;
    return 0;
}

void bs_thread_join(bs_thread t) {
    WaitForSingleObject((HANDLE)t, INFINITE);
    CloseHandle((HANDLE)t);
}

static BOOL CALLBACK once_main(PINIT_ONCE once, PVOID param, PVOID * context) {
    (void)once;
    (void)context;
    void (*fn)(void);
    memcpy(&fn, param, sizeof(fn));
    fn();
    return TRUE;
}

void bs_once_run(bs_once * once, void (*fn)(void)) {
    InitOnceExecuteOnce((PINIT_ONCE)once, once_main, (PVOID)&fn, NULL);
}

void bs_yield(void) { SwitchToThread(); }

void bs_stderr_write(const char * s, size_t n) {
    DWORD w;
    WriteFile(GetStdHandle(STD_ERROR_HANDLE), s, (DWORD)n, &w, NULL);
}

_Noreturn void bs_exit_now(int code) { _exit(code); }

void * bs_aligned_alloc(size_t align, size_t size) { return _aligned_malloc(size, align); }
void bs_aligned_free(void * p) { _aligned_free(p); }

uint64_t bs_now_ns(void) {
    static LARGE_INTEGER freq; /* constant from boot; threads racing here store the same value */
    LARGE_INTEGER now;
    if (freq.QuadPart == 0) {
        QueryPerformanceFrequency(&freq);
    }
    QueryPerformanceCounter(&now);
    const uint64_t c = (uint64_t)now.QuadPart, f = (uint64_t)freq.QuadPart;
    return c / f * 1000000000ull + c % f * 1000000000ull / f;
}

static void why_win32(char * why, size_t n, const char * what, DWORD code) {
    const char * text = code == ERROR_FILE_NOT_FOUND     ? "no such file"
                        : code == ERROR_PATH_NOT_FOUND   ? "no such folder"
                        : code == ERROR_ACCESS_DENIED    ? "access denied"
                        : code == ERROR_SHARING_VIOLATION ? "in use by another process"
                        : code == ERROR_NOT_ENOUGH_MEMORY ? "not enough memory"
                                                          : "Windows error";
    snprintf(why, n, "%s: %s (%lu)", what, text, (unsigned long)code);
}

int bs_map_file(const char * path, void ** addr, size_t * size, char * why, size_t why_size) {
    int wlen = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path, -1, NULL, 0);
    if (wlen <= 0) {
        snprintf(why, why_size, "cannot open: not a UTF-8 path");
        return 1;
    }
    wchar_t * wpath = malloc((size_t)wlen * sizeof(wchar_t));
    if (wpath == NULL) {
        snprintf(why, why_size, "cannot open: out of memory");
        return 1;
    }
    MultiByteToWideChar(CP_UTF8, 0, path, -1, wpath, wlen);
    HANDLE file = CreateFileW(wpath, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_DELETE, NULL, OPEN_EXISTING,
                              FILE_ATTRIBUTE_NORMAL, NULL);
    free(wpath);
    if (file == INVALID_HANDLE_VALUE) {
        why_win32(why, why_size, "cannot open", GetLastError());
        return 1;
    }
    LARGE_INTEGER len;
    BY_HANDLE_FILE_INFORMATION info;
    if (GetFileType(file) != FILE_TYPE_DISK || !GetFileInformationByHandle(file, &info) ||
        (info.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY) || !GetFileSizeEx(file, &len)) {
        CloseHandle(file);
        snprintf(why, why_size, "not a regular file");
        return 1;
    }
    if (len.QuadPart <= 0) {
        CloseHandle(file);
        snprintf(why, why_size, "empty file");
        return 2;
    }
    /* the view keeps the mapping object, and that the file, open: both handles can go */
    HANDLE mapping = CreateFileMappingW(file, NULL, PAGE_READONLY, 0, 0, NULL);
    DWORD code = GetLastError();
    CloseHandle(file);
    if (mapping == NULL) {
        why_win32(why, why_size, "cannot map", code);
        return 1;
    }
    void * view = MapViewOfFile(mapping, FILE_MAP_READ, 0, 0, 0);
    code = GetLastError();
    CloseHandle(mapping);
    if (view == NULL) {
        why_win32(why, why_size, "cannot map", code);
        return 1;
    }
    *addr = view;
    *size = (size_t)len.QuadPart;
    return 0;
}

void bs_unmap_file(void * addr, size_t size) {
    (void)size;
    if (addr != NULL) {
        UnmapViewOfFile(addr);
    }
}

#else /* POSIX */

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void * bs_aligned_alloc(size_t align, size_t size) {
    void * p = NULL;
    return posix_memalign(&p, align, size) == 0 ? p : NULL;
}

void bs_aligned_free(void * p) { free(p); }

void bs_stderr_write(const char * s, size_t n) {
    while (n > 0) {
        const ssize_t w = write(2, s, n);
        if (w <= 0) {
            return;
        }
        s += w;
        n -= (size_t)w;
    }
}

_Noreturn void bs_exit_now(int code) { _exit(code); }

uint64_t bs_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int bs_map_file(const char * path, void ** addr, size_t * size, char * why, size_t why_size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, why_size, "cannot open: %s", strerror(errno));
        return 1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(why, why_size, "not a regular file");
        return 1;
    }
    if (st.st_size <= 0) {
        close(fd);
        snprintf(why, why_size, "empty file");
        return 2;
    }
    void * map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    const int e = errno;
    close(fd); /* the mapping stays valid without the descriptor */
    if (map == MAP_FAILED) {
        snprintf(why, why_size, "cannot map: %s", strerror(e));
        return 1;
    }
    *addr = map;
    *size = (size_t)st.st_size;
    return 0;
}

void bs_unmap_file(void * addr, size_t size) {
    if (addr != NULL) {
        munmap(addr, size);
    }
}

#endif
