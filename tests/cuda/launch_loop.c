/* A launch-bound loop for `cargo xtask bench cuda`: what tracer adds to each kernel launch.
 *
 * Loads libcudart.so.13 (the fake one next to it, through the $ORIGIN runpath), registers one
 * kernel as nvcc's static constructors do and creates the context (which maps libcuda.so.1),
 * so that both libraries are mapped before the cue: a session started on this pid then probes
 * them before the first timed launch. It prints "ready" and waits for a line on stdin (EOF
 * also goes on), makes WARMUP untimed launches (the runtime's lazy kernel load happens at the
 * first), then ROUNDS rounds of N launches the way nvcc 13's <<<…>>> does it
 * (__cudaPushCallConfiguration, then in the host stub __cudaPopCallConfiguration and
 * cudaLaunchKernel), each timed with CLOCK_MONOTONIC, and prints:
 *
 *   SECONDS x.xxxxxx   one line per round: that round's N launches
 *   LAUNCHES n         cudaLaunchKernel calls after the cue, warm-up included
 *
 * Each cudaLaunchKernel goes on to the driver's cuLaunchKernel (as the real runtime's do), so
 * a launch crosses two probed entry points. Exits 1 if a launch failed.
 *
 * usage: launch_loop [N=200000] [ROUNDS=5]
 *
 * Built with -DLAUNCH_LOOP_LIBRARY as liblaunch_loop.so instead, it has no main but exports
 * launch_loop_main(argc, argv), which tests/cuda/launch_loop.py calls from one Python line:
 * the same launches, made under a Python frame (what tracer reads for each launch's call
 * site). */
#define _GNU_SOURCE
#include "fake_cuda_abi.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NAME_STEP "_Z4stepPfi" /* step(float*, int) */
#define WARMUP 1000

static const char ptx[] __attribute__((aligned(8))) =
    "// launch_loop.c\n.version 8.0\n.target sm_80\n.address_size 64\n\n"
    ".visible .entry " NAME_STEP "(\n\t.param .u64 p0, .param .u32 p1)\n{\n\tret;\n}\n";

static const __fatBinC_Wrapper_t wrapper = {FATBINC_MAGIC, 1, (const unsigned long long *)ptx,
                                            NULL};

#define FN(name) __typeof__(name) *name;
static struct {
    FN(cudaFree) FN(cudaMalloc) FN(cudaLaunchKernel) FN(cudaDeviceSynchronize)
    FN(__cudaRegisterFatBinary) FN(__cudaRegisterFatBinaryEnd) FN(__cudaRegisterFunction)
    FN(__cudaGetKernel) FN(__cudaPushCallConfiguration) FN(__cudaPopCallConfiguration)
} rt;
#undef FN

static long failures;

static void *sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "launch_loop: dlsym %s: %s\n", name, dlerror());
        exit(3);
    }
    return p;
}

/* The host stub nvcc 13 generates for `__global__ void step(float *, int)`. */
__attribute__((noinline)) static void step(float *x, int n) {
    static cudaKernel_t handle;
    void *args[] = {&x, &n};
    if (!handle && rt.__cudaGetKernel(&handle, (const void *)step) != cudaSuccess) failures++;
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    if (rt.__cudaPopCallConfiguration(&grid, &block, &shmem, &stream) != cudaSuccess ||
        rt.cudaLaunchKernel((const void *)handle, grid, block, args, shmem, stream) != cudaSuccess)
        failures++;
}

/* step<<<64, 256>>>(x, n) */
static void launch(float *x, int n) {
    dim3 grid = {64, 1, 1}, block = {256, 1, 1};
    if (rt.__cudaPushCallConfiguration(grid, block, 0, NULL) != 0) {
        failures++;
        return;
    }
    step(x, n);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((visibility("default"))) int launch_loop_main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000, rounds = argc > 2 ? atol(argv[2]) : 5;
    if (n < 1 || rounds < 1) {
        fprintf(stderr, "usage: launch_loop [N=200000] [ROUNDS=5]\n");
        return 2;
    }
    void *h = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "launch_loop: dlopen libcudart.so.13: %s\n", dlerror());
        return 3;
    }
#define RT(name) rt.name = (__typeof__(rt.name))sym(h, #name)
    RT(cudaFree); RT(cudaMalloc); RT(cudaLaunchKernel); RT(cudaDeviceSynchronize);
    RT(__cudaRegisterFatBinary); RT(__cudaRegisterFatBinaryEnd); RT(__cudaRegisterFunction);
    RT(__cudaGetKernel); RT(__cudaPushCallConfiguration); RT(__cudaPopCallConfiguration);
#undef RT
    void **fatbin = rt.__cudaRegisterFatBinary((void *)&wrapper);
    if (!fatbin) return 3;
    rt.__cudaRegisterFunction(fatbin, (const char *)step, (char *)NAME_STEP, NAME_STEP, -1, NULL,
                              NULL, NULL, NULL, NULL);
    rt.__cudaRegisterFatBinaryEnd(fatbin);
    float *x = NULL;
    /* cudaFree(NULL) creates the context: libcuda.so.1 is mapped from here on. */
    if (rt.cudaFree(NULL) != cudaSuccess || rt.cudaMalloc((void **)&x, 4096) != cudaSuccess) {
        fprintf(stderr, "launch_loop: no context or no memory\n");
        return 3;
    }

    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;

    long launches = 0;
    for (int i = 0; i < WARMUP; i++, launches++)
        launch(x, 1024);
    for (long r = 0; r < rounds; r++) {
        double t = now();
        for (long i = 0; i < n; i++)
            launch(x, 1024);
        t = now() - t;
        launches += n;
        printf("SECONDS %.6f\n", t);
    }
    if (rt.cudaDeviceSynchronize() != cudaSuccess) failures++;
    printf("LAUNCHES %ld\n", launches);
    fflush(stdout);
    if (failures) fprintf(stderr, "launch_loop: %ld launches failed\n", failures);
    return failures ? 1 : 0;
}

#ifndef LAUNCH_LOOP_LIBRARY
int main(int argc, char **argv) { return launch_loop_main(argc, argv); }
#endif
