/* The slice of the CUDA driver (cuda.h) and runtime (cuda_runtime_api.h, driver_types.h,
 * vector_types.h, crt/host_runtime.h) ABI that the fake libcuda.so.1 and libcudart.so.13 export
 * and that cuda_app.c calls: written here from the published prototypes and struct layouts
 * (README.md says where each was checked), not copied from NVIDIA's headers. LP64 Linux only
 * (x86-64, aarch64): CUDAAPI and CUDARTAPI are empty there, so every function is a plain C
 * function with the platform's calling convention. */
#ifndef FAKE_CUDA_ABI_H
#define FAKE_CUDA_ABI_H

#include <stddef.h>

/* ---- driver API types (cuda.h) ---------------------------------------------------------- */

typedef int CUresult;                    /* enum cudaError_enum */
typedef int CUdevice;                    /* CUdevice_v1 */
typedef unsigned long long CUdeviceptr;  /* CUdeviceptr_v2: pointer-sized on LP64 */

typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUstream_st *CUstream;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;

typedef int CUjit_option;     /* enum CUjit_option_enum */
typedef int CUlibraryOption;  /* enum CUlibraryOption_enum */

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_IMAGE 200
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

#define CU_LAUNCH_ATTRIBUTE_COOPERATIVE 2
#define CU_LAUNCH_ATTRIBUTE_PRIORITY 8

/* CUlaunchAttributeValue: a 64-byte union whose largest-aligned member holds pointers. */
typedef union CUlaunchAttributeValue_union {
    char pad[64];
    int cooperative;
    int priority;
    void *align_as_pointer_;
} CUlaunchAttributeValue;

/* CUlaunchAttribute: id, padding up to 8 bytes, value (72 bytes in all). */
typedef struct CUlaunchAttribute_st {
    int id; /* CUlaunchAttributeID */
    char pad[8 - sizeof(int)];
    CUlaunchAttributeValue value;
} CUlaunchAttribute;

/* CUlaunchConfig (cuLaunchKernelEx): 7 unsigned ints, then (8-aligned) hStream at offset 32,
 * attrs at 40, numAttrs at 48; 56 bytes. */
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX;
    unsigned int gridDimY;
    unsigned int gridDimZ;
    unsigned int blockDimX;
    unsigned int blockDimY;
    unsigned int blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* CUDA_KERNEL_NODE_PARAMS (= _v2 since CUDA 12.0; taken by cuGraphAddKernelNode_v2). */
typedef struct CUDA_KERNEL_NODE_PARAMS_v2_st {
    CUfunction func;
    unsigned int gridDimX;
    unsigned int gridDimY;
    unsigned int gridDimZ;
    unsigned int blockDimX;
    unsigned int blockDimY;
    unsigned int blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
    CUkernel kern; /* used when func is NULL */
    CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS;

/* ---- runtime API types (driver_types.h, vector_types.h) --------------------------------- */

typedef int cudaError_t; /* enum cudaError */

struct dim3 {
    unsigned int x, y, z;
};
typedef struct dim3 dim3;
struct uint3 {
    unsigned int x, y, z;
};
typedef struct uint3 uint3;

typedef struct CUstream_st *cudaStream_t;       /* the same struct as the driver's CUstream */
typedef struct CUkern_st *cudaKernel_t;         /* the same struct as the driver's CUkernel */
typedef struct CUfunc_st *cudaFunction_t;       /* the same struct as the driver's CUfunction */
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphNode_st *cudaGraphNode_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

#define cudaSuccess 0
#define cudaErrorInvalidValue 1
#define cudaErrorMemoryAllocation 2
#define cudaErrorInitializationError 3
#define cudaErrorInvalidMemcpyDirection 21
#define cudaErrorInsufficientDriver 35
#define cudaErrorInvalidDeviceFunction 98
#define cudaErrorInvalidDevice 101
#define cudaErrorInvalidKernelImage 200
#define cudaErrorDeviceUninitialized 201
#define cudaErrorInvalidResourceHandle 400
#define cudaErrorSymbolNotFound 500

#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

#define cudaLaunchAttributePriority 8

typedef union cudaLaunchAttributeValue {
    char pad[64];
    int cooperative;
    int priority;
    void *align_as_pointer_;
} cudaLaunchAttributeValue;

typedef struct cudaLaunchAttribute_st {
    int id; /* cudaLaunchAttributeID */
    char pad[8 - sizeof(int)];
    cudaLaunchAttributeValue val;
} cudaLaunchAttribute;

/* cudaLaunchConfig_t (cudaLaunchKernelExC): gridDim at 0, blockDim at 12, dynamicSmemBytes
 * (size_t) at 24, stream at 32, attrs at 40, numAttrs at 48; 56 bytes. */
typedef struct cudaLaunchConfig_st {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;

/* struct cudaKernelNodeParams (cudaGraphAddKernelNode). */
struct cudaKernelNodeParams {
    void *func;
    dim3 gridDim;
    dim3 blockDim;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
};

/* __fatBinC_Wrapper_t, what nvcc's generated code hands to __cudaRegisterFatBinary. */
#define FATBINC_MAGIC 0x466243B1
typedef struct {
    int magic;
    int version;
    const unsigned long long *data;
    void *filename_or_fatbins;
} __fatBinC_Wrapper_t;

/* ---- driver API functions (the exported symbol names; cuda.h maps e.g. cuMemAlloc to
 * cuMemAlloc_v2 with #define) -------------------------------------------------------------- */

CUresult cuInit(unsigned int Flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetCount(int *count);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxSynchronize(void);

CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleUnload(CUmodule hmod);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions);
CUresult cuLibraryUnload(CUlibrary library);
CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name);
CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel);
CUresult cuKernelGetName(const char **name, CUkernel hfunc);
CUresult cuFuncGetName(const char **name, CUfunction hfunc);
CUresult cuFuncGetModule(CUmodule *hmod, CUfunction hfunc);

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra);
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX,
                             unsigned int blockDimY, unsigned int blockDimZ,
                             unsigned int sharedMemBytes, CUstream hStream, void **kernelParams,
                             void **extra);
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra);

CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags);
CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                 const CUgraphNode *dependencies, size_t numDependencies,
                                 const CUDA_KERNEL_NODE_PARAMS *nodeParams);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
CUresult cuGraphDestroy(CUgraph hGraph);

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream);
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream);

/* ---- runtime API functions --------------------------------------------------------------- */

cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
cudaError_t cudaDriverGetVersion(int *driverVersion);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorName(cudaError_t error);
const char *cudaGetErrorString(cudaError_t error);

cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                             size_t sharedMem, cudaStream_t stream);
cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                  size_t sharedMem, cudaStream_t stream);
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args);
cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t *config, const void *func,
                                     void **args);
cudaError_t cudaGetKernel(cudaKernel_t *kernelPtr, const void *entryFuncAddr);
cudaError_t cudaGetFuncBySymbol(cudaFunction_t *functionPtr, const void *symbolPtr);
cudaError_t cudaFuncGetName(const char **name, const void *func);

cudaError_t cudaGraphCreate(cudaGraph_t *pGraph, unsigned int flags);
cudaError_t cudaGraphAddKernelNode(cudaGraphNode_t *pGraphNode, cudaGraph_t graph,
                                   const cudaGraphNode_t *pDependencies, size_t numDependencies,
                                   const struct cudaKernelNodeParams *pNodeParams);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
cudaError_t cudaGraphLaunch_ptsz(cudaGraphExec_t graphExec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

cudaError_t cudaMalloc(void **devPtr, size_t size);
cudaError_t cudaFree(void *devPtr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count,
                                 enum cudaMemcpyKind kind, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t *pStream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize(void);

/* What nvcc-generated host code calls (crt/host_runtime.h). */
void **__cudaRegisterFatBinary(void *fatCubin);
void __cudaRegisterFatBinaryEnd(void **fatCubinHandle);
void __cudaUnregisterFatBinary(void **fatCubinHandle);
void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                            const char *deviceName, int thread_limit, uint3 *tid, uint3 *bid,
                            dim3 *bDim, dim3 *gDim, int *wSize);
cudaError_t __cudaGetKernel(cudaKernel_t *kernelPtr, const void *hostFun);
unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, size_t sharedMem,
                                     struct CUstream_st *stream);
cudaError_t __cudaPopCallConfiguration(dim3 *gridDim, dim3 *blockDim, size_t *sharedMem,
                                       void *stream);
cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args,
                               size_t sharedMem, cudaStream_t stream);
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim,
                                    void **args, size_t sharedMem, cudaStream_t stream);

/* ---- test-only: what the fake libcuda saw (exported object `fake_cuda_stats`) ----------- */

struct fake_cuda_stats {
    unsigned long long cuLaunchKernel_calls, cuLaunchKernel_ok;
    unsigned long long cuLaunchKernelEx_calls, cuLaunchKernelEx_ok;
    unsigned long long cuGraphLaunch_calls, cuGraphLaunch_ok, graph_kernel_nodes_run;
    unsigned long long memcpy_htod_calls, memcpy_htod_bytes;
    unsigned long long memcpy_dtoh_calls, memcpy_dtoh_bytes;
    unsigned long long memcpy_dtod_calls, memcpy_dtod_bytes;
    unsigned long long mem_alloc_calls, mem_alloc_bytes, mem_free_calls;
    unsigned long long module_loads, library_loads;
    unsigned long long cuModuleGetFunction_calls, cuLibraryGetKernel_calls;
    unsigned long long cuKernelGetFunction_calls;
    unsigned long long ctx_synchronize_calls, stream_synchronize_calls;
};

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(void *) == 8, "LP64 only");
_Static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes");
_Static_assert(offsetof(CUlaunchConfig, sharedMemBytes) == 24, "CUlaunchConfig layout");
_Static_assert(offsetof(CUlaunchConfig, hStream) == 32, "CUlaunchConfig layout");
_Static_assert(offsetof(CUlaunchConfig, attrs) == 40, "CUlaunchConfig layout");
_Static_assert(offsetof(CUlaunchConfig, numAttrs) == 48, "CUlaunchConfig layout");
_Static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig layout");
_Static_assert(sizeof(dim3) == 12, "dim3 layout");
_Static_assert(offsetof(cudaLaunchConfig_t, blockDim) == 12, "cudaLaunchConfig_t layout");
_Static_assert(offsetof(cudaLaunchConfig_t, dynamicSmemBytes) == 24, "cudaLaunchConfig_t layout");
_Static_assert(offsetof(cudaLaunchConfig_t, stream) == 32, "cudaLaunchConfig_t layout");
_Static_assert(offsetof(cudaLaunchConfig_t, attrs) == 40, "cudaLaunchConfig_t layout");
_Static_assert(offsetof(cudaLaunchConfig_t, numAttrs) == 48, "cudaLaunchConfig_t layout");
_Static_assert(sizeof(cudaLaunchConfig_t) == 56, "cudaLaunchConfig_t layout");
_Static_assert(sizeof(cudaLaunchAttribute) == 72, "cudaLaunchAttribute is 72 bytes");
_Static_assert(offsetof(CUDA_KERNEL_NODE_PARAMS, kernelParams) == 40, "kernel node layout");
_Static_assert(sizeof(CUDA_KERNEL_NODE_PARAMS) == 72, "kernel node layout");
_Static_assert(offsetof(struct cudaKernelNodeParams, sharedMemBytes) == 32, "node layout");
_Static_assert(sizeof(struct cudaKernelNodeParams) == 56, "node layout");
#endif

#endif
