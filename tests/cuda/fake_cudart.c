/* A fake CUDA runtime, built as libcudart.so.13: the runtime API entry points tracer probes,
 * with the real prototypes (fake_cuda_abi.h), layered on the driver the way the real runtime
 * is. It is not linked against libcuda: at its first API call it dlopen()s "libcuda.so.1",
 * resolves the driver functions it uses with dlsym, initializes the driver and makes the
 * primary context current in each calling thread. Kernels registered by nvcc-style host code
 * (__cudaRegisterFatBinary / __cudaRegisterFunction) live in a driver library loaded lazily
 * with cuLibraryLoadData; their handles (cudaKernel_t == CUkernel) come from
 * cuLibraryGetKernel, and launches reach the driver's cuLaunchKernel (cuLaunchKernelEx for a
 * cudaLaunchKernelExC with attributes) with the CUfunction from cuKernelGetFunction, or with
 * the CUkernel itself when FAKE_CUDART_LAUNCH_HANDLE=kernel. Exported functions do not call
 * one another, except __cudaLaunchKernel*, which forward to cudaLaunchKernel* as the real
 * runtime's do. */
#define _GNU_SOURCE
#include "fake_cuda_abi.h"
#include "fake_cupti_abi.h"
#include "fake_cupti_client.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define API __attribute__((visibility("default"), noinline))

/* Leaf functions get no frame from -fno-omit-frame-pointer alone; this makes them set one up
 * like the others, so that every exported function starts with push %rbp; mov %rsp,%rbp. */
#define FRAME() __asm__ volatile("" ::"r"(__builtin_frame_address(0)))

#define cudaErrorInvalidConfiguration 9

/* ---- the driver, found at first use ---------------------------------------------------- */

static struct {
#define DRIVER_FN(name) __typeof__(name) *name;
    DRIVER_FN(cuInit)
    DRIVER_FN(cuDriverGetVersion)
    DRIVER_FN(cuDeviceGet)
    DRIVER_FN(cuDeviceGetCount)
    DRIVER_FN(cuDevicePrimaryCtxRetain)
    DRIVER_FN(cuCtxSetCurrent)
    DRIVER_FN(cuCtxSynchronize)
    DRIVER_FN(cuLibraryLoadData)
    DRIVER_FN(cuLibraryUnload)
    DRIVER_FN(cuLibraryGetKernel)
    DRIVER_FN(cuKernelGetFunction)
    DRIVER_FN(cuLaunchKernel)
    DRIVER_FN(cuLaunchKernelEx)
    DRIVER_FN(cuGraphCreate)
    DRIVER_FN(cuGraphAddKernelNode_v2)
    DRIVER_FN(cuGraphInstantiateWithFlags)
    DRIVER_FN(cuGraphLaunch)
    DRIVER_FN(cuGraphExecDestroy)
    DRIVER_FN(cuGraphDestroy)
    DRIVER_FN(cuStreamCreate)
    DRIVER_FN(cuStreamDestroy_v2)
    DRIVER_FN(cuStreamSynchronize)
    DRIVER_FN(cuMemAlloc_v2)
    DRIVER_FN(cuMemFree_v2)
    DRIVER_FN(cuMemcpy)
    DRIVER_FN(cuMemcpyAsync)
    DRIVER_FN(cuMemcpyHtoD_v2)
    DRIVER_FN(cuMemcpyDtoH_v2)
    DRIVER_FN(cuMemcpyDtoD_v2)
    DRIVER_FN(cuMemcpyHtoDAsync_v2)
    DRIVER_FN(cuMemcpyDtoHAsync_v2)
#undef DRIVER_FN
} drv;

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static cudaError_t driver_status;
static CUcontext primary_ctx;
static int launch_with_kernel; /* FAKE_CUDART_LAUNCH_HANDLE=kernel */
static __thread int thread_has_ctx;
static __thread cudaError_t last_error;

/* ---- CUPTI's API callbacks ------------------------------------------------------------- */

/* The fake CUPTI's API callbacks (fake_cupti_client.h), set by it at every change. */
API void fake_cudart_cupti_callbacks(fake_cupti_api_fn dispatch, uint32_t mask) {
    FRAME();
    take_cupti_callbacks(dispatch, mask);
}

static void load_driver(void) {
    pull_cupti_callbacks();
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        driver_status = cudaErrorInsufficientDriver;
        return;
    }
#define RESOLVE(name)                                         \
    if (!(drv.name = (__typeof__(drv.name))dlsym(h, #name))) { \
        driver_status = cudaErrorInsufficientDriver;          \
        return;                                               \
    }
    RESOLVE(cuInit)
    RESOLVE(cuDriverGetVersion)
    RESOLVE(cuDeviceGet)
    RESOLVE(cuDeviceGetCount)
    RESOLVE(cuDevicePrimaryCtxRetain)
    RESOLVE(cuCtxSetCurrent)
    RESOLVE(cuCtxSynchronize)
    RESOLVE(cuLibraryLoadData)
    RESOLVE(cuLibraryUnload)
    RESOLVE(cuLibraryGetKernel)
    RESOLVE(cuKernelGetFunction)
    RESOLVE(cuLaunchKernel)
    RESOLVE(cuLaunchKernelEx)
    RESOLVE(cuGraphCreate)
    RESOLVE(cuGraphAddKernelNode_v2)
    RESOLVE(cuGraphInstantiateWithFlags)
    RESOLVE(cuGraphLaunch)
    RESOLVE(cuGraphExecDestroy)
    RESOLVE(cuGraphDestroy)
    RESOLVE(cuStreamCreate)
    RESOLVE(cuStreamDestroy_v2)
    RESOLVE(cuStreamSynchronize)
    RESOLVE(cuMemAlloc_v2)
    RESOLVE(cuMemFree_v2)
    RESOLVE(cuMemcpy)
    RESOLVE(cuMemcpyAsync)
    RESOLVE(cuMemcpyHtoD_v2)
    RESOLVE(cuMemcpyDtoH_v2)
    RESOLVE(cuMemcpyDtoD_v2)
    RESOLVE(cuMemcpyHtoDAsync_v2)
    RESOLVE(cuMemcpyDtoHAsync_v2)
#undef RESOLVE
    CUdevice dev;
    if (drv.cuInit(0) != CUDA_SUCCESS || drv.cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        drv.cuDevicePrimaryCtxRetain(&primary_ctx, dev) != CUDA_SUCCESS) {
        driver_status = cudaErrorInitializationError;
        return;
    }
    const char *mode = getenv("FAKE_CUDART_LAUNCH_HANDLE");
    launch_with_kernel = mode && strcmp(mode, "kernel") == 0;
}

/* The driver is loaded and the primary context is current in this thread. */
static cudaError_t ready(void) {
    pthread_once(&driver_once, load_driver);
    if (driver_status) return driver_status;
    if (!thread_has_ctx) {
        if (drv.cuCtxSetCurrent(primary_ctx) != CUDA_SUCCESS) return cudaErrorInitializationError;
        thread_has_ctx = 1;
    }
    return cudaSuccess;
}

/* The driver codes the fake driver returns have the same numbers as their runtime
 * counterparts (1, 2, 3, 101, 200, 201, 400, 500). */
static cudaError_t from_driver(CUresult rc) {
    return (cudaError_t)rc;
}

static cudaError_t ret(cudaError_t e) {
    if (e != cudaSuccess) last_error = e;
    return e;
}

#define READY()                            \
    do {                                   \
        cudaError_t ready_rc_ = ready();   \
        if (ready_rc_) return ret(ready_rc_); \
    } while (0)

/* ---- registered kernels ---------------------------------------------------------------- */

struct fatbin {
    const __fatBinC_Wrapper_t *wrapper;
    CUlibrary lib;
};

struct entry {
    struct fatbin *fb;
    const void *host;  /* host stub address */
    char *name;        /* device (mangled) name */
    CUkernel kernel;   /* from cuLibraryGetKernel, on first use */
    CUfunction func;   /* from cuKernelGetFunction, on first use */
    struct entry *next;
};

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct entry *entries;

/* Finds the kernel behind a host stub or a kernel handle and makes sure it is loaded. The
 * driver must be ready. Returns with reg_lock held on success. */
static cudaError_t resolve_locked(const void *func, struct entry **out) {
    pthread_mutex_lock(&reg_lock);
    struct entry *e;
    for (e = entries; e; e = e->next)
        if (e->host == func) break;
    if (!e)
        for (e = entries; e; e = e->next)
            if (e->kernel && (const void *)e->kernel == func) break;
    if (!e) {
        pthread_mutex_unlock(&reg_lock);
        return cudaErrorInvalidDeviceFunction;
    }
    CUresult rc = CUDA_SUCCESS;
    if (!e->fb->lib)
        rc = drv.cuLibraryLoadData(&e->fb->lib, e->fb->wrapper->data, NULL, NULL, 0, NULL, NULL,
                                   0);
    if (rc == CUDA_SUCCESS && !e->kernel)
        rc = drv.cuLibraryGetKernel(&e->kernel, e->fb->lib, e->name);
    if (rc != CUDA_SUCCESS) {
        pthread_mutex_unlock(&reg_lock);
        return rc == CUDA_ERROR_NOT_FOUND ? cudaErrorInvalidDeviceFunction : from_driver(rc);
    }
    *out = e;
    return cudaSuccess;
}

/* What launches hand the driver for a host stub or kernel handle. */
static cudaError_t driver_handle(const void *func, CUfunction *f) {
    struct entry *e;
    cudaError_t err = resolve_locked(func, &e);
    if (err) return err;
    CUresult rc = CUDA_SUCCESS;
    if (launch_with_kernel) {
        *f = (CUfunction)e->kernel;
    } else {
        if (!e->func) rc = drv.cuKernelGetFunction(&e->func, e->kernel);
        *f = e->func;
    }
    pthread_mutex_unlock(&reg_lock);
    return from_driver(rc);
}

API void **__cudaRegisterFatBinary(void *fatCubin) {
    const __fatBinC_Wrapper_t *w = fatCubin;
    if (!w || w->magic != FATBINC_MAGIC || !w->data) return NULL;
    struct fatbin *fb = calloc(1, sizeof *fb);
    if (!fb) return NULL;
    fb->wrapper = w;
    return (void **)fb;
}

API void __cudaRegisterFatBinaryEnd(void **fatCubinHandle) {
    FRAME();
    (void)fatCubinHandle; /* kernels are loaded lazily, at first use */
}

API void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                                const char *deviceName, int thread_limit, uint3 *tid, uint3 *bid,
                                dim3 *bDim, dim3 *gDim, int *wSize) {
    (void)thread_limit, (void)tid, (void)bid, (void)bDim, (void)gDim, (void)wSize;
    const char *name = deviceName ? deviceName : deviceFun;
    if (!fatCubinHandle || !hostFun || !name) return;
    struct entry *e = calloc(1, sizeof *e);
    if (!e) return;
    e->fb = (struct fatbin *)fatCubinHandle;
    e->host = hostFun;
    e->name = strdup(name);
    pthread_mutex_lock(&reg_lock);
    e->next = entries;
    entries = e;
    pthread_mutex_unlock(&reg_lock);
}

API void __cudaUnregisterFatBinary(void **fatCubinHandle) {
    struct fatbin *fb = (struct fatbin *)fatCubinHandle;
    if (!fb) return;
    pthread_mutex_lock(&reg_lock);
    for (struct entry **p = &entries; *p;) {
        struct entry *e = *p;
        if (e->fb == fb) {
            *p = e->next;
            free(e->name);
            free(e);
        } else {
            p = &e->next;
        }
    }
    pthread_mutex_unlock(&reg_lock);
    if (fb->lib && ready() == cudaSuccess) drv.cuLibraryUnload(fb->lib);
    free(fb);
}

static cudaError_t get_kernel(cudaKernel_t *out, const void *hostFun) {
    READY();
    if (!out) return ret(cudaErrorInvalidValue);
    struct entry *e;
    cudaError_t err = resolve_locked(hostFun, &e);
    if (err) return ret(err);
    *out = (cudaKernel_t)e->kernel;
    pthread_mutex_unlock(&reg_lock);
    return cudaSuccess;
}

API cudaError_t __cudaGetKernel(cudaKernel_t *kernelPtr, const void *hostFun) {
    return get_kernel(kernelPtr, hostFun);
}

API cudaError_t cudaGetKernel(cudaKernel_t *kernelPtr, const void *entryFuncAddr) {
    return get_kernel(kernelPtr, entryFuncAddr);
}

API cudaError_t cudaGetFuncBySymbol(cudaFunction_t *functionPtr, const void *symbolPtr) {
    READY();
    if (!functionPtr) return ret(cudaErrorInvalidValue);
    struct entry *e;
    cudaError_t err = resolve_locked(symbolPtr, &e);
    if (err) return ret(err);
    CUresult rc = e->func ? CUDA_SUCCESS : drv.cuKernelGetFunction(&e->func, e->kernel);
    *functionPtr = (cudaFunction_t)e->func;
    pthread_mutex_unlock(&reg_lock);
    return ret(from_driver(rc));
}

API cudaError_t cudaFuncGetName(const char **name, const void *func) {
    if (!name) return ret(cudaErrorInvalidValue);
    pthread_mutex_lock(&reg_lock);
    struct entry *e;
    for (e = entries; e; e = e->next)
        if (e->host == func || (e->kernel && (const void *)e->kernel == func)) break;
    if (e) *name = e->name;
    pthread_mutex_unlock(&reg_lock);
    return e ? cudaSuccess : ret(cudaErrorInvalidDeviceFunction);
}

/* ---- <<<...>>> configuration stack (per thread) ----------------------------------------- */

static __thread struct {
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
} call_cfg[16];
static __thread int ncall_cfg;

API unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, size_t sharedMem,
                                         struct CUstream_st *stream) {
    if (ncall_cfg == 16) return cudaErrorInvalidConfiguration;
    call_cfg[ncall_cfg].grid = gridDim;
    call_cfg[ncall_cfg].block = blockDim;
    call_cfg[ncall_cfg].shmem = sharedMem;
    call_cfg[ncall_cfg].stream = stream;
    ncall_cfg++;
    return 0;
}

API cudaError_t __cudaPopCallConfiguration(dim3 *gridDim, dim3 *blockDim, size_t *sharedMem,
                                           void *stream) {
    if (ncall_cfg == 0) return ret(cudaErrorInvalidConfiguration);
    ncall_cfg--;
    if (gridDim) *gridDim = call_cfg[ncall_cfg].grid;
    if (blockDim) *blockDim = call_cfg[ncall_cfg].block;
    if (sharedMem) *sharedMem = call_cfg[ncall_cfg].shmem;
    if (stream) *(cudaStream_t *)stream = call_cfg[ncall_cfg].stream;
    return cudaSuccess;
}

/* ---- launches --------------------------------------------------------------------------- */

/* The per-thread-default-stream entry points (_ptsz) read a NULL stream as the calling
 * thread's default stream, which the driver spells CU_STREAM_PER_THREAD. */
static CUstream driver_stream(cudaStream_t s, int ptsz) {
    return ptsz && !s ? CU_STREAM_PER_THREAD : (CUstream)s;
}

static cudaError_t launch_traced(const void *func, dim3 g, dim3 b, void **args, size_t shmem,
                                 cudaStream_t s, int ptsz);

/* `traced`: called by launch_traced, between the callbacks. Otherwise a launch whose callback
 * is off costs one atomic load and a branch here. Not inlined: the driver's launch underneath
 * has `launch` for its caller whether callbacks are on or off (tests check the caller). */
static __attribute__((noinline)) cudaError_t launch(const void *func, dim3 g, dim3 b,
                                                   void **args, size_t shmem, cudaStream_t s,
                                                   int ptsz, int traced) {
    if (!traced && CUPTI_CALLBACK_ON(ptsz ? FAKE_CUPTI_LAUNCH_PTSZ_BIT : FAKE_CUPTI_LAUNCH_BIT))
        return launch_traced(func, g, b, args, shmem, s, ptsz);
    READY();
    if (shmem > UINT_MAX) return ret(cudaErrorInvalidValue);
    CUfunction f;
    cudaError_t err = driver_handle(func, &f);
    if (err) return ret(err);
    return ret(from_driver(drv.cuLaunchKernel(f, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)shmem,
                                              driver_stream(s, ptsz), args, NULL)));
}

/* The device name of a registered kernel, by host stub or handle, for a callback (NULL for an
 * unknown one). */
static const char *callback_symbol(const void *func) {
    pthread_mutex_lock(&reg_lock);
    struct entry *e;
    for (e = entries; e; e = e->next)
        if (e->host == func || (e->kernel && (const void *)e->kernel == func)) break;
    const char *name = e ? e->name : NULL;
    pthread_mutex_unlock(&reg_lock);
    return name;
}

/* The context a runtime call's callbacks report: the primary one, current once ready. */
static CUcontext callback_context(void) {
    return ready() == cudaSuccess ? primary_ctx : NULL;
}

/* A launch between its CUPTI callbacks (ENTER, EXIT): a launch the runtime refuses has them
 * too, and the driver's launch underneath has its own in between. (Not `cold`: a part in
 * .text.unlikely splits the file's code, and tracer's symbolizer then names callers here
 * without their lines, which tests check.) */
static __attribute__((noinline)) cudaError_t
launch_traced(const void *func, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s,
              int ptsz) {
    cudaLaunchKernel_v7000_params p = {func, g, b, args, shmem, s};
    struct fake_cupti_api_call c = {
        .domain = CUPTI_CB_DOMAIN_RUNTIME_API,
        .cbid = ptsz ? CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000
                     : CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
        .function_name = ptsz ? "cudaLaunchKernel_ptsz_v7000" : "cudaLaunchKernel_v7000",
        .params = &p,
        .symbol_name = callback_symbol(func),
        .context = callback_context(),
    };
    fake_cupti_api_fn api = __atomic_load_n(&cupti_api, __ATOMIC_ACQUIRE);
    api(&c, CUPTI_API_ENTER, NULL);
    cudaError_t rc = launch(func, g, b, args, shmem, s, ptsz, 1);
    api(&c, CUPTI_API_EXIT, &rc);
    return rc;
}

API cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                 size_t sharedMem, cudaStream_t stream) {
    return launch(func, gridDim, blockDim, args, sharedMem, stream, 0, 0);
}

API cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                      size_t sharedMem, cudaStream_t stream) {
    return launch(func, gridDim, blockDim, args, sharedMem, stream, 1, 0);
}

static cudaError_t launch_ex_traced(const cudaLaunchConfig_t *config, const void *func,
                                    void **args, int ptsz);

static __attribute__((noinline)) cudaError_t launch_ex(const cudaLaunchConfig_t *c,
                                                      const void *func, void **args, int ptsz,
                                                      int traced) {
    if (!traced &&
        CUPTI_CALLBACK_ON(ptsz ? FAKE_CUPTI_LAUNCH_EX_PTSZ_BIT : FAKE_CUPTI_LAUNCH_EX_BIT))
        return launch_ex_traced(c, func, args, ptsz);
    READY();
    if (!c || c->dynamicSmemBytes > UINT_MAX || (c->numAttrs && !c->attrs))
        return ret(cudaErrorInvalidValue);
    CUfunction f;
    cudaError_t err = driver_handle(func, &f);
    if (err) return ret(err);
    CUstream s = driver_stream(c->stream, ptsz);
    if (c->numAttrs == 0)
        return ret(from_driver(drv.cuLaunchKernel(f, c->gridDim.x, c->gridDim.y, c->gridDim.z,
                                                  c->blockDim.x, c->blockDim.y, c->blockDim.z,
                                                  (unsigned)c->dynamicSmemBytes, s, args, NULL)));
    /* cudaLaunchAttribute and CUlaunchAttribute share their layout */
    CUlaunchConfig dc = {
        .gridDimX = c->gridDim.x,
        .gridDimY = c->gridDim.y,
        .gridDimZ = c->gridDim.z,
        .blockDimX = c->blockDim.x,
        .blockDimY = c->blockDim.y,
        .blockDimZ = c->blockDim.z,
        .sharedMemBytes = (unsigned)c->dynamicSmemBytes,
        .hStream = s,
        .attrs = (CUlaunchAttribute *)c->attrs,
        .numAttrs = c->numAttrs,
    };
    return ret(from_driver(drv.cuLaunchKernelEx(&dc, f, args, NULL)));
}

static __attribute__((noinline)) cudaError_t
launch_ex_traced(const cudaLaunchConfig_t *config, const void *func, void **args, int ptsz) {
    cudaLaunchKernelExC_v11060_params p = {config, func, args};
    struct fake_cupti_api_call c = {
        .domain = CUPTI_CB_DOMAIN_RUNTIME_API,
        .cbid = ptsz ? CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060
                     : CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060,
        .function_name = ptsz ? "cudaLaunchKernelExC_ptsz_v11060" : "cudaLaunchKernelExC_v11060",
        .params = &p,
        .symbol_name = callback_symbol(func),
        .context = callback_context(),
    };
    fake_cupti_api_fn api = __atomic_load_n(&cupti_api, __ATOMIC_ACQUIRE);
    api(&c, CUPTI_API_ENTER, NULL);
    cudaError_t rc = launch_ex(config, func, args, ptsz, 1);
    api(&c, CUPTI_API_EXIT, &rc);
    return rc;
}

API cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func,
                                    void **args) {
    return launch_ex(config, func, args, 0, 0);
}

API cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t *config, const void *func,
                                         void **args) {
    return launch_ex(config, func, args, 1, 0);
}

/* nvcc 13's stubs call these with the handle from __cudaGetKernel; like the real runtime's,
 * they jump on to cudaLaunchKernel / cudaLaunchKernel_ptsz (a tail call: the launch's return
 * address is the stub's, as tracer sees it with the real runtime). */
#define TAIL __attribute__((optimize("optimize-sibling-calls")))
API TAIL cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args,
                                   size_t sharedMem, cudaStream_t stream) {
    return cudaLaunchKernel((const void *)kernel, gridDim, blockDim, args, sharedMem, stream);
}

API TAIL cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim,
                                        void **args, size_t sharedMem, cudaStream_t stream) {
    return cudaLaunchKernel_ptsz((const void *)kernel, gridDim, blockDim, args, sharedMem, stream);
}

/* ---- graphs ----------------------------------------------------------------------------- */

API cudaError_t cudaGraphCreate(cudaGraph_t *pGraph, unsigned int flags) {
    READY();
    return ret(from_driver(drv.cuGraphCreate((CUgraph *)pGraph, flags)));
}

API cudaError_t cudaGraphAddKernelNode(cudaGraphNode_t *pGraphNode, cudaGraph_t graph,
                                       const cudaGraphNode_t *pDependencies,
                                       size_t numDependencies,
                                       const struct cudaKernelNodeParams *pNodeParams) {
    READY();
    if (!pNodeParams) return ret(cudaErrorInvalidValue);
    CUfunction f;
    cudaError_t err = driver_handle(pNodeParams->func, &f);
    if (err) return ret(err);
    CUDA_KERNEL_NODE_PARAMS p = {
        .gridDimX = pNodeParams->gridDim.x,
        .gridDimY = pNodeParams->gridDim.y,
        .gridDimZ = pNodeParams->gridDim.z,
        .blockDimX = pNodeParams->blockDim.x,
        .blockDimY = pNodeParams->blockDim.y,
        .blockDimZ = pNodeParams->blockDim.z,
        .sharedMemBytes = pNodeParams->sharedMemBytes,
        .kernelParams = pNodeParams->kernelParams,
        .extra = pNodeParams->extra,
    };
    if (launch_with_kernel)
        p.kern = (CUkernel)f;
    else
        p.func = f;
    return ret(from_driver(drv.cuGraphAddKernelNode_v2((CUgraphNode *)pGraphNode, graph,
                                                       pDependencies, numDependencies, &p)));
}

API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                     unsigned long long flags) {
    READY();
    return ret(from_driver(drv.cuGraphInstantiateWithFlags(pGraphExec, graph, flags)));
}

API cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
    READY();
    return ret(from_driver(drv.cuGraphLaunch(graphExec, driver_stream(stream, 0))));
}

API cudaError_t cudaGraphLaunch_ptsz(cudaGraphExec_t graphExec, cudaStream_t stream) {
    READY();
    return ret(from_driver(drv.cuGraphLaunch(graphExec, driver_stream(stream, 1))));
}

API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
    READY();
    return ret(from_driver(drv.cuGraphExecDestroy(graphExec)));
}

API cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    READY();
    return ret(from_driver(drv.cuGraphDestroy(graph)));
}

/* ---- memory ----------------------------------------------------------------------------- */

API cudaError_t cudaMalloc(void **devPtr, size_t size) {
    READY();
    if (!devPtr) return ret(cudaErrorInvalidValue);
    if (size == 0) {
        *devPtr = NULL;
        return cudaSuccess;
    }
    CUdeviceptr d;
    CUresult rc = drv.cuMemAlloc_v2(&d, size);
    if (rc != CUDA_SUCCESS) return ret(from_driver(rc));
    *devPtr = (void *)(uintptr_t)d;
    return cudaSuccess;
}

/* cudaFree(NULL) does nothing but initialize: the usual way to create the context early. */
API cudaError_t cudaFree(void *devPtr) {
    READY();
    if (!devPtr) return cudaSuccess;
    return ret(from_driver(drv.cuMemFree_v2((CUdeviceptr)(uintptr_t)devPtr)));
}

static cudaError_t copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                        int async, CUstream s) {
    READY();
    CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, sd = (CUdeviceptr)(uintptr_t)src;
    CUresult rc;
    switch (kind) {
    case cudaMemcpyHostToHost:
        if (n && (!dst || !src)) return ret(cudaErrorInvalidValue);
        if (n) memmove(dst, src, n);
        return cudaSuccess;
    case cudaMemcpyHostToDevice:
        rc = async ? drv.cuMemcpyHtoDAsync_v2(d, src, n, s) : drv.cuMemcpyHtoD_v2(d, src, n);
        break;
    case cudaMemcpyDeviceToHost:
        rc = async ? drv.cuMemcpyDtoHAsync_v2(dst, sd, n, s) : drv.cuMemcpyDtoH_v2(dst, sd, n);
        break;
    case cudaMemcpyDeviceToDevice:
        rc = async ? drv.cuMemcpyAsync(d, sd, n, s) : drv.cuMemcpyDtoD_v2(d, sd, n);
        break;
    case cudaMemcpyDefault:
        rc = async ? drv.cuMemcpyAsync(d, sd, n, s) : drv.cuMemcpy(d, sd, n);
        break;
    default:
        return ret(cudaErrorInvalidMemcpyDirection);
    }
    return ret(from_driver(rc));
}

API cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
    return copy(dst, src, count, kind, 0, NULL);
}

API cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t count,
                                enum cudaMemcpyKind kind) {
    return copy(dst, src, count, kind, 0, NULL);
}

API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                enum cudaMemcpyKind kind, cudaStream_t stream) {
    return copy(dst, src, count, kind, 1, driver_stream(stream, 0));
}

API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count,
                                     enum cudaMemcpyKind kind, cudaStream_t stream) {
    return copy(dst, src, count, kind, 1, driver_stream(stream, 1));
}

/* ---- streams and synchronization -------------------------------------------------------- */

API cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
    READY();
    return ret(from_driver(drv.cuStreamCreate((CUstream *)pStream, 0)));
}

API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
    READY();
    return ret(from_driver(drv.cuStreamCreate((CUstream *)pStream, flags)));
}

API cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    READY();
    return ret(from_driver(drv.cuStreamDestroy_v2(stream)));
}

API cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    READY();
    return ret(from_driver(drv.cuStreamSynchronize(driver_stream(stream, 0))));
}

API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) {
    READY();
    return ret(from_driver(drv.cuStreamSynchronize(driver_stream(stream, 1))));
}

API cudaError_t cudaDeviceSynchronize(void) {
    READY();
    return ret(from_driver(drv.cuCtxSynchronize()));
}

/* ---- versions, devices, errors ---------------------------------------------------------- */

API cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
    if (!runtimeVersion) return ret(cudaErrorInvalidValue);
    *runtimeVersion = 13000;
    return cudaSuccess;
}

/* 0, not an error, when there is no driver. */
API cudaError_t cudaDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return ret(cudaErrorInvalidValue);
    pthread_once(&driver_once, load_driver);
    *driverVersion = 0;
    if (driver_status) return cudaSuccess;
    return ret(from_driver(drv.cuDriverGetVersion(driverVersion)));
}

API cudaError_t cudaGetDeviceCount(int *count) {
    READY();
    return ret(from_driver(drv.cuDeviceGetCount(count)));
}

API cudaError_t cudaSetDevice(int device) {
    READY();
    return device == 0 ? cudaSuccess : ret(cudaErrorInvalidDevice);
}

API cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

API cudaError_t cudaPeekAtLastError(void) {
    return last_error;
}

static const struct {
    cudaError_t code;
    const char *name, *text;
} errors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidKernelImage, "cudaErrorInvalidKernelImage", "device kernel image is invalid"},
    {cudaErrorDeviceUninitialized, "cudaErrorDeviceUninitialized", "invalid device context"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorSymbolNotFound, "cudaErrorSymbolNotFound", "named symbol not found"},
};

API const char *cudaGetErrorName(cudaError_t error) {
    FRAME();
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) return errors[i].name;
    return "cudaErrorUnknown";
}

API const char *cudaGetErrorString(cudaError_t error) {
    FRAME();
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) return errors[i].text;
    return "unknown error";
}
