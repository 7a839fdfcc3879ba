/* The slice of CUPTI's activity API (cupti_activity.h, cupti_result.h) that tracer's injection
 * library calls and the fake libcupti.so.13 exports, written from the published prototypes and
 * layouts (README.md says where they were checked), not copied from NVIDIA's headers. LP64
 * Linux only; CUPTIAPI is empty there. */
#ifndef FAKE_CUPTI_ABI_H
#define FAKE_CUPTI_ABI_H

#include <stddef.h>
#include <stdint.h>

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

/* cupti_callbacks.h: one subscriber per process; cupti.h: detaching CUPTI. */
typedef struct CUpti_Subscriber_st *CUpti_SubscriberHandle;
typedef void (*CUpti_CallbackFunc)(void *userdata, int domain, uint32_t cbid, const void *cbdata);
CUptiResult cuptiSubscribe(CUpti_SubscriberHandle *subscriber, CUpti_CallbackFunc callback,
                           void *userdata);
CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle subscriber);
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
/* The fake CUPTI's own tally, per kernel name (i-th name; 0 past the last). */
typedef int (*fake_cupti_tally_fn)(int i, const char **name, unsigned long long *executions,
                                   unsigned long long *total_ns);

#endif
