/* The slice of CUPTI's activity API (cupti_activity.h, cupti_result.h) and callback API
 * (cupti_callbacks.h, the launch ids and parameter structs of cupti_runtime_cbid.h,
 * cupti_driver_cbid.h and the generated_*_meta.h headers) that tracer's injection library calls
 * and the fake libcupti.so.13 exports, written from the published prototypes and
 * layouts (README.md says where they were checked), not copied from NVIDIA's headers. LP64
 * Linux only; CUPTIAPI is empty there. */
#ifndef FAKE_CUPTI_ABI_H
#define FAKE_CUPTI_ABI_H

#include <stddef.h>
#include <stdint.h>

#include "fake_cuda_abi.h" /* CUcontext, dim3, ... for the callback API's parameter structs */

typedef int CUptiResult; /* enum */
#define CUPTI_SUCCESS 0
#define CUPTI_ERROR_INVALID_PARAMETER 1
#define CUPTI_ERROR_INVALID_KIND 21
#define CUPTI_ERROR_MAX_LIMIT_REACHED 12
#define CUPTI_ERROR_NOT_INITIALIZED 15
#define CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED 39

typedef int CUpti_ActivityKind; /* enum */
#define CUPTI_ACTIVITY_KIND_MEMCPY 1
#define CUPTI_ACTIVITY_KIND_KERNEL 3
#define CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL 10

#define CUPTI_ACTIVITY_FLAG_FLUSH_FORCED 1

typedef struct CUpti_Activity {
    CUpti_ActivityKind kind;
} CUpti_Activity;

/* The fields of CUpti_ActivityKernel3..13 up to `name`, which every version lays out alike
 * (CUDA 12 emits Kernel9, 13.0 Kernel10, 13.1 Kernel11): the struct is packed
 * (PACKED_ALIGNMENT: __attribute__((__packed__)) __attribute__((aligned(8)))) with every field
 * at its natural alignment. Later versions append fields after `name`. */
typedef struct __attribute__((__packed__, aligned(8))) CUpti_ActivityKernel_head {
    CUpti_ActivityKind kind;
    union {
        uint8_t both;
        struct {
            uint8_t requested : 4;
            uint8_t executed : 4;
        } config;
    } cacheConfig;
    uint8_t sharedMemoryConfig;
    uint16_t registersPerThread;
    int partitionedGlobalCacheRequested; /* enum */
    int partitionedGlobalCacheExecuted;  /* enum */
    uint64_t start;
    uint64_t end;
    uint64_t completed;
    uint32_t deviceId;
    uint32_t contextId;
    uint32_t streamId;
    int32_t gridX, gridY, gridZ;
    int32_t blockX, blockY, blockZ;
    int32_t staticSharedMemory;
    int32_t dynamicSharedMemory;
    uint32_t localMemoryPerThread;
    uint32_t localMemoryTotal;
    uint32_t correlationId;
    int64_t gridId;
    const char *name;
} CUpti_ActivityKernel_head;

_Static_assert(offsetof(CUpti_ActivityKernel_head, start) == 16, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, end) == 24, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, deviceId) == 40, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, streamId) == 48, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, gridX) == 52, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, blockX) == 64, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, staticSharedMemory) == 76, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, dynamicSharedMemory) == 80, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, correlationId) == 92, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, gridId) == 96, "kernel record layout");
_Static_assert(offsetof(CUpti_ActivityKernel_head, name) == 104, "kernel record layout");

typedef void (*CUpti_BuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size,
                                                 size_t *maxNumRecords);
typedef void (*CUpti_BuffersCallbackCompleteFunc)(void *context, uint32_t streamId,
                                                  uint8_t *buffer, size_t size,
                                                  size_t validSize);

CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc funcBufferRequested,
                                           CUpti_BuffersCallbackCompleteFunc funcBufferCompleted);
CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind);
CUptiResult cuptiActivityDisable(CUpti_ActivityKind kind);
CUptiResult cuptiActivityFlushAll(uint32_t flag);
CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t validBufferSizeBytes,
                                       CUpti_Activity **record);
CUptiResult cuptiActivityGetNumDroppedRecords(void *context, uint32_t streamId, size_t *dropped);
CUptiResult cuptiGetTimestamp(uint64_t *timestamp);
CUptiResult cuptiGetResultString(CUptiResult result, const char **str);

/* cupti_callbacks.h: one subscriber per process, its callback and which API callbacks reach
 * it; cupti.h: detaching CUPTI. */
typedef struct CUpti_Subscriber_st *CUpti_SubscriberHandle;
typedef int CUpti_CallbackDomain; /* enum */
typedef uint32_t CUpti_CallbackId;
typedef int CUpti_ApiCallbackSite; /* enum */
typedef void (*CUpti_CallbackFunc)(void *userdata, CUpti_CallbackDomain domain,
                                   CUpti_CallbackId cbid, const void *cbdata);

#define CUPTI_CB_DOMAIN_INVALID 0
#define CUPTI_CB_DOMAIN_DRIVER_API 1
#define CUPTI_CB_DOMAIN_RUNTIME_API 2
#define CUPTI_CB_DOMAIN_RESOURCE 3
#define CUPTI_CB_DOMAIN_SYNCHRONIZE 4
#define CUPTI_CB_DOMAIN_NVTX 5
/* The fake accepts domains 1..FAKE_CUPTI_DOMAIN_LIMIT-1 (newer CUPTIs have more); callbacks
 * fire in 1 and 2 only. */
#define FAKE_CUPTI_DOMAIN_LIMIT 6

#define CUPTI_API_ENTER 0
#define CUPTI_API_EXIT 1

/* Launch callback ids (cupti_runtime_cbid.h, cupti_driver_cbid.h). */
#define CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000 211
#define CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000 214
#define CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060 430
#define CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060 431
#define CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel 307
#define CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz 442
#define CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx 652
#define CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz 653
/* The fake's range of callback ids in every domain: 1..FAKE_CUPTI_CBID_LIMIT-1 (0 is each
 * domain's INVALID id; the real domains end below this). */
#define FAKE_CUPTI_CBID_LIMIT 1024

/* What a driver or runtime API callback's cbdata points to. */
typedef struct {
    CUpti_ApiCallbackSite callbackSite;
    const char *functionName;      /* "cudaLaunchKernel_v7000", "cuLaunchKernel", ... */
    const void *functionParams;    /* the call's <function>_params struct */
    void *functionReturnValue;     /* NULL at ENTER; the cudaError_t / CUresult at EXIT */
    const char *symbolName;        /* launches: the kernel's (mangled) device name */
    CUcontext context;
    uint32_t contextUid;
    uint64_t *correlationData;     /* the subscriber's, kept from ENTER to EXIT of a call */
    uint32_t correlationId;        /* one per API call, the same at ENTER and EXIT */
} CUpti_CallbackData;

_Static_assert(offsetof(CUpti_CallbackData, functionName) == 8, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, functionParams) == 16, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, functionReturnValue) == 24, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, symbolName) == 32, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, context) == 40, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, contextUid) == 48, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, correlationData) == 56, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, correlationId) == 64, "CUpti_CallbackData layout");

/* The launches' parameter structs (generated_cuda_runtime_api_meta.h, generated_cuda_meta.h):
 * the arguments in order, naturally aligned. The _ptsz ones are laid out alike. */
typedef struct cudaLaunchKernel_v7000_params_st {
    const void *func;
    dim3 gridDim;
    dim3 blockDim;
    void **args;
    size_t sharedMem;
    cudaStream_t stream;
} cudaLaunchKernel_v7000_params;
typedef cudaLaunchKernel_v7000_params cudaLaunchKernel_ptsz_v7000_params;

typedef struct cudaLaunchKernelExC_v11060_params_st {
    const cudaLaunchConfig_t *config;
    const void *func;
    void **args;
} cudaLaunchKernelExC_v11060_params;
typedef cudaLaunchKernelExC_v11060_params cudaLaunchKernelExC_ptsz_v11060_params;

typedef struct cuLaunchKernel_params_st {
    CUfunction f;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
    void **extra;
} cuLaunchKernel_params;
typedef cuLaunchKernel_params cuLaunchKernel_ptsz_params;

typedef struct cuLaunchKernelEx_params_st {
    const CUlaunchConfig *config;
    CUfunction f;
    void **kernelParams;
    void **extra;
} cuLaunchKernelEx_params;
typedef cuLaunchKernelEx_params cuLaunchKernelEx_ptsz_params;

_Static_assert(offsetof(cudaLaunchKernel_v7000_params, gridDim) == 8, "launch params layout");
_Static_assert(offsetof(cudaLaunchKernel_v7000_params, blockDim) == 20, "launch params layout");
_Static_assert(offsetof(cudaLaunchKernel_v7000_params, args) == 32, "launch params layout");
_Static_assert(offsetof(cudaLaunchKernel_v7000_params, sharedMem) == 40, "launch params layout");
_Static_assert(offsetof(cudaLaunchKernel_v7000_params, stream) == 48, "launch params layout");
_Static_assert(sizeof(cudaLaunchKernel_v7000_params) == 56, "launch params layout");
_Static_assert(offsetof(cudaLaunchKernelExC_v11060_params, func) == 8, "launch params layout");
_Static_assert(offsetof(cudaLaunchKernelExC_v11060_params, args) == 16, "launch params layout");
_Static_assert(offsetof(cuLaunchKernel_params, gridDimX) == 8, "launch params layout");
_Static_assert(offsetof(cuLaunchKernel_params, gridDimZ) == 16, "launch params layout");
_Static_assert(offsetof(cuLaunchKernel_params, blockDimZ) == 28, "launch params layout");
_Static_assert(offsetof(cuLaunchKernel_params, sharedMemBytes) == 32, "launch params layout");
_Static_assert(offsetof(cuLaunchKernel_params, hStream) == 40, "launch params layout");
_Static_assert(offsetof(cuLaunchKernel_params, kernelParams) == 48, "launch params layout");
_Static_assert(offsetof(cuLaunchKernel_params, extra) == 56, "launch params layout");
_Static_assert(offsetof(cuLaunchKernelEx_params, f) == 8, "launch params layout");
_Static_assert(offsetof(cuLaunchKernelEx_params, kernelParams) == 16, "launch params layout");
_Static_assert(offsetof(cuLaunchKernelEx_params, extra) == 24, "launch params layout");

CUptiResult cuptiSubscribe(CUpti_SubscriberHandle *subscriber, CUpti_CallbackFunc callback,
                           void *userdata);
CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle subscriber);
CUptiResult cuptiEnableCallback(uint32_t enable, CUpti_SubscriberHandle subscriber,
                                CUpti_CallbackDomain domain, CUpti_CallbackId cbid);
CUptiResult cuptiEnableDomain(uint32_t enable, CUpti_SubscriberHandle subscriber,
                              CUpti_CallbackDomain domain);
CUptiResult cuptiGetCallbackState(uint32_t *enable, CUpti_SubscriberHandle subscriber,
                                  CUpti_CallbackDomain domain, CUpti_CallbackId cbid);
CUptiResult cuptiFinalize(void);

/* ---- test-only: the fake driver tells the fake CUPTI that a kernel ran ------------------- */

typedef void (*fake_cupti_kernel_ran_fn)(const char *name, uint32_t stream_id,
                                         const unsigned grid[3], const unsigned block[3],
                                         unsigned shared_mem);
/* The fake driver's hook for the fake CUPTI (`fake_cuda_cupti_hook`): set when kernel records
 * are enabled, NULL when CUPTI is finalized, as the real CUPTI attaches to and detaches from the
 * driver. */
typedef void (*fake_cuda_cupti_hook_fn)(fake_cupti_kernel_ran_fn ran);
/* What the fake CUPTI holds now: a subscriber, the kernel kind enabled (0: none), buffer
 * callbacks registered. */
typedef void (*fake_cupti_state_fn)(int *subscribed, int *kind, int *callbacks);
/* ---- test-only: API callbacks from the fake driver and runtime --------------------------- */

/* One launch call as the fake driver or runtime reports it to the fake CUPTI, the same object
 * at its ENTER and its EXIT (on the caller's stack). */
struct fake_cupti_api_call {
    CUpti_CallbackDomain domain;
    CUpti_CallbackId cbid;
    const char *function_name;
    const void *params;       /* the <function>_params struct */
    const char *symbol_name;  /* the kernel's device name, NULL for an unknown handle */
    CUcontext context;        /* the calling thread's current context, or NULL */
    /* the fake CUPTI's, set at ENTER: */
    uint32_t correlation_id;
    int outermost;            /* no other API call of this thread was in flight at ENTER */
    uint64_t correlation_data;
};
/* The fake CUPTI's dispatcher (`fake_cupti_api`): delivers the call's callback at `site` to
 * the subscriber if that id is enabled; `result` is NULL at ENTER. */
typedef void (*fake_cupti_api_fn)(struct fake_cupti_api_call *call, int site, void *result);
/* Which of a library's four launch entry points have their callback enabled: */
#define FAKE_CUPTI_LAUNCH_BIT 1u         /* cudaLaunchKernel / cuLaunchKernel */
#define FAKE_CUPTI_LAUNCH_PTSZ_BIT 2u    /* cudaLaunchKernel_ptsz / cuLaunchKernel_ptsz */
#define FAKE_CUPTI_LAUNCH_EX_BIT 4u      /* cudaLaunchKernelExC / cuLaunchKernelEx */
#define FAKE_CUPTI_LAUNCH_EX_PTSZ_BIT 8u /* their _ptsz */
/* Exported by the fake driver (`fake_cuda_cupti_callbacks`) and the fake runtime
 * (`fake_cudart_cupti_callbacks`): the fake CUPTI sets the dispatcher and the mask of its
 * domain's enabled launch ids (0: a launch costs one atomic load and a branch). */
typedef void (*fake_cupti_callbacks_fn)(fake_cupti_api_fn dispatch, uint32_t mask);
/* Exported by the fake CUPTI (`fake_cupti_push_callbacks`): hands its current masks to the
 * fake driver and runtime if they are loaded; they call it when they initialize, in case
 * CUPTI was loaded first. */
typedef void (*fake_cupti_push_callbacks_fn)(void);
/* Exported by the fake CUPTI (`fake_cupti_callbacks_enabled`): how many (domain, callback id)
 * pairs are enabled now, each id of an enabled domain counted (ids 1..FAKE_CUPTI_CBID_LIMIT-1);
 * 0 once every callback is off again. */
typedef int (*fake_cupti_callbacks_enabled_fn)(void);

/* The fake CUPTI's own tally, per kernel name (i-th name; 0 past the last). */
typedef int (*fake_cupti_tally_fn)(int i, const char **name, unsigned long long *executions,
                                   unsigned long long *total_ns);

#endif
