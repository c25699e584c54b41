/*
 * bitsplit_family_peak: how many weight.column multiply-accumulates per second a kernel family's
 * multiply step does on the calling thread, timed in registers alone (the steps are each
 * architecture's: arch/<arch>/peak.c, which says what each one is and why). `bitsplit doctor`
 * divides each measured product's rate by it. Calls the architecture's steps and util.c's clock:
 * level 3 of native/README.md's order.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"

#if defined(__x86_64__) || defined(__aarch64__)
#define STEPS(n) bs_peak_steps(n)
#else
/* an architecture without steps of its own: no family's peak is known (doctor prints none) */
static const bs_peak_step * no_steps(size_t * n) {
    *n = 0;
    return NULL;
}
#define STEPS(n) no_steps(n)
#endif

/* MACs per second: runs of about a fortieth of `seconds` each (the iterations doubled until a run
 * takes that long; the first runs warm the vector units up), the fastest over `seconds` in all:
 * the peak is what the core does when nothing else takes it. Short runs, so that some fall between
 * the time slices of another process on the same core (on a loaded 2-core VM, runs of 5 ms
 * measured half the peak in one call of three; runs of ~1 ms find a clean one) */
static double time_step(const bs_peak_step * s, double seconds) {
    const uint64_t budget = (uint64_t)(seconds * 1e9), run_ns = budget / 40 > 20000 ? budget / 40 : 20000;
    const uint64_t start = bs_now_ns();
    int64_t n = 64;
    double best = 0.0;
    for (;;) {
        const uint64_t t0 = bs_now_ns();
        s->run(n);
        const uint64_t t1 = bs_now_ns(), dt = t1 - t0;
        if (dt >= run_ns / 2 && dt > 0) {
            const double rate = (double)n * s->macs / ((double)dt * 1e-9);
            best = rate > best ? rate : best;
        }
        if (t1 - start >= budget && best > 0.0) {
            return best;
        }
        if (dt < run_ns && n < ((int64_t)1 << 40)) {
            n *= 2;
        }
    }
}

double bitsplit_family_peak(const char * family, double seconds) {
    if (family == NULL || !(seconds > 0.0 && seconds <= 60.0)) {
        return -1.0;
    }
    size_t n = 0;
    const bs_peak_step * steps = STEPS(&n);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(family, steps[i].family) == 0) {
            return steps[i].runs() ? time_step(&steps[i], seconds) : 0.0;
        }
    }
    return -1.0; /* no family of this build */
}
