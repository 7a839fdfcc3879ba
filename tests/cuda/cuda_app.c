/* Test program for tracer's CUDA probes, run against the fake libcudart.so.13 / libcuda.so.1
 * (or, by hand, anything exporting the same ABI). It prints "ready" and waits for a line on
 * stdin so that a tracer session can attach first; only then does it dlopen() libcudart (which
 * loads libcuda at its first call), register kernels the way nvcc-generated host code does,
 * load a Triton-style module through the driver, and make a known set of calls, part of them
 * on a second thread. It then prints one line of JSON with the ground truth (README.md), and
 * "done", and waits for stdin to close before it exits: 0 when everything it checked held.
 *
 * usage: cuda_app [n1=10] [n2=6] [n3=5] [n4=4] [n5=3] [n6=2] [graph=1] [k=8] [b1=4096] [m=2]
 *                 [b2=1024] [bad=1] [hold=0] [init=0] [subscribe=0] [warm=0]
 *
 * After "done", a line "cupti" prints what the fake CUPTI holds then, as JSON (null where no
 * CUPTI is loaded): {"subscribed":0|1,"kind":N,"callbacks":0|1,"api_callbacks":N}, the last
 * the API callbacks (launches) turned on. */
#define _GNU_SOURCE
#include "fake_cuda_abi.h"
#include "fake_cupti_abi.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RUNTIME_SONAME "libcudart.so.13"
#define DRIVER_SONAME "libcuda.so.1"

#define NAME_MATMUL "_Z6matmulPfS_S_i"
#define NAME_RELU "_Z4reluPfi"
#define NAME_REDUCE "_Z9reduceSumILi256EEvPKfPfi" /* reduceSum<256>(const float*, float*, int) */
#define NAME_TRITON_ADD "triton_poi_fused_add_0"
#define NAME_TRITON_SOFTMAX "triton_per_fused_softmax_1"

/* ---- parameters ------------------------------------------------------------------------- */

static struct {
    const char *key;
    long value;
    const char *what;
} params[] = {
    {"n1", 10, "cudaLaunchKernel of " NAME_MATMUL " through its host stub (main thread, S1)"},
    {"n2", 6, "cudaLaunchKernelExC of " NAME_RELU " (worker thread, S2)"},
    {"n3", 5, "cuLaunchKernel of " NAME_TRITON_ADD " (main thread, S1)"},
    {"n4", 4, "cuLaunchKernelEx of " NAME_TRITON_SOFTMAX " (main thread, S2)"},
    {"n5", 3, "cudaLaunchKernel_ptsz of " NAME_REDUCE " (main thread, stream 0)"},
    {"n6", 2, "cudaLaunchKernelExC_ptsz of " NAME_REDUCE " with one attribute (main, stream 0)"},
    {"graph", 1, "cudaGraphLaunch of a two-node graph (main thread, S1)"},
    {"k", 8, "cudaMemcpy host to device, b1 bytes each"},
    {"b1", 4096, "bytes per host-to-device cudaMemcpy"},
    {"m", 2, "cudaMemcpy device to host, b2 bytes each"},
    {"b2", 1024, "bytes per device-to-host cudaMemcpy"},
    {"bad", 1, "launches of an unknown handle through cudaLaunchKernel, and as many through "
               "cuLaunchKernel"},
    {"hold", 0, "1: once both libraries are mapped, print \"loaded\" and wait for a line before "
                "the first CUDA call (a program that imports CUDA long before it uses it)"},
    {"init", 0, "1: with hold=1, cuInit before printing \"loaded\" (a program that initializes "
                "CUDA, loading any CUDA_INJECTION64_PATH library, long before its first launch)"},
    {"subscribe", 0, "1: with init=1, take CUPTI's one subscriber slot before printing \"loaded\" "
                     "(a process torch.profiler or Nsight holds)"},
    {"warm", 0, "1: once the kernels are registered and matmul's handle is fetched, print "
                "\"registered\" and wait for a line (a warm process a tracer attaches to later)"},
};
#define NPARAMS (sizeof params / sizeof params[0])

static long param(const char *key) {
    for (size_t i = 0; i < NPARAMS; i++)
        if (strcmp(params[i].key, key) == 0) return params[i].value;
    abort();
}

static void parse_args(int argc, char **argv) {
    for (int a = 1; a < argc; a++) {
        const char *eq = strchr(argv[a], '=');
        size_t i;
        for (i = 0; eq && i < NPARAMS; i++)
            if (strlen(params[i].key) == (size_t)(eq - argv[a]) &&
                strncmp(params[i].key, argv[a], (size_t)(eq - argv[a])) == 0)
                break;
        char *end;
        long v = eq ? strtol(eq + 1, &end, 10) : -1;
        if (!eq || i == NPARAMS || *end || v < 0 || v > 1000000) {
            fprintf(stderr, "cuda_app: bad argument '%s'; arguments are KEY=N with KEY one of:\n",
                    argv[a]);
            for (i = 0; i < NPARAMS; i++)
                fprintf(stderr, "  %-6s (default %ld) %s\n", params[i].key, params[i].value,
                        params[i].what);
            exit(2);
        }
        params[i].value = v;
    }
    if (param("b1") == 0 || param("b2") == 0 || param("b1") > (64 << 20) ||
        param("b2") > (64 << 20)) {
        fprintf(stderr, "cuda_app: b1 and b2 must be in 1..67108864\n");
        exit(2);
    }
}

/* ---- the libraries, through dlopen/dlsym ------------------------------------------------ */

#define FN(name) __typeof__(name) *name;
static struct {
    FN(cudaFree) FN(cudaMalloc) FN(cudaMemcpy) FN(cudaMemcpyAsync) FN(cudaLaunchKernel)
    FN(cudaLaunchKernel_ptsz) FN(cudaLaunchKernelExC) FN(cudaLaunchKernelExC_ptsz)
    FN(cudaGetKernel) FN(cudaGetFuncBySymbol) FN(cudaFuncGetName) FN(cudaGraphCreate)
    FN(cudaGraphAddKernelNode) FN(cudaGraphInstantiate) FN(cudaGraphLaunch)
    FN(cudaGraphExecDestroy) FN(cudaGraphDestroy) FN(cudaStreamCreate) FN(cudaStreamDestroy)
    FN(cudaStreamSynchronize) FN(cudaDeviceSynchronize) FN(cudaGetErrorName)
    FN(__cudaRegisterFatBinary) FN(__cudaRegisterFatBinaryEnd) FN(__cudaUnregisterFatBinary)
    FN(__cudaRegisterFunction) FN(__cudaGetKernel) FN(__cudaPushCallConfiguration)
    FN(__cudaPopCallConfiguration)
} rt;
static struct {
    FN(cuModuleLoadData) FN(cuModuleUnload) FN(cuModuleGetFunction) FN(cuFuncGetName)
    FN(cuLaunchKernel) FN(cuLaunchKernelEx) FN(cuMemAlloc_v2) FN(cuMemFree_v2)
    FN(cuMemcpyHtoD_v2) FN(cuMemcpyDtoH_v2)
} cu;
#undef FN
static const struct fake_cuda_stats *driver_stats;

static void *must_open(const char *soname) {
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "cuda_app: dlopen %s: %s\n", soname, dlerror());
        exit(3);
    }
    return h;
}

static void *must_sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "cuda_app: dlsym %s: %s\n", name, dlerror());
        exit(3);
    }
    return p;
}

#define RT(name) rt.name = (__typeof__(rt.name))must_sym(h, #name)
static void resolve_runtime(void *h) {
    RT(cudaFree); RT(cudaMalloc); RT(cudaMemcpy); RT(cudaMemcpyAsync); RT(cudaLaunchKernel);
    RT(cudaLaunchKernel_ptsz); RT(cudaLaunchKernelExC); RT(cudaLaunchKernelExC_ptsz);
    RT(cudaGetKernel); RT(cudaGetFuncBySymbol); RT(cudaFuncGetName); RT(cudaGraphCreate);
    RT(cudaGraphAddKernelNode); RT(cudaGraphInstantiate); RT(cudaGraphLaunch);
    RT(cudaGraphExecDestroy); RT(cudaGraphDestroy); RT(cudaStreamCreate);
    RT(cudaStreamDestroy); RT(cudaStreamSynchronize); RT(cudaDeviceSynchronize);
    RT(cudaGetErrorName); RT(__cudaRegisterFatBinary); RT(__cudaRegisterFatBinaryEnd);
    RT(__cudaUnregisterFatBinary); RT(__cudaRegisterFunction); RT(__cudaGetKernel);
    RT(__cudaPushCallConfiguration); RT(__cudaPopCallConfiguration);
}
#undef RT
#define CU(name) cu.name = (__typeof__(cu.name))must_sym(h, #name)
static void resolve_driver(void *h) {
    CU(cuModuleLoadData); CU(cuModuleUnload); CU(cuModuleGetFunction); CU(cuFuncGetName);
    CU(cuLaunchKernel); CU(cuLaunchKernelEx); CU(cuMemAlloc_v2); CU(cuMemFree_v2);
    CU(cuMemcpyHtoD_v2); CU(cuMemcpyDtoH_v2);
    driver_stats = dlsym(h, "fake_cuda_stats"); /* absent from a real libcuda */
}
#undef CU

/* ---- device code: PTX text the fake driver reads `.entry` names from -------------------- */

/* What nvcc would embed for the three runtime kernels (handed over in a fatbin wrapper). */
static const char runtime_ptx[] __attribute__((aligned(8))) =
    "// cuda_app.c: the runtime-registered kernels\n"
    ".version 8.0\n.target sm_80\n.address_size 64\n\n"
    ".visible .entry " NAME_MATMUL "(\n"
    "\t.param .u64 p0, .param .u64 p1, .param .u64 p2, .param .u32 p3)\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_RELU "(\n\t.param .u64 p0, .param .u32 p1)\n{\n\tret;\n}\n\n"
    ".weak .entry " NAME_REDUCE "(\n"
    "\t.param .u64 p0, .param .u64 p1, .param .u32 p2)\n{\n\tret;\n}\n";

/* What Triton would hand to cuModuleLoadData. */
static const char triton_ptx[] =
    "// cuda_app.c: a Triton-style module\n"
    ".version 8.0\n.target sm_80\n.address_size 64\n\n"
    ".visible .entry " NAME_TRITON_ADD "(\n"
    "\t.param .u64 in_ptr0, .param .u64 out_ptr0, .param .u32 xnumel)\n{\n\tret;\n}\n\n"
    ".visible .entry " NAME_TRITON_SOFTMAX "(\n"
    "\t.param .u64 in_ptr0, .param .u64 out_ptr0, .param .u32 rnumel)\n{\n\tret;\n}\n";

static const __fatBinC_Wrapper_t fatbin_wrapper = {
    FATBINC_MAGIC, 1, (const unsigned long long *)runtime_ptx, NULL};

/* ---- ground-truth records --------------------------------------------------------------- */

static pid_t gettid_(void) {
    return (pid_t)syscall(SYS_gettid);
}

static pid_t main_tid, worker_tid;
static cudaStream_t S1, S2;
static int launch_with_kernel;

static const char *stream_name(uintptr_t s) {
    if (s == (uintptr_t)S1) return "S1";
    if (s == (uintptr_t)S2) return "S2";
    if (s == 0) return "default";
    if (s == 1) return "legacy";
    if (s == 2) return "per_thread";
    return "?";
}

struct launch_rec {
    const char *layer, *api, *kernel, *driver_api;
    uintptr_t func_arg, driver_handle;
    dim3 grid, block;
    unsigned long long shmem;
    uintptr_t stream, driver_stream;
    unsigned num_attrs;
    pid_t tid;
    long count, failures;
    int result;
};
struct copy_rec {
    const char *layer, *api, *driver_api, *direction;
    unsigned long long bytes;
    uintptr_t stream; /* streams only for async copies */
    int async;
    pid_t tid;
    long count, failures;
};
struct alloc_rec {
    const char *layer, *api, *driver_api, *free_api, *free_driver_api;
    unsigned long long bytes;
    uintptr_t ptr;
    pid_t tid;
    int failures;
};
struct sync_rec {
    const char *api, *driver_api;
    uintptr_t stream;
    int has_stream;
    pid_t tid;
    long count, failures;
};
struct kernel_rec {
    const char *name, *source;
    uintptr_t host_stub, kernel, function, module, driver_handle;
};
struct node_rec {
    const char *kernel;
    dim3 grid, block;
    unsigned shmem;
    uintptr_t driver_handle;
};

#define MAXREC 32
static pthread_mutex_t rec_lock = PTHREAD_MUTEX_INITIALIZER;
static struct launch_rec launches[MAXREC];
static struct copy_rec copies[MAXREC];
static struct alloc_rec allocs[MAXREC];
static struct sync_rec syncs[MAXREC];
static struct kernel_rec kernels[8];
static struct node_rec nodes[2];
static int nlaunches, ncopies, nallocs, nsyncs, nkernels;
static struct {
    uintptr_t exec, stream;
    long count, failures;
    pid_t tid;
} graph_rec;
static int failures; /* anything that did not go as the ground truth says */

#define ADD(array, n, rec)              \
    do {                                \
        pthread_mutex_lock(&rec_lock);  \
        if ((n) < MAXREC) array[(n)++] = (rec); \
        pthread_mutex_unlock(&rec_lock); \
    } while (0)

static void fail(const char *what, int rc) {
    fprintf(stderr, "cuda_app: %s returned %d\n", what, rc);
    __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
}

#define CHECK(call)                          \
    do {                                     \
        int rc_ = (int)(call);               \
        if (rc_ != 0) fail(#call, rc_);      \
    } while (0)

/* ---- host stubs: what nvcc 13 generates for a __global__ function ------------------------
 * The stub's address is the host-side identity of the kernel (__cudaRegisterFunction's
 * hostFun), and nvcc names it after the kernel: the stubs' symbols are the device names. A <<<grid, block, shmem, stream>>> launch pushes the configuration and calls the
 * stub, which pops it, looks the kernel handle up once with __cudaGetKernel and launches it
 * with cudaLaunchKernel. */

#define matmul _Z6matmulPfS_S_i
#define relu _Z4reluPfi
#define reduce_sum_256 _Z9reduceSumILi256EEvPKfPfi

static cudaKernel_t matmul_handle;
static long matmul_failures, get_kernel_calls;

__attribute__((noinline)) static void matmul(float *a, float *b, float *c, int n) {
    void *args[] = {&a, &b, &c, &n};
    if (!matmul_handle) {
        get_kernel_calls++;
        if (rt.__cudaGetKernel(&matmul_handle, (const void *)matmul) != cudaSuccess)
            matmul_failures++;
    }
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    if (rt.__cudaPopCallConfiguration(&grid, &block, &shmem, &stream) != cudaSuccess) {
        matmul_failures++;
        return;
    }
    if (rt.cudaLaunchKernel((const void *)matmul_handle, grid, block, args, shmem, stream) !=
        cudaSuccess)
        matmul_failures++;
}

/* Only their addresses are used (cudaLaunchKernelExC and graph nodes take the stub). */
__attribute__((noinline)) static void relu(float *x, int n) {
    void *args[] = {&x, &n};
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    if (rt.__cudaPopCallConfiguration(&grid, &block, &shmem, &stream) == cudaSuccess)
        rt.cudaLaunchKernel((const void *)relu, grid, block, args, shmem, stream);
}

__attribute__((noinline)) static void reduce_sum_256(const float *in, float *out, int n) {
    void *args[] = {&in, &out, &n};
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    if (rt.__cudaPopCallConfiguration(&grid, &block, &shmem, &stream) == cudaSuccess)
        rt.cudaLaunchKernel((const void *)reduce_sum_256, grid, block, args, shmem, stream);
}

/* ---- the work --------------------------------------------------------------------------- */

static void *d_a, *d_b, *d_c;
static CUdeviceptr d_t;
static size_t size_a;
static const size_t size_b = 65536, size_c = 12345, size_t_ = 8192, worker_bytes = 256;
static CUmodule triton_module;
static CUfunction f_add, f_softmax;
static void **fatbin_handle;
static int data_ok = 1;

static const void *driver_handle_of(const void *stub) {
    if (launch_with_kernel) {
        cudaKernel_t k = NULL;
        CHECK(rt.cudaGetKernel(&k, stub));
        return k;
    }
    cudaFunction_t f = NULL;
    CHECK(rt.cudaGetFuncBySymbol(&f, stub));
    return f;
}

static void *worker(void *arg) {
    (void)arg;
    worker_tid = gettid_();
    long n2 = param("n2");
    float *x = d_b;
    int n = 1024;
    void *args[] = {&x, &n};
    cudaLaunchConfig_t cfg = {{16, 1, 1}, {256, 1, 1}, 512, S2, NULL, 0};
    long bad = 0;
    for (long i = 0; i < n2; i++)
        if (rt.cudaLaunchKernelExC(&cfg, (const void *)relu, args) != cudaSuccess) bad++;
    struct launch_rec r = {"runtime", "cudaLaunchKernelExC", NAME_RELU, "cuLaunchKernel",
                           (uintptr_t)relu, 0, cfg.gridDim, cfg.blockDim, cfg.dynamicSmemBytes,
                           (uintptr_t)S2, (uintptr_t)S2, 0, worker_tid, n2, bad, 0};
    ADD(launches, nlaunches, r);
    if (bad) fail("cudaLaunchKernelExC", (int)bad);

    unsigned char in[256], out[256];
    for (size_t i = 0; i < sizeof in; i++) in[i] = (unsigned char)(0x5a ^ i);
    bad = 0;
    for (int i = 0; i < 2; i++)
        if (rt.cudaMemcpyAsync(d_b, in, worker_bytes, cudaMemcpyHostToDevice, S2)) bad++;
    struct copy_rec c1 = {"runtime", "cudaMemcpyAsync", "cuMemcpyHtoDAsync_v2", "HtoD",
                          worker_bytes, (uintptr_t)S2, 1, worker_tid, 2, bad};
    ADD(copies, ncopies, c1);
    bad = rt.cudaMemcpyAsync(out, d_b, worker_bytes, cudaMemcpyDeviceToHost, S2) != cudaSuccess;
    struct copy_rec c2 = {"runtime", "cudaMemcpyAsync", "cuMemcpyDtoHAsync_v2", "DtoH",
                          worker_bytes, (uintptr_t)S2, 1, worker_tid, 1, bad};
    ADD(copies, ncopies, c2);
    bad = rt.cudaStreamSynchronize(S2) != cudaSuccess;
    struct sync_rec s = {"cudaStreamSynchronize", "cuStreamSynchronize", (uintptr_t)S2, 1,
                         worker_tid, 1, bad};
    ADD(syncs, nsyncs, s);
    if (memcmp(in, out, sizeof in) != 0) __atomic_store_n(&data_ok, 0, __ATOMIC_RELAXED);
    return NULL;
}

static void record_alloc(const char *layer, const char *api, const char *dapi, const char *fapi,
                         const char *fdapi, size_t bytes, uintptr_t ptr, int rc) {
    struct alloc_rec a = {layer, api, dapi, fapi, fdapi, bytes, ptr, main_tid, rc != 0};
    ADD(allocs, nallocs, a);
    if (rc) fail(api, rc);
}

/* Holds CUPTI's subscriber slot for the process's life, as a profiler would. */
static void subscribe_cupti(void) {
    void *h = dlopen("libcupti.so.13", RTLD_NOW | RTLD_GLOBAL);
    CUptiResult (*sub)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *) =
        h ? (CUptiResult(*)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *))dlsym(h, "cuptiSubscribe")
          : NULL;
    static CUpti_SubscriberHandle held;
    if (!sub || sub(&held, NULL, NULL) != CUPTI_SUCCESS) fail("cuptiSubscribe", -1);
}

/* Prints what the fake CUPTI holds now (see the usage above). */
static void print_cupti_state(void) {
    void *h = dlopen("libcupti.so.13", RTLD_NOW | RTLD_NOLOAD);
    fake_cupti_state_fn state = h ? (fake_cupti_state_fn)dlsym(h, "fake_cupti_state") : NULL;
    if (!state) {
        printf("null\n");
    } else {
        int subscribed, kind, callbacks;
        state(&subscribed, &kind, &callbacks);
        int (*enabled)(void) = (int (*)(void))dlsym(h, "fake_cupti_callbacks_enabled");
        printf("{\"subscribed\":%d,\"kind\":%d,\"callbacks\":%d,\"api_callbacks\":%d}\n",
               subscribed, kind, callbacks, enabled ? enabled() : -1);
    }
    fflush(stdout);
}

static void run(void) {
    const long n1 = param("n1"), n3 = param("n3"), n4 = param("n4"), n5 = param("n5"),
               n6 = param("n6"), ngraph = param("graph"), k = param("k"), b1 = param("b1"),
               m = param("m"), b2 = param("b2"), nbad = param("bad");
    const char *mode = getenv("FAKE_CUDART_LAUNCH_HANDLE");
    launch_with_kernel = mode && strcmp(mode, "kernel") == 0;

    /* (b) the runtime, and through it the driver, mapped only now */
    void *hrt = must_open(RUNTIME_SONAME);
    resolve_runtime(hrt);
    if (param("hold")) {
        /* The driver too, as the runtime will map it; it stays mapped through our handle. */
        void *hdrv = dlopen(DRIVER_SONAME, RTLD_NOW | RTLD_GLOBAL);
        if (!hdrv) {
            fprintf(stderr, "cuda_app: %s\n", dlerror());
            exit(3);
        }
        if (param("init")) {
            CUresult (*init)(unsigned int) = (CUresult(*)(unsigned int))dlsym(hdrv, "cuInit");
            if (!init || init(0) != CUDA_SUCCESS) fail("cuInit", -1);
            if (param("subscribe")) subscribe_cupti();
        }
        printf("loaded\n");
        fflush(stdout);
        char cue[64];
        if (!fgets(cue, sizeof cue, stdin)) cue[0] = 0;
    }

    /* (c) what nvcc's static constructors do: register the fatbin and its kernels */
    fatbin_handle = rt.__cudaRegisterFatBinary((void *)&fatbin_wrapper);
    if (!fatbin_handle) fail("__cudaRegisterFatBinary", -1);
    rt.__cudaRegisterFunction(fatbin_handle, (const char *)matmul, (char *)NAME_MATMUL,
                              NAME_MATMUL, -1, NULL, NULL, NULL, NULL, NULL);
    rt.__cudaRegisterFunction(fatbin_handle, (const char *)relu, (char *)NAME_RELU, NAME_RELU,
                              -1, NULL, NULL, NULL, NULL, NULL);
    rt.__cudaRegisterFunction(fatbin_handle, (const char *)reduce_sum_256, (char *)NAME_REDUCE,
                              NAME_REDUCE, -1, NULL, NULL, NULL, NULL, NULL);
    rt.__cudaRegisterFatBinaryEnd(fatbin_handle);

    if (param("warm")) {
        /* The stub's first launch would fetch the handle; a tracer attaching after that sees
         * neither the registrations nor this. */
        get_kernel_calls++;
        if (rt.__cudaGetKernel(&matmul_handle, (const void *)matmul) != cudaSuccess)
            matmul_failures++;
        printf("registered\n");
        fflush(stdout);
        char cue[64];
        if (!fgets(cue, sizeof cue, stdin)) cue[0] = 0;
    }

    CHECK(rt.cudaFree(NULL)); /* creates the context: the runtime loads libcuda here */
    void *hcu = dlopen(DRIVER_SONAME, RTLD_NOW | RTLD_NOLOAD);
    if (!hcu) {
        fprintf(stderr, "cuda_app: %s was not loaded by %s\n", DRIVER_SONAME, RUNTIME_SONAME);
        exit(3);
    }
    resolve_driver(hcu);

    CHECK(rt.cudaStreamCreate(&S1));
    CHECK(rt.cudaStreamCreate(&S2));

    size_a = 1 << 20;
    if ((size_t)b1 > size_a) size_a = (size_t)b1;
    if ((size_t)b2 > size_a) size_a = (size_t)b2;
    int rc = rt.cudaMalloc(&d_a, size_a);
    record_alloc("runtime", "cudaMalloc", "cuMemAlloc_v2", "cudaFree", "cuMemFree_v2", size_a,
                 (uintptr_t)d_a, rc);
    rc = rt.cudaMalloc(&d_b, size_b);
    record_alloc("runtime", "cudaMalloc", "cuMemAlloc_v2", "cudaFree", "cuMemFree_v2", size_b,
                 (uintptr_t)d_b, rc);
    rc = rt.cudaMalloc(&d_c, size_c);
    record_alloc("runtime", "cudaMalloc", "cuMemAlloc_v2", "cudaFree", "cuMemFree_v2", size_c,
                 (uintptr_t)d_c, rc);
    rc = cu.cuMemAlloc_v2(&d_t, size_t_);
    record_alloc("driver", "cuMemAlloc_v2", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemFree_v2",
                 size_t_, (uintptr_t)d_t, rc);

    /* a Triton-style module, straight through the driver */
    CHECK(cu.cuModuleLoadData(&triton_module, triton_ptx));
    CHECK(cu.cuModuleGetFunction(&f_add, triton_module, NAME_TRITON_ADD));
    CHECK(cu.cuModuleGetFunction(&f_softmax, triton_module, NAME_TRITON_SOFTMAX));

    /* the second thread: cudaLaunchKernelExC and async copies on S2 */
    pthread_t thread;
    if (pthread_create(&thread, NULL, worker, NULL) != 0) {
        fprintf(stderr, "cuda_app: pthread_create failed\n");
        exit(3);
    }

    /* (d) launches */
    float *fa = d_a, *fb = d_b, *fc = d_c;
    dim3 g1 = {4, 2, 1}, bl1 = {128, 1, 1};
    for (long i = 0; i < n1; i++) {
        if (rt.__cudaPushCallConfiguration(g1, bl1, 0, S1) != 0) matmul_failures++;
        matmul(fa, fb, fc, 256); /* matmul<<<dim3(4, 2), 128, 0, S1>>>(a, b, c, 256) */
    }
    struct launch_rec l1 = {"runtime", "cudaLaunchKernel", NAME_MATMUL, "cuLaunchKernel",
                            (uintptr_t)matmul_handle, 0, g1, bl1, 0, (uintptr_t)S1,
                            (uintptr_t)S1, 0, main_tid, n1, matmul_failures, 0};
    ADD(launches, nlaunches, l1);
    if (matmul_failures) fail("matmul launches", (int)matmul_failures);

    int n = 4096;
    void *rargs[] = {&fa, &fb, &n};
    dim3 g5 = {32, 1, 1}, bl5 = {256, 1, 1};
    long bad = 0;
    for (long i = 0; i < n5; i++)
        if (rt.cudaLaunchKernel_ptsz((const void *)reduce_sum_256, g5, bl5, rargs, 2048, NULL))
            bad++;
    struct launch_rec l5 = {"runtime", "cudaLaunchKernel_ptsz", NAME_REDUCE, "cuLaunchKernel",
                            (uintptr_t)reduce_sum_256, 0, g5, bl5, 2048, 0, 2, 0, main_tid, n5,
                            bad, 0};
    ADD(launches, nlaunches, l5);
    if (bad) fail("cudaLaunchKernel_ptsz", (int)bad);

    cudaLaunchAttribute prio = {.id = cudaLaunchAttributePriority};
    prio.val.priority = 1;
    cudaLaunchConfig_t cfg6 = {{8, 1, 1}, {1024, 1, 1}, 4096, NULL, &prio, 1};
    bad = 0;
    for (long i = 0; i < n6; i++)
        if (rt.cudaLaunchKernelExC_ptsz(&cfg6, (const void *)reduce_sum_256, rargs)) bad++;
    struct launch_rec l6 = {"runtime", "cudaLaunchKernelExC_ptsz", NAME_REDUCE,
                            "cuLaunchKernelEx", (uintptr_t)reduce_sum_256, 0, cfg6.gridDim,
                            cfg6.blockDim, 4096, 0, 2, 1, main_tid, n6, bad, 0};
    ADD(launches, nlaunches, l6);
    if (bad) fail("cudaLaunchKernelExC_ptsz", (int)bad);

    unsigned xnumel = 1 << 16;
    void *targs[] = {&d_t, &d_t, &xnumel};
    bad = 0;
    for (long i = 0; i < n3; i++)
        if (cu.cuLaunchKernel(f_add, 8, 4, 2, 32, 4, 1, 1024, (CUstream)S1, targs, NULL)) bad++;
    struct launch_rec l3 = {"driver", "cuLaunchKernel", NAME_TRITON_ADD, "cuLaunchKernel",
                            (uintptr_t)f_add, (uintptr_t)f_add, {8, 4, 2}, {32, 4, 1}, 1024,
                            (uintptr_t)S1, (uintptr_t)S1, 0, main_tid, n3, bad, 0};
    ADD(launches, nlaunches, l3);
    if (bad) fail("cuLaunchKernel", (int)bad);

    CUlaunchConfig cfg4 = {128, 1, 1, 64, 2, 1, 8192, (CUstream)S2, NULL, 0};
    bad = 0;
    for (long i = 0; i < n4; i++)
        if (cu.cuLaunchKernelEx(&cfg4, f_softmax, targs, NULL)) bad++;
    struct launch_rec l4 = {"driver", "cuLaunchKernelEx", NAME_TRITON_SOFTMAX,
                            "cuLaunchKernelEx", (uintptr_t)f_softmax, (uintptr_t)f_softmax,
                            {128, 1, 1}, {64, 2, 1}, 8192, (uintptr_t)S2, (uintptr_t)S2, 0,
                            main_tid, n4, bad, 0};
    ADD(launches, nlaunches, l4);
    if (bad) fail("cuLaunchKernelEx", (int)bad);

    /* (e) copies: k x b1 bytes in, m x b2 bytes out, and the round trip checked */
    size_t hbytes = (size_t)(b1 > b2 ? b1 : b2);
    unsigned char *hin = malloc(hbytes), *hout = malloc(hbytes);
    if (!hin || !hout) exit(3);
    bad = 0;
    for (long i = 0; i < k; i++) {
        for (long j = 0; j < b1; j++) hin[j] = (unsigned char)(i * 7 + j);
        if (rt.cudaMemcpy(d_a, hin, (size_t)b1, cudaMemcpyHostToDevice)) bad++;
    }
    struct copy_rec c1 = {"runtime", "cudaMemcpy", "cuMemcpyHtoD_v2", "HtoD", (size_t)b1, 0, 0,
                          main_tid, k, bad};
    ADD(copies, ncopies, c1);
    if (bad) fail("cudaMemcpy HtoD", (int)bad);
    bad = 0;
    for (long i = 0; i < m; i++) {
        memset(hout, 0, hbytes);
        if (rt.cudaMemcpy(hout, d_a, (size_t)b2, cudaMemcpyDeviceToHost)) bad++;
    }
    struct copy_rec c2 = {"runtime", "cudaMemcpy", "cuMemcpyDtoH_v2", "DtoH", (size_t)b2, 0, 0,
                          main_tid, m, bad};
    ADD(copies, ncopies, c2);
    if (bad) fail("cudaMemcpy DtoH", (int)bad);
    if (k > 0 && m > 0 && memcmp(hin, hout, (size_t)(b1 < b2 ? b1 : b2)) != 0)
        __atomic_store_n(&data_ok, 0, __ATOMIC_RELAXED);

    unsigned char tin[8192], tout[8192];
    for (size_t i = 0; i < sizeof tin; i++) tin[i] = (unsigned char)(i * 13);
    rc = cu.cuMemcpyHtoD_v2(d_t, tin, sizeof tin);
    struct copy_rec c3 = {"driver", "cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2", "HtoD", sizeof tin, 0,
                          0, main_tid, 1, rc != 0};
    ADD(copies, ncopies, c3);
    rc = cu.cuMemcpyDtoH_v2(tout, d_t, sizeof tout);
    struct copy_rec c4 = {"driver", "cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2", "DtoH", sizeof tout, 0,
                          0, main_tid, 1, rc != 0};
    ADD(copies, ncopies, c4);
    if (memcmp(tin, tout, sizeof tin) != 0) __atomic_store_n(&data_ok, 0, __ATOMIC_RELAXED);
    free(hin);
    free(hout);

    pthread_join(thread, NULL);

    /* a graph of two kernel nodes (matmul, then relu), launched on S1 */
    cudaGraph_t graph;
    cudaGraphNode_t n_mm, n_relu;
    cudaGraphExec_t exec;
    int nn = 256;
    void *margs[] = {&fa, &fb, &fc, &nn};
    void *largs[] = {&fb, &nn};
    struct cudaKernelNodeParams p_mm = {(void *)matmul, {2, 2, 1}, {64, 1, 1}, 0, margs, NULL};
    struct cudaKernelNodeParams p_relu = {(void *)relu, {1, 1, 1}, {32, 1, 1}, 128, largs, NULL};
    CHECK(rt.cudaGraphCreate(&graph, 0));
    CHECK(rt.cudaGraphAddKernelNode(&n_mm, graph, NULL, 0, &p_mm));
    CHECK(rt.cudaGraphAddKernelNode(&n_relu, graph, &n_mm, 1, &p_relu));
    CHECK(rt.cudaGraphInstantiate(&exec, graph, 0));
    bad = 0;
    for (long i = 0; i < ngraph; i++)
        if (rt.cudaGraphLaunch(exec, S1)) bad++;
    graph_rec.exec = (uintptr_t)exec;
    graph_rec.stream = (uintptr_t)S1;
    graph_rec.count = ngraph;
    graph_rec.failures = bad;
    graph_rec.tid = main_tid;
    if (bad) fail("cudaGraphLaunch", (int)bad);
    nodes[0] = (struct node_rec){NAME_MATMUL, p_mm.gridDim, p_mm.blockDim, p_mm.sharedMemBytes,
                                 (uintptr_t)driver_handle_of((const void *)matmul)};
    nodes[1] = (struct node_rec){NAME_RELU, p_relu.gridDim, p_relu.blockDim,
                                 p_relu.sharedMemBytes,
                                 (uintptr_t)driver_handle_of((const void *)relu)};

    /* launches of a handle nobody loaded: refused */
    long refused_rt = 0, refused_cu = 0;
    int rt_bad_rc = 0, cu_bad_rc = 0;
    for (long i = 0; i < nbad; i++) {
        rt_bad_rc = rt.cudaLaunchKernel((const void *)(uintptr_t)0xdead0000, g1, bl1, NULL, 0, S1);
        refused_rt += rt_bad_rc == cudaErrorInvalidDeviceFunction;
        cu_bad_rc = cu.cuLaunchKernel((CUfunction)(uintptr_t)0xbad0000, 1, 1, 1, 1, 1, 1, 0,
                                      (CUstream)S1, NULL, NULL);
        refused_cu += cu_bad_rc == CUDA_ERROR_INVALID_HANDLE;
    }
    if (nbad) {
        struct launch_rec lb1 = {"runtime", "cudaLaunchKernel", NULL, NULL, 0xdead0000, 0, g1,
                                 bl1, 0, (uintptr_t)S1, 0, 0, main_tid, nbad, nbad,
                                 cudaErrorInvalidDeviceFunction};
        struct launch_rec lb2 = {"driver", "cuLaunchKernel", NULL, "cuLaunchKernel", 0xbad0000,
                                 0xbad0000, {1, 1, 1}, {1, 1, 1}, 0, (uintptr_t)S1,
                                 (uintptr_t)S1, 0, main_tid, nbad, nbad,
                                 CUDA_ERROR_INVALID_HANDLE};
        ADD(launches, nlaunches, lb1);
        ADD(launches, nlaunches, lb2);
    }
    if (refused_rt != nbad) fail("cudaLaunchKernel of an unknown function", rt_bad_rc);
    if (refused_cu != nbad) fail("cuLaunchKernel of an unknown handle", cu_bad_rc);

    /* synchronizations */
    rc = rt.cudaStreamSynchronize(S1);
    struct sync_rec s1 = {"cudaStreamSynchronize", "cuStreamSynchronize", (uintptr_t)S1, 1,
                          main_tid, 1, rc != 0};
    ADD(syncs, nsyncs, s1);
    rc = rt.cudaDeviceSynchronize();
    struct sync_rec s2 = {"cudaDeviceSynchronize", "cuCtxSynchronize", 0, 0, main_tid, 1, rc != 0};
    ADD(syncs, nsyncs, s2);

    /* frees */
    CHECK(rt.cudaFree(d_a));
    CHECK(rt.cudaFree(d_b));
    CHECK(rt.cudaFree(d_c));
    CHECK(cu.cuMemFree_v2(d_t));

    /* the kernels, as the handles the libraries returned */
    struct {
        const char *name;
        const void *stub;
    } stubs[] = {{NAME_MATMUL, (const void *)matmul},
                 {NAME_RELU, (const void *)relu},
                 {NAME_REDUCE, (const void *)reduce_sum_256}};
    for (size_t i = 0; i < 3; i++) {
        cudaKernel_t kh = NULL;
        cudaFunction_t fh = NULL;
        const char *name = NULL;
        CHECK(rt.cudaGetKernel(&kh, stubs[i].stub));
        if (!launch_with_kernel) CHECK(rt.cudaGetFuncBySymbol(&fh, stubs[i].stub));
        CHECK(rt.cudaFuncGetName(&name, stubs[i].stub));
        if (!name || strcmp(name, stubs[i].name) != 0) fail("cudaFuncGetName", -1);
        kernels[nkernels++] = (struct kernel_rec){
            stubs[i].name, "fatbin", (uintptr_t)stubs[i].stub, (uintptr_t)kh, (uintptr_t)fh, 0,
            launch_with_kernel ? (uintptr_t)kh : (uintptr_t)fh};
    }
    if (n1 > 0 && (uintptr_t)matmul_handle != kernels[0].kernel)
        fail("__cudaGetKernel and cudaGetKernel disagree", -1);
    CUfunction mf[] = {f_add, f_softmax};
    const char *mn[] = {NAME_TRITON_ADD, NAME_TRITON_SOFTMAX};
    for (size_t i = 0; i < 2; i++) {
        const char *name = NULL;
        CHECK(cu.cuFuncGetName(&name, mf[i]));
        if (!name || strcmp(name, mn[i]) != 0) fail("cuFuncGetName", -1);
        kernels[nkernels++] = (struct kernel_rec){mn[i], "module", 0, 0, (uintptr_t)mf[i],
                                                  (uintptr_t)triton_module, (uintptr_t)mf[i]};
    }
    for (int i = 0; i < nlaunches; i++)
        for (int j = 0; j < nkernels; j++)
            if (launches[i].layer[0] == 'r' && launches[i].kernel &&
                strcmp(launches[i].kernel, kernels[j].name) == 0)
                launches[i].driver_handle = kernels[j].driver_handle;

    CHECK(rt.cudaGraphExecDestroy(exec));
    CHECK(rt.cudaGraphDestroy(graph));
    CHECK(rt.cudaStreamDestroy(S1));
    CHECK(rt.cudaStreamDestroy(S2));
}

/* ---- the ground truth, as one line of JSON ---------------------------------------------- */

struct tally {
    const char *name;
    unsigned long long n;
};
#define MAXTALLY 48

static void tally_add(struct tally *t, const char *name, unsigned long long n) {
    int i;
    for (i = 0; i < MAXTALLY && t[i].name; i++)
        if (strcmp(t[i].name, name) == 0) break;
    if (i == MAXTALLY) abort();
    t[i].name = name;
    t[i].n += n;
}

static unsigned long long tally_get(const struct tally *t, const char *name) {
    for (int i = 0; i < MAXTALLY && t[i].name; i++)
        if (strcmp(t[i].name, name) == 0) return t[i].n;
    return 0;
}

static void put_str(FILE *f, const char *s) {
    if (!s) {
        fputs("null", f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fprintf(f, "\\%c", *s);
        else if ((unsigned char)*s < 0x20)
            fprintf(f, "\\u%04x", *s);
        else
            fputc(*s, f);
    }
    fputc('"', f);
}

static void put_dim(FILE *f, dim3 d) {
    fprintf(f, "[%u,%u,%u]", d.x, d.y, d.z);
}

static void put_tally(FILE *f, const struct tally *t) {
    fputc('{', f);
    for (int i = 0; i < MAXTALLY && t[i].name; i++) {
        if (i) fputc(',', f);
        put_str(f, t[i].name);
        fprintf(f, ":%llu", t[i].n);
    }
    fputc('}', f);
}

static const char *thread_name(pid_t tid) {
    return tid == main_tid ? "main" : tid == worker_tid ? "worker" : "?";
}

static void put_thread(FILE *f, pid_t tid) {
    fputs("\"thread\":", f);
    put_str(f, thread_name(tid));
    fprintf(f, ",\"tid\":%d", (int)tid);
}

static void put_stream(FILE *f, const char *key, uintptr_t s) {
    fprintf(f, ",\"%s\":%" PRIuPTR ",\"%s_name\":", key, s, key);
    put_str(f, stream_name(s));
}

static int print_ground_truth(int runtime_before, int driver_before) {
    struct tally rt_calls[MAXTALLY] = {{0}}, drv_calls[MAXTALLY] = {{0}};
    struct tally by_kernel[MAXTALLY] = {{0}}, bytes[MAXTALLY] = {{0}}, ncopy[MAXTALLY] = {{0}};
    unsigned long long alloc_bytes = 0, launch_calls = 0, launch_ok = 0, ex_calls = 0, ex_ok = 0;

    /* runtime calls the records below do not list */
    tally_add(rt_calls, "__cudaRegisterFunction", 3);
    tally_add(rt_calls, "__cudaGetKernel", (unsigned long long)get_kernel_calls);
    tally_add(rt_calls, "cudaFree", 1); /* cudaFree(NULL), which creates the context */
    /* driver calls the runtime makes to load and name its kernels */
    tally_add(drv_calls, "cuModuleLoadData", 1);
    tally_add(drv_calls, "cuModuleGetFunction", 2);
    tally_add(drv_calls, "cuLibraryLoadData", 1);
    tally_add(drv_calls, "cuLibraryGetKernel", 3);
    tally_add(drv_calls, "cuKernelGetFunction", launch_with_kernel ? 0 : 3);

    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) exit(3);
    fprintf(f, "{\"format\":\"tracer-fake-cuda/1\",\"pid\":%d", (int)getpid());
    fprintf(f, ",\"threads\":{\"main\":%d,\"worker\":%d}", (int)main_tid, (int)worker_tid);
    fprintf(f, ",\"libraries\":{\"runtime\":\"%s\",\"driver\":\"%s\","
               "\"mapped_before_cue\":{\"runtime\":%s,\"driver\":%s}}",
            RUNTIME_SONAME, DRIVER_SONAME, runtime_before ? "true" : "false",
            driver_before ? "true" : "false");
    fprintf(f, ",\"launch_handle_mode\":\"%s\"", launch_with_kernel ? "kernel" : "function");
    fputs(",\"params\":{", f);
    for (size_t i = 0; i < NPARAMS; i++)
        fprintf(f, "%s\"%s\":%ld", i ? "," : "", params[i].key, params[i].value);
    fprintf(f, "},\"streams\":{\"S1\":%" PRIuPTR ",\"S2\":%" PRIuPTR
               ",\"default\":0,\"legacy\":1,\"per_thread\":2}",
            (uintptr_t)S1, (uintptr_t)S2);

    fputs(",\"kernels\":[", f);
    for (int i = 0; i < nkernels; i++) {
        const struct kernel_rec *k = &kernels[i];
        fputs(i ? ",{\"name\":" : "{\"name\":", f);
        put_str(f, k->name);
        fputs(",\"source\":", f);
        put_str(f, k->source);
        fprintf(f, ",\"host_stub\":%" PRIuPTR ",\"kernel\":%" PRIuPTR ",\"function\":%" PRIuPTR
                   ",\"module\":%" PRIuPTR ",\"driver_handle\":%" PRIuPTR "}",
                k->host_stub, k->kernel, k->function, k->module, k->driver_handle);
    }

    fputs("],\"launches\":[", f);
    for (int i = 0; i < nlaunches; i++) {
        const struct launch_rec *l = &launches[i];
        fputs(i ? ",{\"layer\":" : "{\"layer\":", f);
        put_str(f, l->layer);
        fputs(",\"api\":", f);
        put_str(f, l->api);
        fputs(",\"kernel\":", f);
        put_str(f, l->kernel);
        fprintf(f, ",\"func_arg\":%" PRIuPTR ",\"grid\":", l->func_arg);
        put_dim(f, l->grid);
        fputs(",\"block\":", f);
        put_dim(f, l->block);
        fprintf(f, ",\"shmem\":%llu", l->shmem);
        put_stream(f, "stream", l->stream);
        fprintf(f, ",\"num_attrs\":%u,", l->num_attrs);
        put_thread(f, l->tid);
        fprintf(f, ",\"count\":%ld,\"result\":%d,\"driver_api\":", l->count, l->result);
        put_str(f, l->driver_api);
        if (l->driver_api) {
            fprintf(f, ",\"driver_handle\":%" PRIuPTR, l->driver_handle);
            put_stream(f, "driver_stream", l->driver_stream);
        }
        fputc('}', f);
        long ok = l->result == 0 ? l->count - l->failures : 0;
        if (l->failures && l->result == 0) __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
        if (strcmp(l->layer, "runtime") == 0)
            tally_add(rt_calls, l->api, (unsigned long long)l->count);
        if (l->driver_api) {
            tally_add(drv_calls, l->driver_api, (unsigned long long)l->count);
            if (strcmp(l->driver_api, "cuLaunchKernel") == 0) {
                launch_calls += (unsigned long long)l->count;
                launch_ok += (unsigned long long)ok;
            } else {
                ex_calls += (unsigned long long)l->count;
                ex_ok += (unsigned long long)ok;
            }
        }
        if (l->kernel && ok) tally_add(by_kernel, l->kernel, (unsigned long long)ok);
    }

    fprintf(f, "],\"graph_launches\":[{\"layer\":\"runtime\",\"api\":\"cudaGraphLaunch\","
               "\"graph_exec\":%" PRIuPTR,
            graph_rec.exec);
    put_stream(f, "stream", graph_rec.stream);
    fputc(',', f);
    put_thread(f, graph_rec.tid);
    fprintf(f, ",\"count\":%ld,\"result\":0,\"driver_api\":\"cuGraphLaunch\"", graph_rec.count);
    put_stream(f, "driver_stream", graph_rec.stream);
    fputs(",\"nodes\":[", f);
    for (int i = 0; i < 2; i++) {
        fputs(i ? ",{\"kernel\":" : "{\"kernel\":", f);
        put_str(f, nodes[i].kernel);
        fputs(",\"grid\":", f);
        put_dim(f, nodes[i].grid);
        fputs(",\"block\":", f);
        put_dim(f, nodes[i].block);
        fprintf(f, ",\"shmem\":%u,\"driver_handle\":%" PRIuPTR "}", nodes[i].shmem,
                nodes[i].driver_handle);
        tally_add(by_kernel, nodes[i].kernel,
                  (unsigned long long)(graph_rec.count - graph_rec.failures));
    }
    fputs("]}]", f);
    tally_add(rt_calls, "cudaGraphLaunch", (unsigned long long)graph_rec.count);
    tally_add(drv_calls, "cuGraphLaunch", (unsigned long long)graph_rec.count);

    fputs(",\"memcpys\":[", f);
    for (int i = 0; i < ncopies; i++) {
        const struct copy_rec *c = &copies[i];
        fputs(i ? ",{\"layer\":" : "{\"layer\":", f);
        put_str(f, c->layer);
        fputs(",\"api\":", f);
        put_str(f, c->api);
        fputs(",\"driver_api\":", f);
        put_str(f, c->driver_api);
        fputs(",\"direction\":", f);
        put_str(f, c->direction);
        fprintf(f, ",\"bytes\":%llu,\"count\":%ld,\"async\":%s", c->bytes, c->count,
                c->async ? "true" : "false");
        if (c->async) put_stream(f, "stream", c->stream);
        fputc(',', f);
        put_thread(f, c->tid);
        fputc('}', f);
        if (c->failures) __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
        if (strcmp(c->layer, "runtime") == 0)
            tally_add(rt_calls, c->api, (unsigned long long)c->count);
        tally_add(drv_calls, c->driver_api, (unsigned long long)c->count);
        tally_add(bytes, c->direction, c->bytes * (unsigned long long)c->count);
        tally_add(ncopy, c->direction, (unsigned long long)c->count);
    }

    fputs("],\"allocations\":[", f);
    for (int i = 0; i < nallocs; i++) {
        const struct alloc_rec *a = &allocs[i];
        fputs(i ? ",{\"layer\":" : "{\"layer\":", f);
        put_str(f, a->layer);
        fputs(",\"api\":", f);
        put_str(f, a->api);
        fputs(",\"driver_api\":", f);
        put_str(f, a->driver_api);
        fprintf(f, ",\"bytes\":%llu,\"ptr\":%" PRIuPTR ",\"free_api\":", a->bytes, a->ptr);
        put_str(f, a->free_api);
        fputs(",\"free_driver_api\":", f);
        put_str(f, a->free_driver_api);
        fputc(',', f);
        put_thread(f, a->tid);
        fputc('}', f);
        alloc_bytes += a->bytes;
        if (strcmp(a->layer, "runtime") == 0) {
            tally_add(rt_calls, a->api, 1);
            tally_add(rt_calls, a->free_api, 1);
        }
        tally_add(drv_calls, a->driver_api, 1);
        tally_add(drv_calls, a->free_driver_api, 1);
    }

    fputs("],\"syncs\":[", f);
    for (int i = 0; i < nsyncs; i++) {
        const struct sync_rec *s = &syncs[i];
        fputs(i ? ",{\"api\":" : "{\"api\":", f);
        put_str(f, s->api);
        fputs(",\"driver_api\":", f);
        put_str(f, s->driver_api);
        if (s->has_stream) put_stream(f, "stream", s->stream);
        fprintf(f, ",\"count\":%ld,", s->count);
        put_thread(f, s->tid);
        fputc('}', f);
        if (s->failures) __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
        tally_add(rt_calls, s->api, (unsigned long long)s->count);
        tally_add(drv_calls, s->driver_api, (unsigned long long)s->count);
    }

    fputs("],\"totals\":{\"runtime_calls\":", f);
    put_tally(f, rt_calls);
    fputs(",\"driver_calls\":", f);
    put_tally(f, drv_calls);
    fputs(",\"kernel_launches\":", f);
    put_tally(f, by_kernel);
    fputs(",\"memcpy_bytes\":", f);
    put_tally(f, bytes);
    fputs(",\"memcpy_count\":", f);
    put_tally(f, ncopy);
    fprintf(f, ",\"alloc_count\":%d,\"alloc_bytes\":%llu,\"free_count\":%d}", nallocs,
            alloc_bytes, nallocs);

    /* what the fake driver counted, against what the records say it should have */
    int counts_ok = 1;
    if (driver_stats) {
        const struct fake_cuda_stats *d = driver_stats;
        unsigned long long htod_calls = tally_get(ncopy, "HtoD"),
                           dtoh_calls = tally_get(ncopy, "DtoH");
        struct {
            const char *name;
            unsigned long long seen, expected;
        } cmp[] = {
            {"cuLaunchKernel_calls", d->cuLaunchKernel_calls, launch_calls},
            {"cuLaunchKernel_ok", d->cuLaunchKernel_ok, launch_ok},
            {"cuLaunchKernelEx_calls", d->cuLaunchKernelEx_calls, ex_calls},
            {"cuLaunchKernelEx_ok", d->cuLaunchKernelEx_ok, ex_ok},
            {"cuGraphLaunch_calls", d->cuGraphLaunch_calls, (unsigned long long)graph_rec.count},
            {"cuGraphLaunch_ok", d->cuGraphLaunch_ok,
             (unsigned long long)(graph_rec.count - graph_rec.failures)},
            {"graph_kernel_nodes_run", d->graph_kernel_nodes_run,
             2ULL * (unsigned long long)(graph_rec.count - graph_rec.failures)},
            {"memcpy_htod_calls", d->memcpy_htod_calls, htod_calls},
            {"memcpy_htod_bytes", d->memcpy_htod_bytes, tally_get(bytes, "HtoD")},
            {"memcpy_dtoh_calls", d->memcpy_dtoh_calls, dtoh_calls},
            {"memcpy_dtoh_bytes", d->memcpy_dtoh_bytes, tally_get(bytes, "DtoH")},
            {"memcpy_dtod_calls", d->memcpy_dtod_calls, 0},
            {"mem_alloc_calls", d->mem_alloc_calls, (unsigned long long)nallocs},
            {"mem_alloc_bytes", d->mem_alloc_bytes, alloc_bytes},
            {"mem_free_calls", d->mem_free_calls, (unsigned long long)nallocs},
            {"module_loads", d->module_loads, tally_get(drv_calls, "cuModuleLoadData")},
            {"library_loads", d->library_loads, tally_get(drv_calls, "cuLibraryLoadData")},
            {"cuModuleGetFunction_calls", d->cuModuleGetFunction_calls,
             tally_get(drv_calls, "cuModuleGetFunction")},
            {"cuLibraryGetKernel_calls", d->cuLibraryGetKernel_calls,
             tally_get(drv_calls, "cuLibraryGetKernel")},
            {"cuKernelGetFunction_calls", d->cuKernelGetFunction_calls,
             tally_get(drv_calls, "cuKernelGetFunction")},
            {"ctx_synchronize_calls", d->ctx_synchronize_calls,
             tally_get(drv_calls, "cuCtxSynchronize")},
            {"stream_synchronize_calls", d->stream_synchronize_calls,
             tally_get(drv_calls, "cuStreamSynchronize")},
        };
        fputs(",\"driver_observed\":{", f);
        for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++) {
            fprintf(f, "%s\"%s\":%llu", i ? "," : "", cmp[i].name, cmp[i].seen);
            if (cmp[i].seen != cmp[i].expected) {
                fprintf(stderr, "cuda_app: the driver counted %s = %llu, expected %llu\n",
                        cmp[i].name, cmp[i].seen, cmp[i].expected);
                counts_ok = 0;
            }
        }
        fputc('}', f);
    } else {
        fputs(",\"driver_observed\":null", f);
    }

    /* what the fake CUPTI recorded (a CUDA_INJECTION64_PATH library turned it on): one record
     * per kernel execution, which must be every launch that ran */
    fake_cupti_tally_fn cupti_tally = NULL;
    void *hcupti = dlopen("libcupti.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (hcupti) cupti_tally = (fake_cupti_tally_fn)dlsym(hcupti, "fake_cupti_tally");
    if (cupti_tally) {
        fputs(",\"cupti_observed\":[", f);
        const char *name;
        unsigned long long runs, ns;
        for (int i = 0; cupti_tally(i, &name, &runs, &ns); i++) {
            fprintf(f, "%s{\"name\":\"%s\",\"executions\":%llu,\"total_ns\":%llu}", i ? "," : "",
                    name, runs, ns);
            if (runs != tally_get(by_kernel, name)) {
                fprintf(stderr, "cuda_app: CUPTI recorded %llu runs of %s, expected %llu\n", runs,
                        name, tally_get(by_kernel, name));
                counts_ok = 0;
            }
        }
        fputc(']', f);
    } else {
        fputs(",\"cupti_observed\":null", f);
    }

    int late = !runtime_before && !driver_before;
    int ok = failures == 0 && data_ok && counts_ok && late;
    fprintf(f, ",\"checks\":{\"calls_succeeded\":%s,\"data_roundtrip\":%s,"
               "\"driver_counts_match\":%s,\"late_loaded\":%s},\"ok\":%s}",
            failures == 0 ? "true" : "false", data_ok ? "true" : "false",
            !driver_stats ? "null" : counts_ok ? "true" : "false", late ? "true" : "false",
            ok ? "true" : "false");
    fclose(f);
    fwrite(buf, 1, len, stdout);
    fputc('\n', stdout);
    free(buf);
    return ok;
}

static int mapped(const char *soname) {
    void *h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (h) dlclose(h);
    return h != NULL;
}

int main(int argc, char **argv) {
    parse_args(argc, argv);
    main_tid = gettid_();
    int runtime_before = mapped(RUNTIME_SONAME), driver_before = mapped(DRIVER_SONAME);

    /* (a) the cue: a tracer attaches between "ready" and the line we wait for */
    printf("ready\n");
    fflush(stdout);
    char line[256];
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;

    run();
    int ok = print_ground_truth(runtime_before, driver_before);
    printf("done\n");
    fflush(stdout);

    while (fgets(line, sizeof line, stdin)) {
        if (strcmp(line, "cupti\n") == 0) print_cupti_state();
    }
    /* what nvcc's atexit handler and a module's owner would do */
    if (triton_module) cu.cuModuleUnload(triton_module);
    if (fatbin_handle) rt.__cudaUnregisterFatBinary(fatbin_handle);
    return ok ? 0 : 1;
}
