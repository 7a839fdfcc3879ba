/* A fake CUDA driver, built as libcuda.so.1: the driver API entry points tracer probes, with
 * the real prototypes (fake_cuda_abi.h) and enough state to behave consistently. There is no
 * GPU: "device memory" is host memory, modules and libraries are PTX text whose `.entry`
 * names become kernels, launches only check their arguments. Every handle is a heap object
 * registered in a table, so an unknown handle is refused (CUDA_ERROR_INVALID_HANDLE) rather
 * than dereferenced. Exported functions never call one another, so a probe on one counts
 * only the application's (or the runtime's) calls to it. */
#define _GNU_SOURCE
#include "fake_cuda_abi.h"
#include "fake_cupti_abi.h"
#include "fake_cupti_client.h"

#include <dlfcn.h>
#include <stdio.h>

#include <ctype.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define API __attribute__((visibility("default"), noinline))

/* Leaf functions get no frame from -fno-omit-frame-pointer alone; this makes them set one up
 * like the others, so that every exported function starts with push %rbp; mov %rsp,%rbp. */
#define FRAME() __asm__ volatile("" ::"r"(__builtin_frame_address(0)))

__attribute__((visibility("default"))) struct fake_cuda_stats fake_cuda_stats;

#define COUNT(field, n) __atomic_add_fetch(&fake_cuda_stats.field, (n), __ATOMIC_RELAXED)

enum kind {
    K_FREE = 0, K_MODULE, K_LIBRARY, K_FUNCTION, K_KERNEL, K_STREAM, K_GRAPH, K_NODE, K_EXEC
};

struct fk_function;
struct fk_kernel {
    char *name;
    struct fk_image *owner;     /* the library */
    struct fk_function *func;   /* made by cuKernelGetFunction, once */
};
struct fk_function {
    char *name;
    struct fk_image *module;    /* NULL for a library kernel's function */
    struct fk_kernel *kernel;   /* NULL for a module function */
};
struct fk_image { /* a module (functions) or a library (kernels) */
    int nentries;
    char **names;
    void **entries; /* struct fk_function * or struct fk_kernel * */
};
struct fk_stream {
    unsigned int flags;
    uint32_t id; /* CUPTI's stream id */
};
struct fk_node {
    struct fk_graph *graph;
    CUDA_KERNEL_NODE_PARAMS params;
};
struct fk_graph {
    size_t nnodes, cap;
    struct fk_node **nodes;
};
struct fk_exec {
    size_t nnodes;
    CUDA_KERNEL_NODE_PARAMS *nodes;
};
struct fk_alloc {
    uintptr_t base;
    size_t size;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    void *ptr;
    enum kind kind;
} *handles;
static size_t nhandles, caphandles;
static struct fk_alloc *allocs;
static size_t nallocs, capallocs;

static int initialized;
static int primary_refs;
static struct CUctx_st {
    int device;
} primary_ctx;
static __thread CUcontext current_ctx;

/* ---- handle table (callers hold `lock`) ------------------------------------------------- */

static int add_handle(void *p, enum kind k) {
    if (nhandles == caphandles) {
        size_t cap = caphandles ? caphandles * 2 : 64;
        void *n = realloc(handles, cap * sizeof *handles);
        if (!n) return -1;
        handles = n;
        caphandles = cap;
    }
    handles[nhandles].ptr = p;
    handles[nhandles].kind = k;
    nhandles++;
    return 0;
}

static enum kind handle_kind(const void *p) {
    if (!p) return K_FREE;
    for (size_t i = 0; i < nhandles; i++)
        if (handles[i].ptr == p) return handles[i].kind;
    return K_FREE;
}

static void drop_handle(const void *p) {
    for (size_t i = 0; i < nhandles; i++)
        if (handles[i].ptr == p) {
            handles[i] = handles[--nhandles];
            return;
        }
}

/* A function handle as launches take it: a CUfunction, or a CUkernel cast to one (accepted
 * by cuLaunchKernel, cuLaunchKernelEx and graph kernel nodes since CUDA 12.0). */
static const char *launchable_name(const void *f) {
    switch (handle_kind(f)) {
    case K_FUNCTION: return ((const struct fk_function *)f)->name;
    case K_KERNEL: return ((const struct fk_kernel *)f)->name;
    default: return NULL;
    }
}

static int stream_ok(CUstream s) {
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD ||
           handle_kind(s) == K_STREAM;
}

/* ---- device memory ---------------------------------------------------------------------- */

static struct fk_alloc *find_alloc(uintptr_t p, size_t n) {
    for (size_t i = 0; i < nallocs; i++) {
        struct fk_alloc *a = &allocs[i];
        if (p >= a->base && p - a->base <= a->size && n <= a->size - (p - a->base)) return a;
    }
    return NULL;
}

static int device_range(CUdeviceptr p, size_t n) {
    pthread_mutex_lock(&lock);
    int ok = find_alloc((uintptr_t)p, n) != NULL;
    pthread_mutex_unlock(&lock);
    return ok;
}

/* ---- state checks ----------------------------------------------------------------------- */

static CUresult need_ctx(void) {
    if (!__atomic_load_n(&initialized, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

static CUresult need_init(void) {
    return __atomic_load_n(&initialized, __ATOMIC_ACQUIRE) ? CUDA_SUCCESS
                                                           : CUDA_ERROR_NOT_INITIALIZED;
}

/* ---- images: PTX text, every `.entry NAME` is a kernel --------------------------------- */

static int ident_char(int c) {
    return isalnum(c) || c == '_' || c == '$' || c == '.';
}

static int parse_entries(const char *text, char ***names_out) {
    char **names = NULL;
    int n = 0;
    for (const char *p = text; (p = strstr(p, ".entry")) != NULL;) {
        p += 6;
        if (!isspace((unsigned char)*p)) continue;
        while (isspace((unsigned char)*p)) p++;
        const char *start = p;
        while (*p && ident_char((unsigned char)*p)) p++;
        if (p == start) continue;
        char **nn = realloc(names, (size_t)(n + 1) * sizeof *names);
        if (!nn) break;
        names = nn;
        names[n++] = strndup(start, (size_t)(p - start));
    }
    *names_out = names;
    return n;
}

static struct fk_image *load_image(const void *image, int library) {
    if (!image) return NULL;
    char **names;
    int n = parse_entries((const char *)image, &names);
    if (n <= 0) return NULL;
    struct fk_image *img = calloc(1, sizeof *img);
    img->nentries = n;
    img->names = names;
    img->entries = calloc((size_t)n, sizeof(void *));
    for (int i = 0; i < n; i++) {
        if (library) {
            struct fk_kernel *k = calloc(1, sizeof *k);
            k->name = names[i];
            k->owner = img;
            img->entries[i] = k;
        } else {
            struct fk_function *f = calloc(1, sizeof *f);
            f->name = names[i];
            f->module = img;
            img->entries[i] = f;
        }
    }
    return img;
}

static void register_image(struct fk_image *img, int library) {
    add_handle(img, library ? K_LIBRARY : K_MODULE);
    for (int i = 0; i < img->nentries; i++)
        add_handle(img->entries[i], library ? K_KERNEL : K_FUNCTION);
}

static void unload_image(struct fk_image *img, int library) {
    for (int i = 0; i < img->nentries; i++) {
        if (library) {
            struct fk_kernel *k = img->entries[i];
            if (k->func) {
                drop_handle(k->func);
                free(k->func);
            }
        }
        drop_handle(img->entries[i]);
        free(img->entries[i]);
        free(img->names[i]);
    }
    drop_handle(img);
    free(img->entries);
    free(img->names);
    free(img);
}

static void *image_lookup(struct fk_image *img, const char *name) {
    for (int i = 0; i < img->nentries; i++)
        if (strcmp(img->names[i], name) == 0) return img->entries[i];
    return NULL;
}

/* ---- initialization, devices, contexts -------------------------------------------------- */

/* ---- CUDA_INJECTION64_PATH and CUPTI ---------------------------------------------------- */

/* The fake CUPTI's hook, set while its kernel records are on (by an injected library at cuInit,
 * or one loaded into the running process later): launches that succeed report the kernel there,
 * as the real driver's instrumentation makes CUPTI records. */
static fake_cupti_kernel_ran_fn cupti_kernel_ran;

API void fake_cuda_cupti_hook(fake_cupti_kernel_ran_fn ran) {
    FRAME();
    __atomic_store_n(&cupti_kernel_ran, ran, __ATOMIC_RELEASE);
}

/* The fake CUPTI's API callbacks (fake_cupti_client.h), set by it at every change. */
API void fake_cuda_cupti_callbacks(fake_cupti_api_fn dispatch, uint32_t mask) {
    FRAME();
    take_cupti_callbacks(dispatch, mask);
}

/* As the real driver does at cuInit: load the library CUDA_INJECTION64_PATH names and call its
 * InitializeInjection. */
static void inject(void) {
    pull_cupti_callbacks();
    const char *path = getenv("CUDA_INJECTION64_PATH");
    if (!path || !*path) return;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    int (*init)(void) = h ? (int (*)(void))dlsym(h, "InitializeInjection") : NULL;
    if (!init) {
        fprintf(stderr, "fake libcuda: CUDA_INJECTION64_PATH=%s: %s\n", path,
                h ? "no InitializeInjection" : dlerror());
        return;
    }
    init(); /* its cuptiActivityEnable hooks the fake CUPTI in */
}

static uint32_t stream_id(CUstream s) {
    if (s == NULL || s == CU_STREAM_LEGACY) return 7;
    if (s == CU_STREAM_PER_THREAD) return 8;
    return ((struct fk_stream *)s)->id;
}

/* A launch that succeeded, for CUPTI. */
static void ran(const void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                unsigned bz, unsigned shmem, CUstream s) {
    fake_cupti_kernel_ran_fn report = __atomic_load_n(&cupti_kernel_ran, __ATOMIC_ACQUIRE);
    if (!report) return;
    pthread_mutex_lock(&lock);
    const char *name = launchable_name(f);
    uint32_t id = stream_ok(s) ? stream_id(s) : 0;
    pthread_mutex_unlock(&lock);
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    if (name) report(name, id, grid, block, shmem);
}

API CUresult cuInit(unsigned int Flags) {
    FRAME();
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    __atomic_store_n(&initialized, 1, __ATOMIC_RELEASE);
    pthread_once(&once, inject);
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *driverVersion) {
    FRAME();
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = 13000;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count) {
    FRAME();
    CUresult rc = need_init();
    if (rc) return rc;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    FRAME();
    CUresult rc = need_init();
    if (rc) return rc;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    FRAME();
    CUresult rc = need_init();
    if (rc) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    __atomic_add_fetch(&primary_refs, 1, __ATOMIC_RELAXED);
    *pctx = &primary_ctx;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    FRAME();
    CUresult rc = need_init();
    if (rc) return rc;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (__atomic_load_n(&primary_refs, __ATOMIC_RELAXED) <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    __atomic_sub_fetch(&primary_refs, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    CUresult rc = need_init();
    if (rc) return rc;
    if (ctx && ctx != &primary_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    current_ctx = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx) {
    CUresult rc = need_init();
    if (rc) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    COUNT(ctx_synchronize_calls, 1);
    return CUDA_SUCCESS;
}

/* ---- modules (context-bound) and libraries (context-independent) ------------------------ */

API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    struct fk_image *img = load_image(image, 0);
    if (!img) return CUDA_ERROR_INVALID_IMAGE;
    pthread_mutex_lock(&lock);
    register_image(img, 0);
    pthread_mutex_unlock(&lock);
    COUNT(module_loads, 1);
    *module = (CUmodule)img;
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(CUmodule hmod) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    pthread_mutex_lock(&lock);
    if (handle_kind(hmod) != K_MODULE) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    unload_image((struct fk_image *)hmod, 0);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    COUNT(cuModuleGetFunction_calls, 1);
    pthread_mutex_lock(&lock);
    if (handle_kind(hmod) != K_MODULE) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct fk_function *f = image_lookup((struct fk_image *)hmod, name);
    pthread_mutex_unlock(&lock);
    if (!f) return CUDA_ERROR_NOT_FOUND;
    *hfunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions,
                               CUlibraryOption *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions) {
    CUresult rc = need_init();
    if (rc) return rc;
    if (!library || !code) return CUDA_ERROR_INVALID_VALUE;
    if ((numJitOptions && (!jitOptions || !jitOptionsValues)) ||
        (numLibraryOptions && (!libraryOptions || !libraryOptionValues)))
        return CUDA_ERROR_INVALID_VALUE;
    struct fk_image *img = load_image(code, 1);
    if (!img) return CUDA_ERROR_INVALID_IMAGE;
    pthread_mutex_lock(&lock);
    register_image(img, 1);
    pthread_mutex_unlock(&lock);
    COUNT(library_loads, 1);
    *library = (CUlibrary)img;
    return CUDA_SUCCESS;
}

API CUresult cuLibraryUnload(CUlibrary library) {
    CUresult rc = need_init();
    if (rc) return rc;
    pthread_mutex_lock(&lock);
    if (handle_kind(library) != K_LIBRARY) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    unload_image((struct fk_image *)library, 1);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

API CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    CUresult rc = need_init();
    if (rc) return rc;
    if (!pKernel || !name) return CUDA_ERROR_INVALID_VALUE;
    COUNT(cuLibraryGetKernel_calls, 1);
    pthread_mutex_lock(&lock);
    if (handle_kind(library) != K_LIBRARY) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct fk_kernel *k = image_lookup((struct fk_image *)library, name);
    pthread_mutex_unlock(&lock);
    if (!k) return CUDA_ERROR_NOT_FOUND;
    *pKernel = (CUkernel)k;
    return CUDA_SUCCESS;
}

/* The function of a kernel in the current context: made on first request, the same handle
 * afterwards. */
API CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!pFunc) return CUDA_ERROR_INVALID_VALUE;
    COUNT(cuKernelGetFunction_calls, 1);
    pthread_mutex_lock(&lock);
    if (handle_kind(kernel) != K_KERNEL) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct fk_kernel *k = (struct fk_kernel *)kernel;
    if (!k->func) {
        struct fk_function *f = calloc(1, sizeof *f);
        f->name = k->name;
        f->kernel = k;
        k->func = f;
        add_handle(f, K_FUNCTION);
    }
    *pFunc = (CUfunction)k->func;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

API CUresult cuKernelGetName(const char **name, CUkernel hfunc) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int ok = handle_kind(hfunc) == K_KERNEL;
    if (ok) *name = ((struct fk_kernel *)hfunc)->name;
    pthread_mutex_unlock(&lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuFuncGetName(const char **name, CUfunction hfunc) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    const char *n = launchable_name(hfunc);
    if (n) *name = n;
    pthread_mutex_unlock(&lock);
    return n ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuFuncGetModule(CUmodule *hmod, CUfunction hfunc) {
    if (!hmod) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int ok = handle_kind(hfunc) == K_FUNCTION;
    struct fk_function *f = (struct fk_function *)hfunc;
    if (ok && !f->module) ok = 0;
    if (ok) *hmod = (CUmodule)f->module;
    pthread_mutex_unlock(&lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* ---- launches --------------------------------------------------------------------------- */

static CUresult check_launch(const void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, unsigned shmem, CUstream s,
                             void **kernelParams, void **extra) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!gx || !gy || !gz || !bx || !by || !bz) return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned long long)bx * by * bz > 1024) return CUDA_ERROR_INVALID_VALUE;
    if (shmem > 227u * 1024) return CUDA_ERROR_INVALID_VALUE;
    if (kernelParams && extra) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    rc = !launchable_name(f) ? CUDA_ERROR_INVALID_HANDLE
         : !stream_ok(s)     ? CUDA_ERROR_INVALID_HANDLE
                             : CUDA_SUCCESS;
    pthread_mutex_unlock(&lock);
    return rc;
}

static CUresult launch_traced(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned shmem, CUstream hStream,
                              void **kernelParams, void **extra, int ptsz);

/* cuLaunchKernel[_ptsz] (a NULL stream is the calling thread's with ptsz). `traced`: called
 * by launch_traced, between the callbacks. Otherwise a launch whose callback is off costs one
 * atomic load and a branch here. */
static inline __attribute__((always_inline)) CUresult
launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
       unsigned bz, unsigned shmem, CUstream hStream, void **kernelParams, void **extra,
       int ptsz, int traced) {
    if (!traced && CUPTI_CALLBACK_ON(ptsz ? FAKE_CUPTI_LAUNCH_PTSZ_BIT : FAKE_CUPTI_LAUNCH_BIT))
        return launch_traced(f, gx, gy, gz, bx, by, bz, shmem, hStream, kernelParams, extra,
                             ptsz);
    CUstream s = ptsz && !hStream ? CU_STREAM_PER_THREAD : hStream;
    COUNT(cuLaunchKernel_calls, 1);
    CUresult rc = check_launch(f, gx, gy, gz, bx, by, bz, shmem, s, kernelParams, extra);
    if (rc == CUDA_SUCCESS) {
        COUNT(cuLaunchKernel_ok, 1);
        ran(f, gx, gy, gz, bx, by, bz, shmem, s);
    }
    return rc;
}

/* The kernel's name for a callback (NULL for an unknown handle). */
static const char *callback_symbol(const void *f) {
    pthread_mutex_lock(&lock);
    const char *name = launchable_name(f);
    pthread_mutex_unlock(&lock);
    return name;
}

/* cuLaunchKernel[_ptsz] between its CUPTI callbacks (ENTER, EXIT), with the arguments as the
 * caller passed them. */
static __attribute__((noinline)) CUresult
launch_traced(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
              unsigned bz, unsigned shmem, CUstream hStream, void **kernelParams, void **extra,
              int ptsz) {
    cuLaunchKernel_params p = {f, gx, gy, gz, bx, by, bz, shmem, hStream, kernelParams, extra};
    struct fake_cupti_api_call c = {
        .domain = CUPTI_CB_DOMAIN_DRIVER_API,
        .cbid = ptsz ? CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz : CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
        .function_name = ptsz ? "cuLaunchKernel_ptsz" : "cuLaunchKernel",
        .params = &p,
        .symbol_name = callback_symbol(f),
        .context = current_ctx,
    };
    fake_cupti_api_fn api = __atomic_load_n(&cupti_api, __ATOMIC_ACQUIRE);
    api(&c, CUPTI_API_ENTER, NULL);
    CUresult rc = launch(f, gx, gy, gz, bx, by, bz, shmem, hStream, kernelParams, extra, ptsz, 1);
    api(&c, CUPTI_API_EXIT, &rc);
    return rc;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                            unsigned int gridDimZ, unsigned int blockDimX,
                            unsigned int blockDimY, unsigned int blockDimZ,
                            unsigned int sharedMemBytes, CUstream hStream, void **kernelParams,
                            void **extra) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                  sharedMemBytes, hStream, kernelParams, extra, 0, 0);
}

/* Per-thread-default-stream flavour: a NULL stream means the calling thread's stream. */
API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                 unsigned int gridDimZ, unsigned int blockDimX,
                                 unsigned int blockDimY, unsigned int blockDimZ,
                                 unsigned int sharedMemBytes, CUstream hStream,
                                 void **kernelParams, void **extra) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                  sharedMemBytes, hStream, kernelParams, extra, 1, 0);
}

static CUresult launch_ex_traced(const CUlaunchConfig *config, CUfunction f,
                                 void **kernelParams, void **extra, int ptsz);

static inline __attribute__((always_inline)) CUresult launch_ex(const CUlaunchConfig *c, CUfunction f,
                                                   void **kernelParams, void **extra, int ptsz,
                                                   int traced) {
    if (!traced &&
        CUPTI_CALLBACK_ON(ptsz ? FAKE_CUPTI_LAUNCH_EX_PTSZ_BIT : FAKE_CUPTI_LAUNCH_EX_BIT))
        return launch_ex_traced(c, f, kernelParams, extra, ptsz);
    COUNT(cuLaunchKernelEx_calls, 1);
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    if (c->numAttrs && !c->attrs) return CUDA_ERROR_INVALID_VALUE;
    CUstream s = c->hStream;
    if (ptsz && !s) s = CU_STREAM_PER_THREAD;
    CUresult rc = check_launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX,
                               c->blockDimY, c->blockDimZ, c->sharedMemBytes, s, kernelParams,
                               extra);
    if (rc == CUDA_SUCCESS) {
        COUNT(cuLaunchKernelEx_ok, 1);
        ran(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
            c->sharedMemBytes, s);
    }
    return rc;
}

static __attribute__((noinline)) CUresult
launch_ex_traced(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra,
                 int ptsz) {
    cuLaunchKernelEx_params p = {config, f, kernelParams, extra};
    struct fake_cupti_api_call c = {
        .domain = CUPTI_CB_DOMAIN_DRIVER_API,
        .cbid = ptsz ? CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz
                     : CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx,
        .function_name = ptsz ? "cuLaunchKernelEx_ptsz" : "cuLaunchKernelEx",
        .params = &p,
        .symbol_name = callback_symbol(f),
        .context = current_ctx,
    };
    fake_cupti_api_fn api = __atomic_load_n(&cupti_api, __ATOMIC_ACQUIRE);
    api(&c, CUPTI_API_ENTER, NULL);
    CUresult rc = launch_ex(config, f, kernelParams, extra, ptsz, 1);
    api(&c, CUPTI_API_EXIT, &rc);
    return rc;
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                              void **extra) {
    return launch_ex(config, f, kernelParams, extra, 0, 0);
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                   void **kernelParams, void **extra) {
    return launch_ex(config, f, kernelParams, extra, 1, 0);
}

/* ---- graphs: kernel nodes only ---------------------------------------------------------- */

API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    CUresult rc = need_init();
    if (rc) return rc;
    if (!phGraph || flags) return CUDA_ERROR_INVALID_VALUE;
    struct fk_graph *g = calloc(1, sizeof *g);
    pthread_mutex_lock(&lock);
    add_handle(g, K_GRAPH);
    pthread_mutex_unlock(&lock);
    *phGraph = (CUgraph)g;
    return CUDA_SUCCESS;
}

API CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                     const CUgraphNode *dependencies, size_t numDependencies,
                                     const CUDA_KERNEL_NODE_PARAMS *nodeParams) {
    CUresult rc = need_init();
    if (rc) return rc;
    if (!phGraphNode || !nodeParams || (numDependencies && !dependencies))
        return CUDA_ERROR_INVALID_VALUE;
    const CUDA_KERNEL_NODE_PARAMS *p = nodeParams;
    if (!p->gridDimX || !p->gridDimY || !p->gridDimZ || !p->blockDimX || !p->blockDimY ||
        !p->blockDimZ)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct fk_graph *g = (struct fk_graph *)hGraph;
    const void *f = p->func ? (const void *)p->func : (const void *)p->kern;
    if (handle_kind(g) != K_GRAPH || !launchable_name(f)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (size_t i = 0; i < numDependencies; i++) {
        const struct fk_node *d = (const struct fk_node *)dependencies[i];
        if (handle_kind(d) != K_NODE || d->graph != g) {
            pthread_mutex_unlock(&lock);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (g->nnodes == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 8;
        void *n = realloc(g->nodes, cap * sizeof *g->nodes);
        if (!n) {
            pthread_mutex_unlock(&lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = n;
        g->cap = cap;
    }
    struct fk_node *node = calloc(1, sizeof *node);
    node->graph = g;
    node->params = *p;
    g->nodes[g->nnodes++] = node;
    add_handle(node, K_NODE);
    *phGraphNode = (CUgraphNode)node;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                         unsigned long long flags) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    (void)flags;
    if (!phGraphExec) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct fk_graph *g = (struct fk_graph *)hGraph;
    if (handle_kind(g) != K_GRAPH) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct fk_exec *e = calloc(1, sizeof *e);
    e->nnodes = g->nnodes;
    e->nodes = calloc(g->nnodes ? g->nnodes : 1, sizeof *e->nodes);
    for (size_t i = 0; i < g->nnodes; i++) e->nodes[i] = g->nodes[i]->params;
    add_handle(e, K_EXEC);
    pthread_mutex_unlock(&lock);
    *phGraphExec = (CUgraphExec)e;
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec hGraphExec, CUstream s) {
    COUNT(cuGraphLaunch_calls, 1);
    CUresult rc = need_ctx();
    if (rc) return rc;
    pthread_mutex_lock(&lock);
    struct fk_exec *e = (struct fk_exec *)hGraphExec;
    if (handle_kind(e) != K_EXEC || !stream_ok(s)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (size_t i = 0; i < e->nnodes; i++) {
        const CUDA_KERNEL_NODE_PARAMS *p = &e->nodes[i];
        if (!launchable_name(p->func ? (const void *)p->func : (const void *)p->kern)) {
            pthread_mutex_unlock(&lock);
            return CUDA_ERROR_INVALID_HANDLE; /* its module was unloaded */
        }
    }
    size_t n = e->nnodes;
    pthread_mutex_unlock(&lock);
    for (size_t i = 0; i < n; i++) {
        const CUDA_KERNEL_NODE_PARAMS *p = &e->nodes[i];
        ran(p->func ? (const void *)p->func : (const void *)p->kern, p->gridDimX, p->gridDimY,
            p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ, p->sharedMemBytes, s);
    }
    COUNT(graph_kernel_nodes_run, n);
    COUNT(cuGraphLaunch_ok, 1);
    return CUDA_SUCCESS;
}

API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream);
}

API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream ? hStream : CU_STREAM_PER_THREAD);
}

API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    pthread_mutex_lock(&lock);
    struct fk_exec *e = (struct fk_exec *)hGraphExec;
    if (handle_kind(e) != K_EXEC) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    drop_handle(e);
    pthread_mutex_unlock(&lock);
    free(e->nodes);
    free(e);
    return CUDA_SUCCESS;
}

API CUresult cuGraphDestroy(CUgraph hGraph) {
    pthread_mutex_lock(&lock);
    struct fk_graph *g = (struct fk_graph *)hGraph;
    if (handle_kind(g) != K_GRAPH) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    drop_handle(g);
    for (size_t i = 0; i < g->nnodes; i++) {
        drop_handle(g->nodes[i]);
        free(g->nodes[i]);
    }
    pthread_mutex_unlock(&lock);
    free(g->nodes);
    free(g);
    return CUDA_SUCCESS;
}

/* ---- streams ---------------------------------------------------------------------------- */

API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!phStream || Flags > 1) return CUDA_ERROR_INVALID_VALUE;
    static uint32_t next_id = 13;
    struct fk_stream *s = calloc(1, sizeof *s);
    s->flags = Flags;
    s->id = __atomic_fetch_add(&next_id, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&lock);
    add_handle(s, K_STREAM);
    pthread_mutex_unlock(&lock);
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

API CUresult cuStreamDestroy_v2(CUstream hStream) {
    pthread_mutex_lock(&lock);
    if (handle_kind(hStream) != K_STREAM) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    drop_handle(hStream);
    pthread_mutex_unlock(&lock);
    free(hStream);
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize(CUstream hStream) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    pthread_mutex_lock(&lock);
    int ok = stream_ok(hStream);
    pthread_mutex_unlock(&lock);
    if (!ok) return CUDA_ERROR_INVALID_HANDLE;
    COUNT(stream_synchronize_calls, 1);
    return CUDA_SUCCESS;
}

/* ---- memory ----------------------------------------------------------------------------- */

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    void *p = NULL;
    if (posix_memalign(&p, 256, bytesize) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    if (nallocs == capallocs) {
        size_t cap = capallocs ? capallocs * 2 : 64;
        void *n = realloc(allocs, cap * sizeof *allocs);
        if (!n) {
            pthread_mutex_unlock(&lock);
            free(p);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        allocs = n;
        capallocs = cap;
    }
    allocs[nallocs].base = (uintptr_t)p;
    allocs[nallocs].size = bytesize;
    nallocs++;
    pthread_mutex_unlock(&lock);
    COUNT(mem_alloc_calls, 1);
    COUNT(mem_alloc_bytes, bytesize);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].base == (uintptr_t)dptr) {
            allocs[i] = allocs[--nallocs];
            pthread_mutex_unlock(&lock);
            free((void *)(uintptr_t)dptr);
            COUNT(mem_free_calls, 1);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_INVALID_VALUE;
}

enum dir { HTOD, DTOH, DTOD, ANY };

/* Copies for real once both ends are checked: device ends must lie inside one allocation. */
static CUresult copy(void *dst, const void *src, size_t n, enum dir d, int async, CUstream s) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (async) {
        pthread_mutex_lock(&lock);
        int ok = stream_ok(s);
        pthread_mutex_unlock(&lock);
        if (!ok) return CUDA_ERROR_INVALID_HANDLE;
    }
    if (n == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    int dst_dev = device_range((CUdeviceptr)(uintptr_t)dst, n);
    int src_dev = device_range((CUdeviceptr)(uintptr_t)src, n);
    if ((d == HTOD && !dst_dev) || (d == DTOH && !src_dev) ||
        (d == DTOD && (!dst_dev || !src_dev)))
        return CUDA_ERROR_INVALID_VALUE;
    if (d == ANY) d = dst_dev && src_dev ? DTOD : dst_dev ? HTOD : src_dev ? DTOH : ANY;
    memmove(dst, src, n);
    switch (d) {
    case HTOD:
        COUNT(memcpy_htod_calls, 1);
        COUNT(memcpy_htod_bytes, n);
        break;
    case DTOH:
        COUNT(memcpy_dtoh_calls, 1);
        COUNT(memcpy_dtoh_bytes, n);
        break;
    case DTOD:
        COUNT(memcpy_dtod_calls, 1);
        COUNT(memcpy_dtod_bytes, n);
        break;
    case ANY: break; /* host to host through cuMemcpy: not a device transfer */
    }
    return CUDA_SUCCESS;
}

#define DEV(p) ((void *)(uintptr_t)(p))

API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    return copy(DEV(dst), DEV(src), ByteCount, ANY, 0, NULL);
}

API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                           CUstream hStream) {
    return copy(DEV(dst), DEV(src), ByteCount, ANY, 1, hStream);
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    return copy(DEV(dstDevice), srcHost, ByteCount, HTOD, 0, NULL);
}

API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(dstHost, DEV(srcDevice), ByteCount, DTOH, 0, NULL);
}

API CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(DEV(dstDevice), DEV(srcDevice), ByteCount, DTOD, 0, NULL);
}

API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                  CUstream hStream) {
    return copy(DEV(dstDevice), srcHost, ByteCount, HTOD, 1, hStream);
}

API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                  CUstream hStream) {
    return copy(dstHost, DEV(srcDevice), ByteCount, DTOH, 1, hStream);
}
