// The slice of the CUDA driver API kvproxy needs, loaded with dlopen at run
// time so that building needs no CUDA toolkit. Types and constants are the
// driver API's (cuda.h), restated here.
#ifndef PDROUTER_CUDA_DRIVER_H
#define PDROUTER_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#define CUDAG_IPC_HANDLE_SIZE 64

typedef struct {
	char reserved[CUDAG_IPC_HANDLE_SIZE];
} cudag_ipc_handle_t;

// cudag_load opens libcuda (path) and resolves every entry point; on
// failure it returns -1 and writes why into err. Then cudag_init runs cuInit.
int cudag_load(const char *path, char *err, size_t errlen);
int cudag_init(void);
const char *cudag_error_string(int res);

int cudag_device_count(int *n);
int cudag_ctx_retain(int ordinal, void **ctx);
int cudag_ctx_release(int ordinal);
int cudag_ctx_set_current(void *ctx);
int cudag_ctx_push(void *ctx);
void cudag_ctx_pop(void);

// Each call below pushes ctx around the driver call, so the caller's OS
// thread need not own it.
int cudag_ipc_open(void *ctx, const cudag_ipc_handle_t *h, uint64_t *ptr);
int cudag_ipc_close(void *ctx, uint64_t ptr);
int cudag_ipc_get(void *ctx, uint64_t ptr, cudag_ipc_handle_t *h);
int cudag_mem_alloc(void *ctx, size_t n, uint64_t *ptr);
int cudag_mem_free(void *ctx, uint64_t ptr);
int cudag_memcpy_htod(void *ctx, uint64_t dst, const void *src, size_t n);
int cudag_memcpy_dtoh(void *ctx, void *dst, uint64_t src, size_t n);
int cudag_memset8(void *ctx, uint64_t dst, unsigned char v, size_t n);
int cudag_address_range(void *ctx, uint64_t ptr, uint64_t *base, size_t *size);
// cudag_pointer_kind: 1 host/unknown to CUDA, 2 device, 4 unified (managed),
// with the device ordinal of device memory.
int cudag_pointer_kind(uint64_t ptr, int *kind, int *ordinal);

int cudag_mem_alloc_host(void *ctx, size_t n, void **p);
int cudag_mem_free_host(void *ctx, void *p);

// The batched copier: ns streams and the copy_runs kernel (copy.ptx).
int cudag_copier_create(void *ctx, const char *ptx, void **streams, unsigned ns, void **module, void **fn);
void cudag_copier_destroy(void *ctx, void *const *streams, unsigned ns, void *module);
int cudag_copy_runs(void *ctx, void *stream, void *fn, uint64_t desc, const uint64_t *runs,
		    unsigned n, unsigned grid, unsigned block, int nowait);
int cudag_memcpy_runs(void *ctx, void *const *streams, unsigned ns, const uint64_t *runs, unsigned n, int any);
int cudag_stream_wait(void *ctx, void *stream);

// Whether device a can map device b's memory (ordinals). Peer access
// itself comes with cuIpcOpenMemHandle's lazy flag.
int cudag_can_access_peer(int a, int b, int *ok);

#endif
