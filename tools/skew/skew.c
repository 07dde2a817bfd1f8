/*
 * A clock-skew shim for the torture and clock-skew tests: LD_PRELOAD it into a process and set
 * MONGOTX_SKEW_MS to shift that process's wall clock (CLOCK_REALTIME, gettimeofday, time) by that
 * many milliseconds, ahead or behind. The monotonic clock is left alone, as a skewed host's is.
 *
 * Built by tools/skew.sh (the torture run builds it on demand).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long skew_ns(void) {
    static long long cached = -1;
    static int known = 0;
    if (!known) {
        const char *text = getenv("MONGOTX_SKEW_MS");
        cached = text ? atoll(text) * 1000000LL : 0;
        known = 1;
    }
    return cached;
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + skew_ns();
    ts->tv_sec = (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000L;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *) = NULL;
    if (!real) {
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    }
    int result = real(id, ts);
    if (result == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        shift(ts);
    }
    return result;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int result = clock_gettime(CLOCK_REALTIME, &ts);
    if (result == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    (void)tz;
    return result;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}
