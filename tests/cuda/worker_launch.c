/* Launches from a thread that runs no Python, as autograd's and C++ pools' threads do: the
 * caller (tests/scripts/cuda_calls.py, through ctypes, which releases the GIL for the call)
 * waits in launch_on_a_thread while a new thread makes the launches through the runtime's
 * cudaLaunchKernel it was given (driver_launch_on_a_thread: the driver's cuLaunchKernel). */
#include "fake_cuda_abi.h"

#include <pthread.h>

typedef cudaError_t (*launch_fn)(const void *, dim3, dim3, void **, size_t, cudaStream_t);
typedef CUresult (*cu_launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 unsigned, unsigned, CUstream, void **, void **);

struct work {
    launch_fn launch;
    cu_launch_fn cu_launch;
    int n;
};

static void *run(void *arg) {
    struct work *w = arg;
    dim3 grid = {3, 1, 1}, block = {8, 1, 1};
    for (int i = 0; i < w->n; i++) {
        if (w->cu_launch)
            w->cu_launch((CUfunction)0x1234, 3, 1, 1, 8, 1, 1, 0, NULL, NULL, NULL);
        else
            w->launch((const void *)0x5678, grid, block, NULL, 0, NULL);
    }
    return NULL;
}

static int on_a_thread(struct work *w) {
    pthread_t t;
    if (pthread_create(&t, NULL, run, w) != 0) return -1;
    return pthread_join(t, NULL);
}

__attribute__((visibility("default"))) int launch_on_a_thread(launch_fn launch, int n) {
    struct work w = {launch, NULL, n};
    return on_a_thread(&w);
}

__attribute__((visibility("default"))) int driver_launch_on_a_thread(cu_launch_fn launch, int n) {
    struct work w = {NULL, launch, n};
    return on_a_thread(&w);
}
