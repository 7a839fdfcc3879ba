/* Host code shaped as nvcc generates it for a .cu file, for tracer's reading of registration
 * code (inspect/src/cuda/registered.rs): a constructor registers each kernel's host function
 * with __cudaRegisterFunction, called through the PLT (the program is linked against
 * libcudart.so.13, as PyTorch's libraries are). Kernels are launched three ways:
 * - matmul, reduce_sum, add as CUDA 12's stubs do: cudaLaunchKernel of the host function;
 * - scale, softmax as CUDA 13's stubs do: each stub looks its kernel's runtime handle up once,
 *   with __cudaGetKernel(&handle, stub), keeps it in a static of its own and launches the
 *   handle through __cudaLaunchKernel;
 * - gemm, splitk_reduce at the driver, as cluster launchers (CUTLASS's) do: the driver's
 *   function for the host stub, from cudaGetFuncBySymbol, handed to cuLaunchKernelEx;
 *   gemm's launcher keeps that function in a static, splitk_reduce's gets it at every launch.
 * The program is built stripped: no symbol names a host function, so for a session that starts
 * after the registration only the registration code can name the kernels. It launches scale,
 * softmax and gemm once before its cue (a warm process): their handles, and the driver's
 * functions under them, are made before the session.
 *
 * It prints "ready" once its kernels are registered and warm and waits for a line; then it
 * launches kernel i (from 1) i × n times, prints its account of those launches as one line of
 * JSON ({"ok": true, "launches": [{"kernel": MANGLED, "count": N, "runtime": BOOL}, …]};
 * runtime: launched through cudaLaunchKernel, every launch reaching the driver's
 * cuLaunchKernel*) and waits for stdin to close.
 * usage: warm_kernels [n=3] */
#include "fake_cuda_abi.h"

#include <stdio.h>
#include <stdlib.h>

#define NAME_MATMUL "_Z6matmulPfS_S_i"
#define NAME_REDUCE "_Z9reduceSumILi256EEvPKfPfi"
#define NAME_ADD                                                                               \
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_15CUDAFunctor_addIfEESt5arrayIPcLm3EE" \
    "EEviT0_T1_"
#define NAME_SCALE "_Z5scalePffi"
#define NAME_SOFTMAX "_Z11softmax_fwdILi1024EEvPKfPfi"
#define NAME_GEMM "_Z4gemmILi128ELi64EEvPKfS1_Pf"
#define NAME_SPLITK "_Z13splitk_reducePfS_i"

static const char ptx[] __attribute__((aligned(8))) =
    "// warm_kernels.c\n.version 8.0\n.target sm_80\n.address_size 64\n\n"
    ".visible .entry " NAME_MATMUL "()\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_REDUCE "()\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_ADD "()\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_SCALE "()\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_SOFTMAX "()\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_GEMM "()\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_SPLITK "()\n{\n\tret;\n}\n";

static const __fatBinC_Wrapper_t fatbin = {FATBINC_MAGIC, 1, (const unsigned long long *)ptx,
                                           NULL};
static void **handle;

static void launch(const void *host) {
    dim3 grid = {1, 1, 1}, block = {32, 1, 1};
    cudaError_t rc = cudaLaunchKernel(host, grid, block, NULL, 0, NULL);
    if (rc != 0) {
        fprintf(stderr, "warm_kernels: cudaLaunchKernel: %d\n", rc);
        exit(4);
    }
}

/* The host functions the kernels are registered and launched by. */
__attribute__((noinline)) static void matmul(void) {
    launch((const void *)matmul);
}
__attribute__((noinline)) static void reduce_sum(void) {
    launch((const void *)reduce_sum);
}
__attribute__((noinline)) static void add(void) {
    launch((const void *)add);
}

/* CUDA 13's host stub (crt/host_runtime.h's __cudaLaunch): the kernel's handle, looked up at
 * the first launch and kept in a static; the configuration pushed by the <<<…>>> call site and
 * popped here; the handle launched. */
#define STUB13(stub, grid_x, block_x)                                                          \
    __attribute__((noinline)) static void stub(void) {                                         \
        static cudaKernel_t handle;                                                            \
        if (!handle && __cudaGetKernel(&handle, (const void *)stub) != cudaSuccess) {          \
            fprintf(stderr, "warm_kernels: __cudaGetKernel failed\n");                         \
            exit(4);                                                                           \
        }                                                                                      \
        dim3 grid = {grid_x, 1, 1}, block = {block_x, 1, 1};                                   \
        size_t shmem;                                                                          \
        void *stream;                                                                          \
        if (__cudaPushCallConfiguration(grid, block, 0, NULL) != 0 ||                          \
            __cudaPopCallConfiguration(&grid, &block, &shmem, &stream) != cudaSuccess ||       \
            __cudaLaunchKernel(handle, grid, block, NULL, shmem, stream) != cudaSuccess) {     \
            fprintf(stderr, "warm_kernels: launching a CUDA 13 stub failed\n");                \
            exit(4);                                                                           \
        }                                                                                      \
    }
STUB13(scale, 2, 64)
STUB13(softmax, 4, 128)

/* Host stubs of kernels launched at the driver (their bodies, never run, differ so that the
 * compiler keeps two functions). */
__attribute__((noinline)) static void gemm(void) {
    launch((const void *)gemm);
}
__attribute__((noinline)) static void splitk_reduce(void) {
    launch((const void *)splitk_reduce);
}

static void driver_launch(CUfunction f, unsigned grid_x, unsigned block_x) {
    CUlaunchConfig config = {grid_x, 1, 1, block_x, 1, 1, 256, NULL, NULL, 0};
    CUresult rc = cuLaunchKernelEx(&config, f, NULL, NULL);
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "warm_kernels: cuLaunchKernelEx: %d\n", rc);
        exit(4);
    }
}

__attribute__((noinline)) static void launch_gemm(void) {
    static CUfunction f;
    if (!f && cudaGetFuncBySymbol((cudaFunction_t *)&f, (const void *)gemm) != cudaSuccess) {
        fprintf(stderr, "warm_kernels: cudaGetFuncBySymbol failed\n");
        exit(4);
    }
    driver_launch(f, 8, 128);
}

__attribute__((noinline)) static void launch_splitk_reduce(void) {
    CUfunction f;
    if (cudaGetFuncBySymbol((cudaFunction_t *)&f, (const void *)splitk_reduce) != cudaSuccess) {
        fprintf(stderr, "warm_kernels: cudaGetFuncBySymbol failed\n");
        exit(4);
    }
    driver_launch(f, 16, 256);
}

/* What nvcc's __sti____cudaRegisterAll and __nv_cudaEntityRegisterCallback do. */
__attribute__((constructor)) static void register_all(void) {
    handle = __cudaRegisterFatBinary((void *)&fatbin);
    __cudaRegisterFunction(handle, (const char *)matmul, (char *)NAME_MATMUL, NAME_MATMUL, -1,
                           NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(handle, (const char *)reduce_sum, (char *)NAME_REDUCE, NAME_REDUCE,
                           -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(handle, (const char *)add, (char *)NAME_ADD, NAME_ADD, -1, NULL,
                           NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(handle, (const char *)scale, (char *)NAME_SCALE, NAME_SCALE, -1, NULL,
                           NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(handle, (const char *)softmax, (char *)NAME_SOFTMAX, NAME_SOFTMAX, -1,
                           NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(handle, (const char *)gemm, (char *)NAME_GEMM, NAME_GEMM, -1, NULL,
                           NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(handle, (const char *)splitk_reduce, (char *)NAME_SPLITK, NAME_SPLITK,
                           -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFatBinaryEnd(handle);
}

int main(int argc, char **argv) {
    long n = argc > 1 ? strtol(argv[1], NULL, 10) : 3;
    char line[64];
    /* Warm: the CUDA 13 kernels' handles made, and the driver's functions under them. */
    scale();
    softmax();
    launch_gemm();
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (long i = 0; i < n; i++) matmul();
    for (long i = 0; i < 2 * n; i++) reduce_sum();
    for (long i = 0; i < 3 * n; i++) add();
    for (long i = 0; i < 4 * n; i++) scale();
    for (long i = 0; i < 5 * n; i++) softmax();
    for (long i = 0; i < 6 * n; i++) launch_gemm();
    for (long i = 0; i < 7 * n; i++) launch_splitk_reduce();
    /* At the runtime (cudaLaunchKernel) and at the driver (cuLaunchKernel*). */
    printf("{\"ok\": true, \"launches\": [");
    const char *names[] = {NAME_MATMUL, NAME_REDUCE, NAME_ADD, NAME_SCALE, NAME_SOFTMAX,
                           NAME_GEMM, NAME_SPLITK};
    for (int i = 0; i < 7; i++)
        printf("%s{\"kernel\": \"%s\", \"count\": %ld, \"runtime\": %s}", i ? ", " : "",
               names[i], (i + 1) * n, i < 5 ? "true" : "false");
    printf("]}\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
    }
    __cudaUnregisterFatBinary(handle);
    return 0;
}
