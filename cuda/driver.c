#include "driver.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef void *CUcontext;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1

typedef struct {
	CUresult (*init)(unsigned);
	CUresult (*get_error_string)(CUresult, const char **);
	CUresult (*device_get_count)(int *);
	CUresult (*device_get)(int *, int);
	CUresult (*primary_retain)(CUcontext *, int);
	CUresult (*primary_release)(int);
	CUresult (*ctx_set_current)(CUcontext);
	CUresult (*ctx_push)(CUcontext);
	CUresult (*ctx_pop)(CUcontext *);
	CUresult (*ipc_open)(CUdeviceptr *, cudag_ipc_handle_t, unsigned);
	CUresult (*ipc_close)(CUdeviceptr);
	CUresult (*ipc_get)(cudag_ipc_handle_t *, CUdeviceptr);
	CUresult (*mem_alloc)(CUdeviceptr *, size_t);
	CUresult (*mem_free)(CUdeviceptr);
	CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t);
	CUresult (*memcpy_dtoh)(void *, CUdeviceptr, size_t);
	CUresult (*memset8)(CUdeviceptr, unsigned char, size_t);
	CUresult (*address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
	CUresult (*pointer_attr)(void *, int, CUdeviceptr);
	CUresult (*stream_create)(void **, unsigned);
	CUresult (*stream_destroy)(void *);
	CUresult (*stream_sync)(void *);
	CUresult (*module_load_data)(void **, const void *);
	CUresult (*module_unload)(void *);
	CUresult (*module_get_function)(void **, void *, const char *);
	CUresult (*launch_kernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
				  unsigned, void *, void **, void **);
	CUresult (*memcpy_dtod_async)(CUdeviceptr, CUdeviceptr, size_t, void *);
	CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, void *);
	CUresult (*mem_alloc_host)(void **, size_t);
	CUresult (*mem_free_host)(void *);
	CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, void *);
	CUresult (*can_access_peer)(int *, int, int);
} table_t;

static table_t cu;

// Entry points by name, as offsets into table_t; the first name found wins
// (the _v2 names are the current ABI of the calls that have them).
#define AT(f) offsetof(table_t, f)
static const struct {
	size_t at;
	const char *names[2];
} syms[] = {
	{AT(init), {"cuInit", NULL}},
	{AT(get_error_string), {"cuGetErrorString", NULL}},
	{AT(device_get_count), {"cuDeviceGetCount", NULL}},
	{AT(device_get), {"cuDeviceGet", NULL}},
	{AT(primary_retain), {"cuDevicePrimaryCtxRetain", NULL}},
	{AT(primary_release), {"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"}},
	{AT(ctx_set_current), {"cuCtxSetCurrent", NULL}},
	{AT(ctx_push), {"cuCtxPushCurrent_v2", "cuCtxPushCurrent"}},
	{AT(ctx_pop), {"cuCtxPopCurrent_v2", "cuCtxPopCurrent"}},
	{AT(ipc_open), {"cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"}},
	{AT(ipc_close), {"cuIpcCloseMemHandle", NULL}},
	{AT(ipc_get), {"cuIpcGetMemHandle", NULL}},
	{AT(mem_alloc), {"cuMemAlloc_v2", "cuMemAlloc"}},
	{AT(mem_free), {"cuMemFree_v2", "cuMemFree"}},
	{AT(memcpy_htod), {"cuMemcpyHtoD_v2", "cuMemcpyHtoD"}},
	{AT(memcpy_dtoh), {"cuMemcpyDtoH_v2", "cuMemcpyDtoH"}},
	{AT(memset8), {"cuMemsetD8_v2", "cuMemsetD8"}},
	{AT(address_range), {"cuMemGetAddressRange_v2", "cuMemGetAddressRange"}},
	{AT(pointer_attr), {"cuPointerGetAttribute", NULL}},
	{AT(stream_create), {"cuStreamCreate", NULL}},
	{AT(stream_destroy), {"cuStreamDestroy_v2", "cuStreamDestroy"}},
	{AT(stream_sync), {"cuStreamSynchronize", NULL}},
	{AT(module_load_data), {"cuModuleLoadData", NULL}},
	{AT(module_unload), {"cuModuleUnload", NULL}},
	{AT(module_get_function), {"cuModuleGetFunction", NULL}},
	{AT(launch_kernel), {"cuLaunchKernel", NULL}},
	{AT(memcpy_dtod_async), {"cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"}},
	{AT(memcpy_htod_async), {"cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"}},
	{AT(mem_alloc_host), {"cuMemAllocHost_v2", "cuMemAllocHost"}},
	{AT(mem_free_host), {"cuMemFreeHost", NULL}},
	{AT(memcpy_async), {"cuMemcpyAsync", NULL}},
	{AT(can_access_peer), {"cuDeviceCanAccessPeer", NULL}},
};

// cudag_load fills a table and installs it only when every entry point
// resolved, so a failed load leaves an earlier good one in place.
int cudag_load(const char *path, char *err, size_t errlen)
{
	table_t t;
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		snprintf(err, errlen, "%s", dlerror());
		return -1;
	}
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *fn = NULL;
		for (int j = 0; j < 2 && fn == NULL && syms[i].names[j] != NULL; j++) {
			fn = dlsym(h, syms[i].names[j]);
		}
		if (fn == NULL) {
			snprintf(err, errlen, "%s has no %s", path, syms[i].names[0]);
			dlclose(h);
			return -1;
		}
		memcpy((char *)&t + syms[i].at, &fn, sizeof(fn));
	}
	cu = t;
	return 0; // h stays open for the life of the process
}

int cudag_init(void)
{
	return cu.init(0);
}

const char *cudag_error_string(int res)
{
	const char *s = NULL;
	if (cu.get_error_string == NULL || cu.get_error_string(res, &s) != CUDA_SUCCESS || s == NULL) {
		return "unknown CUDA error";
	}
	return s;
}

int cudag_device_count(int *n)
{
	return cu.device_get_count(n);
}

int cudag_ctx_retain(int ordinal, void **ctx)
{
	int dev;
	CUresult r = cu.device_get(&dev, ordinal);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	return cu.primary_retain(ctx, dev);
}

int cudag_ctx_release(int ordinal)
{
	int dev;
	CUresult r = cu.device_get(&dev, ordinal);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	return cu.primary_release(dev);
}

int cudag_ctx_set_current(void *ctx)
{
	return cu.ctx_set_current(ctx);
}

// IN_CTX runs one driver call with ctx pushed on this thread.
#define IN_CTX(ctx, call)                              \
	do {                                           \
		CUresult r_ = cu.ctx_push(ctx);        \
		if (r_ != CUDA_SUCCESS) {              \
			return r_;                     \
		}                                      \
		r_ = (call);                           \
		CUcontext popped_;                     \
		cu.ctx_pop(&popped_);                  \
		return r_;                             \
	} while (0)

int cudag_ipc_open(void *ctx, const cudag_ipc_handle_t *h, uint64_t *ptr)
{
	IN_CTX(ctx, cu.ipc_open(ptr, *h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
}

int cudag_ipc_close(void *ctx, uint64_t ptr)
{
	IN_CTX(ctx, cu.ipc_close(ptr));
}

int cudag_ipc_get(void *ctx, uint64_t ptr, cudag_ipc_handle_t *h)
{
	IN_CTX(ctx, cu.ipc_get(h, ptr));
}

int cudag_mem_alloc(void *ctx, size_t n, uint64_t *ptr)
{
	IN_CTX(ctx, cu.mem_alloc(ptr, n));
}

int cudag_mem_free(void *ctx, uint64_t ptr)
{
	IN_CTX(ctx, cu.mem_free(ptr));
}

int cudag_memcpy_htod(void *ctx, uint64_t dst, const void *src, size_t n)
{
	IN_CTX(ctx, cu.memcpy_htod(dst, src, n));
}

int cudag_memcpy_dtoh(void *ctx, void *dst, uint64_t src, size_t n)
{
	IN_CTX(ctx, cu.memcpy_dtoh(dst, src, n));
}

int cudag_memset8(void *ctx, uint64_t dst, unsigned char v, size_t n)
{
	IN_CTX(ctx, cu.memset8(dst, v, n));
}

int cudag_address_range(void *ctx, uint64_t ptr, uint64_t *base, size_t *size)
{
	IN_CTX(ctx, cu.address_range(base, size, ptr));
}

int cudag_pointer_kind(uint64_t ptr, int *kind, int *ordinal)
{
	unsigned int t = 0;
	CUresult r = cu.pointer_attr(&t, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr);
	if (r == CUDA_ERROR_INVALID_VALUE) {
		*kind = 1; // not CUDA's: plain host memory
		*ordinal = -1;
		return CUDA_SUCCESS;
	}
	if (r != CUDA_SUCCESS) {
		return r;
	}
	*kind = (int)t;
	*ordinal = -1;
	if (t == 2) {
		int o = -1;
		r = cu.pointer_attr(&o, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
		*ordinal = o;
	}
	return r;
}

int cudag_ctx_push(void *ctx)
{
	return cu.ctx_push(ctx);
}

void cudag_ctx_pop(void)
{
	CUcontext c;
	cu.ctx_pop(&c);
}

#define CU_STREAM_NON_BLOCKING 1

int cudag_copier_create(void *ctx, const char *ptx, void **streams, unsigned ns, void **module, void **fn)
{
	CUresult r = cu.ctx_push(ctx);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	CUcontext popped;
	unsigned made = 0;
	for (; made < ns && r == CUDA_SUCCESS; made++) {
		r = cu.stream_create(&streams[made], CU_STREAM_NON_BLOCKING);
	}
	if (r != CUDA_SUCCESS) {
		made--; // the failed one holds nothing
	} else {
		r = cu.module_load_data(module, ptx);
		if (r == CUDA_SUCCESS) {
			r = cu.module_get_function(fn, *module, "copy_runs");
			if (r != CUDA_SUCCESS) {
				cu.module_unload(*module);
			}
		}
	}
	if (r != CUDA_SUCCESS) {
		while (made > 0) {
			cu.stream_destroy(streams[--made]);
		}
	}
	cu.ctx_pop(&popped);
	return r;
}

void cudag_copier_destroy(void *ctx, void *const *streams, unsigned ns, void *module)
{
	if (cu.ctx_push(ctx) != CUDA_SUCCESS) {
		return;
	}
	for (unsigned i = 0; i < ns; i++) {
		cu.stream_destroy(streams[i]);
	}
	cu.module_unload(module);
	CUcontext popped;
	cu.ctx_pop(&popped);
}

// cudag_copy_runs moves n runs (src, dst, len triples at host address
// runs) with the kernel (desc: device buffer of at least n triples) on
// stream, then waits unless nowait is set.
int cudag_copy_runs(void *ctx, void *stream, void *fn, uint64_t desc, const uint64_t *runs,
		    unsigned n, unsigned grid, unsigned block, int nowait)
{
	CUresult r = cu.ctx_push(ctx);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	r = cu.memcpy_htod_async(desc, runs, (size_t)n * 24, stream);
	if (r == CUDA_SUCCESS) {
		void *args[] = {&desc, &n};
		r = cu.launch_kernel(fn, grid, 1, 1, block, 1, 1, 0, stream, args, NULL);
	}
	if (!nowait || r != CUDA_SUCCESS) {
		CUresult s = cu.stream_sync(stream);
		if (r == CUDA_SUCCESS) {
			r = s;
		}
	}
	CUcontext popped;
	cu.ctx_pop(&popped);
	return r;
}

// cudag_memcpy_runs moves n runs with one cuMemcpyDtoDAsync each (any:
// cuMemcpyAsync, which also takes pinned host addresses), round robin over
// ns streams (one copy's tail overlaps the next one's start), and waits
// for all of them.
int cudag_memcpy_runs(void *ctx, void *const *streams, unsigned ns, const uint64_t *runs, unsigned n, int any)
{
	CUresult r = cu.ctx_push(ctx);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	for (unsigned i = 0; i < n && r == CUDA_SUCCESS; i++) {
		if (any) {
			r = cu.memcpy_async(runs[3 * i + 1], runs[3 * i], runs[3 * i + 2], streams[i % ns]);
		} else {
			r = cu.memcpy_dtod_async(runs[3 * i + 1], runs[3 * i], runs[3 * i + 2], streams[i % ns]);
		}
	}
	for (unsigned i = 0; i < ns; i++) {
		CUresult s = cu.stream_sync(streams[i]);
		if (r == CUDA_SUCCESS) {
			r = s;
		}
	}
	CUcontext popped;
	cu.ctx_pop(&popped);
	return r;
}

int cudag_stream_wait(void *ctx, void *stream)
{
	IN_CTX(ctx, cu.stream_sync(stream));
}

int cudag_mem_alloc_host(void *ctx, size_t n, void **p)
{
	IN_CTX(ctx, cu.mem_alloc_host(p, n));
}

int cudag_mem_free_host(void *ctx, void *p)
{
	IN_CTX(ctx, cu.mem_free_host(p));
}

int cudag_can_access_peer(int a, int b, int *ok)
{
	int da, db;
	CUresult r = cu.device_get(&da, a);
	if (r == CUDA_SUCCESS) {
		r = cu.device_get(&db, b);
	}
	if (r == CUDA_SUCCESS) {
		r = cu.can_access_peer(ok, da, db);
	}
	return r;
}
