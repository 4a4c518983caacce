/* A native backtrace where a process dies of SIGSEGV, SIGBUS or SIGABRT: preload it
 * (LD_PRELOAD=segv_trace.so) and the faulting thread's frames go to stderr as `lib(+offset)`,
 * which `addr2line -f -C -e LIB OFFSET` names. For crashes inside a shared library that Python's
 * faulthandler reports only as the Python line that called it (bench/llamacpp_load_probe.py).
 *   gcc -shared -fPIC -O1 -o /tmp/segv_trace.so bench/segv_trace.c */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    void *frames[64];
    char line[96] = "segv_trace: signal ";
    const char *name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "SIGABRT";
    strcat(line, name);
    strcat(line, "; frames:\n");
    (void)info;
    if (write(2, line, strlen(line)) < 0) { /* stderr gone: the frames below will not show either */ }
    int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, 0);
    sigaction(SIGBUS, &sa, 0);
    sigaction(SIGABRT, &sa, 0);
}
