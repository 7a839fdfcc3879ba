/* A stand-in for NVIDIA's management library (libnvidia-ml.so.1) for machines without a GPU:
   the entry points tracer's GPU metrics read, with NVML's ABI (nvml.h: return codes, handle
   type, nvmlUtilization_t, the versioned nvmlMemory_v2_t, milliwatts, MHz, degrees C).
   Two devices. Device d's GPU utilization cycles through 20, 40, 60 % on successive reads;
   every other metric is constant:
     memory utilization 10 + d %, memory used (2048 + 1024 d) MiB, power 123456 mW,
     SM clock 1410 MHz, temperature 55 + d °C. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
       NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_INSUFFICIENT_SIZE = 7,
       NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25 };
enum { NVML_CLOCK_SM = 1 };
enum { NVML_TEMPERATURE_GPU = 0 };

struct nvmlDevice_st { unsigned int index; atomic_uint reads; };
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

static struct nvmlDevice_st devices[2] = { { 0, 0 }, { 1, 0 } };
static atomic_int initialised;

static nvmlDevice_t checked(nvmlDevice_t d) {
    return (d == &devices[0] || d == &devices[1]) && initialised > 0 ? d : NULL;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { initialised++; return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { return nvmlInit_v2(); }
EXPORT nvmlReturn_t nvmlShutdown(void) {
    if (initialised <= 0) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (initialised <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 2;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (initialised <= 0) return NVML_ERROR_UNINITIALIZED;
    if (index >= 2 || !device) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    nvmlDevice_t d = checked(device);
    if (!d || !name) return NVML_ERROR_INVALID_ARGUMENT;
    if ((unsigned)snprintf(name, length, "Fake GPU %u", d->index) >= length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *u) {
    nvmlDevice_t d = checked(device);
    if (!d || !u) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = atomic_fetch_add(&d->reads, 1);
    u->gpu = 20 * (1 + n % 3);
    u->memory = 10 + d->index;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *m) {
    nvmlDevice_t d = checked(device);
    if (!d || !m) return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML_STRUCT_VERSION(Memory, 2), as nvml.h defines it. */
    if (m->version != (unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = 80ull << 30;
    m->reserved = 512ull << 20;
    m->used = (2048ull + 1024ull * d->index) << 20;
    m->free = m->total - m->reserved - m->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *mw) {
    if (!checked(device) || !mw) return NVML_ERROR_INVALID_ARGUMENT;
    *mw = 123456;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *mhz) {
    if (!checked(device) || !mhz) return NVML_ERROR_INVALID_ARGUMENT;
    if (type != NVML_CLOCK_SM) return NVML_ERROR_NOT_SUPPORTED;
    *mhz = 1410;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *c) {
    nvmlDevice_t d = checked(device);
    if (!d || !c) return NVML_ERROR_INVALID_ARGUMENT;
    if (sensor != NVML_TEMPERATURE_GPU) return NVML_ERROR_NOT_SUPPORTED;
    *c = 55 + d->index;
    return NVML_SUCCESS;
}
