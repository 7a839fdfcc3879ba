/* A fake CUPTI, built as libcupti.so.13: the activity API calls tracer's injection library
 * makes (fake_cupti_abi.h), and kernel records for the kernels the fake libcuda reports as run
 * (`fake_cupti_kernel_ran`, looked up by the fake driver once CUPTI is loaded). There is no
 * GPU: a kernel "runs" for 1 µs per block of its grid, starting when it is launched or when
 * the previous kernel on its stream ends. Records are variable-sized as CUPTI's are (kernel
 * records longer than the fields tracer reads, one memcpy-kind record opening each buffer),
 * so a reader must walk them with cuptiActivityGetNextRecord.
 *
 * The callback API: one subscriber, whose callback gets the driver and runtime API callbacks
 * it enabled (cuptiEnableCallback / cuptiEnableDomain). Only launches make them: the fake
 * driver's and runtime's launch entry points call `fake_cupti_api` at ENTER and EXIT when
 * their id is enabled, which they learn from a mask this library pushes into them
 * (`fake_cuda_cupti_callbacks`, `fake_cudart_cupti_callbacks`) at every change.
 *
 * Timestamps are CLOCK_REALTIME's, as real CUPTI's on Linux (so a consumer must convert them
 * to CLOCK_MONOTONIC itself). FAKE_CUPTI_DROPPED=N reports N dropped records at the first
 * completed buffer. */
#define _GNU_SOURCE
#include "fake_cupti_abi.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define API __attribute__((visibility("default"), noinline))

/* Record sizes: a kernel record as long as CUDA 13.0's CUpti_ActivityKernel10, a memcpy one. */
#define KERNEL_RECORD 216
#define MEMCPY_RECORD 64
#define NS_PER_BLOCK 1000ULL
#define MAX_KERNELS 64
#define MAX_STREAMS 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static CUpti_BuffersCallbackRequestFunc requested;
static CUpti_BuffersCallbackCompleteFunc completed;
static int kernel_kind; /* the kind enabled, 0: none */
static uint8_t *buffer;
static size_t buffer_size, buffer_used;
static uint32_t next_correlation; /* the last id given (atomic): API calls and records */
static int dropped_reported;
static int subscribed; /* one subscriber, as CUPTI allows */
static struct CUpti_Subscriber_st { int unused; } the_subscriber;

/* The callback API. The subscriber's callback and userdata, and the enabled ids, one bit per
 * (domain, id), are read atomically by the dispatcher; changes are made under cb_lock, which
 * also orders the pushes of the launch masks into the driver and the runtime. */
static pthread_mutex_t cb_lock = PTHREAD_MUTEX_INITIALIZER;
static CUpti_CallbackFunc sub_callback;
static void *sub_userdata;
#define CB_WORDS (FAKE_CUPTI_CBID_LIMIT / 64)
static uint64_t enabled_ids[FAKE_CUPTI_DOMAIN_LIMIT][CB_WORDS];
/* The correlation id of the outermost API call in flight on this thread (0: none): a kernel
 * record made under it carries it, as CUPTI's records carry their launch's. */
static __thread uint32_t api_in_flight;

static struct {
    char *name; /* the record's name pointer: one per kernel, kept for the process's life */
    unsigned long long executions, total_ns;
} kernels[MAX_KERNELS];
static int nkernels;

static struct {
    uint32_t id;
    uint64_t busy_until;
} streams[MAX_STREAMS];
static int nstreams;

static uint64_t now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

API CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc req,
                                               CUpti_BuffersCallbackCompleteFunc done) {
    if (!req || !done) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    requested = req;
    completed = done;
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

/* Attaches to (or, with NULL, detaches from) the fake driver, which tells us of each kernel it
 * runs; a process whose driver is not loaded yet is attached by the driver at cuInit. */
API void fake_cupti_kernel_ran(const char *name, uint32_t stream_id, const unsigned grid[3],
                               const unsigned block[3], unsigned shared_mem);
static void hook_driver(fake_cupti_kernel_ran_fn ran) {
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    fake_cuda_cupti_hook_fn hook = drv ? (fake_cuda_cupti_hook_fn)dlsym(drv, "fake_cuda_cupti_hook") : NULL;
    if (hook) hook(ran);
    if (drv) dlclose(drv);
}

/* ---- the callback API ------------------------------------------------------------------- */

static int id_enabled(int domain, uint32_t cbid) {
    if (domain <= 0 || domain >= FAKE_CUPTI_DOMAIN_LIMIT || cbid >= FAKE_CUPTI_CBID_LIMIT) return 0;
    return (__atomic_load_n(&enabled_ids[domain][cbid / 64], __ATOMIC_RELAXED) >> (cbid % 64)) & 1;
}

API void fake_cupti_api(struct fake_cupti_api_call *c, int site, void *result) {
    if (site == CUPTI_API_ENTER) {
        c->correlation_id = __atomic_add_fetch(&next_correlation, 1, __ATOMIC_RELAXED);
        c->correlation_data = 0;
        c->outermost = api_in_flight == 0;
        if (c->outermost) api_in_flight = c->correlation_id;
    }
    CUpti_CallbackFunc cb = __atomic_load_n(&sub_callback, __ATOMIC_ACQUIRE);
    if (cb && id_enabled(c->domain, c->cbid)) {
        CUpti_CallbackData d = {
            .callbackSite = site,
            .functionName = c->function_name,
            .functionParams = c->params,
            .functionReturnValue = site == CUPTI_API_ENTER ? NULL : result,
            .symbolName = c->symbol_name,
            .context = c->context,
            .contextUid = c->context ? 1 : 0,
            .correlationData = &c->correlation_data,
            .correlationId = c->correlation_id,
        };
        cb(__atomic_load_n(&sub_userdata, __ATOMIC_ACQUIRE), c->domain, c->cbid, &d);
    }
    if (site == CUPTI_API_EXIT && c->outermost) api_in_flight = 0;
}

/* The launch ids of a domain that reach a callback now, as the library's mask bits. */
static uint32_t launch_mask(int domain) {
    static const uint32_t runtime[4] = {
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060,
    };
    static const uint32_t driver[4] = {
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
    };
    const uint32_t *ids = domain == CUPTI_CB_DOMAIN_RUNTIME_API ? runtime : driver;
    uint32_t mask = 0;
    if (!__atomic_load_n(&sub_callback, __ATOMIC_ACQUIRE)) return 0;
    for (int i = 0; i < 4; i++)
        if (id_enabled(domain, ids[i])) mask |= 1u << i;
    return mask;
}

static void push_to(const char *lib, const char *setter, uint32_t mask) {
    void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    fake_cupti_callbacks_fn set = h ? (fake_cupti_callbacks_fn)dlsym(h, setter) : NULL;
    if (set) set(fake_cupti_api, mask);
    if (h) dlclose(h);
}

/* Hands the current masks to the fake driver and runtime (caller holds cb_lock). */
static void push_locked(void) {
    push_to("libcuda.so.1", "fake_cuda_cupti_callbacks", launch_mask(CUPTI_CB_DOMAIN_DRIVER_API));
    push_to("libcudart.so.13", "fake_cudart_cupti_callbacks",
            launch_mask(CUPTI_CB_DOMAIN_RUNTIME_API));
}

API void fake_cupti_push_callbacks(void) {
    pthread_mutex_lock(&cb_lock);
    push_locked();
    pthread_mutex_unlock(&cb_lock);
}

static int is_subscriber(CUpti_SubscriberHandle s) {
    return s == &the_subscriber && __atomic_load_n(&subscribed, __ATOMIC_ACQUIRE);
}

static void set_id(int domain, uint32_t cbid, int on) {
    uint64_t bit = 1ULL << (cbid % 64);
    if (on)
        __atomic_or_fetch(&enabled_ids[domain][cbid / 64], bit, __ATOMIC_RELAXED);
    else
        __atomic_and_fetch(&enabled_ids[domain][cbid / 64], ~bit, __ATOMIC_RELAXED);
}

API CUptiResult cuptiEnableCallback(uint32_t enable, CUpti_SubscriberHandle subscriber,
                                    CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
    if (domain <= 0 || domain >= FAKE_CUPTI_DOMAIN_LIMIT || cbid == 0 ||
        cbid >= FAKE_CUPTI_CBID_LIMIT)
        return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&cb_lock);
    if (!is_subscriber(subscriber)) {
        pthread_mutex_unlock(&cb_lock);
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    set_id(domain, cbid, enable != 0);
    push_locked();
    pthread_mutex_unlock(&cb_lock);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiEnableDomain(uint32_t enable, CUpti_SubscriberHandle subscriber,
                                  CUpti_CallbackDomain domain) {
    if (domain <= 0 || domain >= FAKE_CUPTI_DOMAIN_LIMIT) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&cb_lock);
    if (!is_subscriber(subscriber)) {
        pthread_mutex_unlock(&cb_lock);
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    for (uint32_t id = 1; id < FAKE_CUPTI_CBID_LIMIT; id++) set_id(domain, id, enable != 0);
    push_locked();
    pthread_mutex_unlock(&cb_lock);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetCallbackState(uint32_t *enable, CUpti_SubscriberHandle subscriber,
                                      CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
    if (!enable || domain <= 0 || domain >= FAKE_CUPTI_DOMAIN_LIMIT || cbid == 0 ||
        cbid >= FAKE_CUPTI_CBID_LIMIT || !is_subscriber(subscriber))
        return CUPTI_ERROR_INVALID_PARAMETER;
    *enable = (uint32_t)id_enabled(domain, cbid);
    return CUPTI_SUCCESS;
}

/* Every callback off, as cuptiUnsubscribe and cuptiFinalize leave them (caller holds
 * cb_lock). */
static void all_callbacks_off_locked(void) {
    for (int d = 0; d < FAKE_CUPTI_DOMAIN_LIMIT; d++)
        for (int w = 0; w < CB_WORDS; w++) __atomic_store_n(&enabled_ids[d][w], 0, __ATOMIC_RELAXED);
    push_locked();
}

API int fake_cupti_callbacks_enabled(void) {
    int n = 0;
    for (int d = 0; d < FAKE_CUPTI_DOMAIN_LIMIT; d++)
        for (int w = 0; w < CB_WORDS; w++)
            n += __builtin_popcountll(__atomic_load_n(&enabled_ids[d][w], __ATOMIC_RELAXED));
    return n;
}

/* ---- the activity API ------------------------------------------------------------------- */

API CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind) {
    if (kind != CUPTI_ACTIVITY_KIND_KERNEL && kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
        return CUPTI_ERROR_INVALID_KIND;
    kernel_kind = kind;
    hook_driver(fake_cupti_kernel_ran);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiSubscribe(CUpti_SubscriberHandle *subscriber, CUpti_CallbackFunc callback,
                               void *userdata) {
    if (!subscriber) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    int taken = subscribed;
    if (!taken) {
        __atomic_store_n(&sub_userdata, userdata, __ATOMIC_RELEASE);
        __atomic_store_n(&sub_callback, callback, __ATOMIC_RELEASE);
        __atomic_store_n(&subscribed, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&lock);
    if (taken) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    *subscriber = &the_subscriber;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle subscriber) {
    if (subscriber != &the_subscriber) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&cb_lock); /* then `lock`: no callback is enabled again meanwhile */
    pthread_mutex_lock(&lock);
    __atomic_store_n(&subscribed, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&sub_callback, NULL, __ATOMIC_RELEASE);
    __atomic_store_n(&sub_userdata, NULL, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&lock);
    all_callbacks_off_locked();
    pthread_mutex_unlock(&cb_lock);
    return CUPTI_SUCCESS;
}

/* Detaches from the process: no records, no buffer callbacks, no driver hook, every API
 * callback off (the subscriber slot is the subscriber's to let go). */
API CUptiResult cuptiFinalize(void) {
    hook_driver(NULL);
    pthread_mutex_lock(&cb_lock);
    all_callbacks_off_locked();
    pthread_mutex_unlock(&cb_lock);
    pthread_mutex_lock(&lock);
    kernel_kind = 0;
    requested = NULL;
    completed = NULL;
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

API void fake_cupti_state(int *is_subscribed, int *kind, int *callbacks) {
    pthread_mutex_lock(&lock);
    *is_subscribed = subscribed;
    *kind = kernel_kind;
    *callbacks = completed != NULL;
    pthread_mutex_unlock(&lock);
}

API CUptiResult cuptiActivityDisable(CUpti_ActivityKind kind) {
    if (kind == kernel_kind) kernel_kind = 0;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetTimestamp(uint64_t *timestamp) {
    if (!timestamp) return CUPTI_ERROR_INVALID_PARAMETER;
    *timestamp = now();
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetResultString(CUptiResult result, const char **str) {
    if (!str) return CUPTI_ERROR_INVALID_PARAMETER;
    switch (result) {
    case CUPTI_SUCCESS: *str = "CUPTI_SUCCESS"; break;
    case CUPTI_ERROR_INVALID_PARAMETER: *str = "CUPTI_ERROR_INVALID_PARAMETER"; break;
    case CUPTI_ERROR_INVALID_KIND: *str = "CUPTI_ERROR_INVALID_KIND"; break;
    case CUPTI_ERROR_MAX_LIMIT_REACHED: *str = "CUPTI_ERROR_MAX_LIMIT_REACHED"; break;
    case CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED:
        *str = "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED";
        break;
    default: *str = "CUPTI_ERROR_UNKNOWN"; break;
    }
    return CUPTI_SUCCESS;
}

static size_t record_size(const uint8_t *r) {
    int kind;
    memcpy(&kind, r, sizeof kind);
    return kind == CUPTI_ACTIVITY_KIND_MEMCPY ? MEMCPY_RECORD : KERNEL_RECORD;
}

API CUptiResult cuptiActivityGetNextRecord(uint8_t *buf, size_t valid, CUpti_Activity **record) {
    if (!buf || !record) return CUPTI_ERROR_INVALID_PARAMETER;
    uint8_t *r = *record ? (uint8_t *)*record + record_size((uint8_t *)*record) : buf;
    if (r + sizeof(int) > buf + valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    *record = (CUpti_Activity *)r;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityGetNumDroppedRecords(void *context, uint32_t streamId,
                                                  size_t *dropped) {
    if (!dropped) return CUPTI_ERROR_INVALID_PARAMETER;
    const char *n = getenv("FAKE_CUPTI_DROPPED");
    pthread_mutex_lock(&lock);
    *dropped = n && !dropped_reported ? strtoull(n, NULL, 10) : 0;
    dropped_reported = 1;
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

/* Takes the current buffer out (caller holds `lock`): its owner gets it back unlocked. */
static uint8_t *take_buffer(size_t *size, size_t *used) {
    uint8_t *b = buffer;
    *size = buffer_size;
    *used = buffer_used;
    buffer = NULL;
    buffer_size = buffer_used = 0;
    return b;
}

static void hand_back(uint8_t *b, size_t size, size_t used) {
    if (b) completed(NULL, 0, b, size, used);
}

API CUptiResult cuptiActivityFlushAll(uint32_t flag) {
    (void)flag; /* every buffer with records is complete here */
    size_t size, used;
    pthread_mutex_lock(&lock);
    if (!completed || !buffer || !buffer_used) {
        pthread_mutex_unlock(&lock);
        return CUPTI_SUCCESS;
    }
    uint8_t *b = take_buffer(&size, &used);
    pthread_mutex_unlock(&lock);
    hand_back(b, size, used);
    return CUPTI_SUCCESS;
}

/* Room for `n` bytes (caller holds `lock`); a full buffer is taken out into *full. */
static uint8_t *room(size_t n, uint8_t **full, size_t *full_size, size_t *full_used) {
    if (buffer && buffer_used + n > buffer_size) *full = take_buffer(full_size, full_used);
    if (!buffer) {
        size_t max_records = 0;
        requested(&buffer, &buffer_size, &max_records);
        if (!buffer || buffer_size < MEMCPY_RECORD + KERNEL_RECORD) {
            buffer = NULL;
            return NULL;
        }
        /* A record of another kind opens each buffer: readers must skip it. */
        memset(buffer, 0, MEMCPY_RECORD);
        int kind = CUPTI_ACTIVITY_KIND_MEMCPY;
        memcpy(buffer, &kind, sizeof kind);
        buffer_used = MEMCPY_RECORD;
    }
    uint8_t *r = buffer + buffer_used;
    buffer_used += n;
    return r;
}

static uint64_t *stream_busy(uint32_t id) {
    for (int i = 0; i < nstreams; i++)
        if (streams[i].id == id) return &streams[i].busy_until;
    if (nstreams == MAX_STREAMS) return NULL;
    streams[nstreams].id = id;
    return &streams[nstreams++].busy_until;
}

static int kernel_index(const char *name) {
    for (int i = 0; i < nkernels; i++)
        if (strcmp(kernels[i].name, name) == 0) return i;
    if (nkernels == MAX_KERNELS) return -1;
    kernels[nkernels].name = strdup(name);
    return nkernels++;
}

API void fake_cupti_kernel_ran(const char *name, uint32_t stream_id, const unsigned grid[3],
                               const unsigned block[3], unsigned shared_mem) {
    uint8_t *full = NULL;
    size_t full_size = 0, full_used = 0;
    pthread_mutex_lock(&lock);
    int k = kernel_index(name);
    uint64_t *busy = stream_busy(stream_id);
    if (!kernel_kind || !completed || k < 0 || !busy) {
        pthread_mutex_unlock(&lock);
        return;
    }
    uint64_t ns = NS_PER_BLOCK * grid[0] * grid[1] * grid[2];
    uint64_t start = now();
    if (start < *busy) start = *busy;
    *busy = start + ns;
    uint8_t *r = room(KERNEL_RECORD, &full, &full_size, &full_used);
    if (r) {
        memset(r, 0, KERNEL_RECORD);
        CUpti_ActivityKernel_head h = {0};
        h.kind = kernel_kind;
        h.start = start;
        h.end = start + ns;
        h.completed = start + ns;
        h.deviceId = 0;
        h.contextId = 1;
        h.streamId = stream_id;
        h.gridX = (int32_t)grid[0], h.gridY = (int32_t)grid[1], h.gridZ = (int32_t)grid[2];
        h.blockX = (int32_t)block[0], h.blockY = (int32_t)block[1], h.blockZ = (int32_t)block[2];
        h.dynamicSharedMemory = (int32_t)shared_mem;
        /* the launch call's id while its callbacks are on, else one of its own */
        h.correlationId = api_in_flight ? api_in_flight
                                        : __atomic_add_fetch(&next_correlation, 1, __ATOMIC_RELAXED);
        h.gridId = h.correlationId;
        h.name = kernels[k].name;
        memcpy(r, &h, sizeof h);
        kernels[k].executions++;
        kernels[k].total_ns += ns;
    }
    pthread_mutex_unlock(&lock);
    hand_back(full, full_size, full_used);
}

API int fake_cupti_tally(int i, const char **name, unsigned long long *executions,
                         unsigned long long *total_ns) {
    pthread_mutex_lock(&lock);
    int ok = i >= 0 && i < nkernels;
    if (ok) {
        *name = kernels[i].name;
        *executions = kernels[i].executions;
        *total_ns = kernels[i].total_ns;
    }
    pthread_mutex_unlock(&lock);
    return ok;
}
