// C helpers for the ucx package: UCX parameter unions, UCS_PTR_* macros and
// callbacks that must not call into Go.
#ifndef PDROUTER_UCX_GLUE_H
#define PDROUTER_UCX_GLUE_H

#include <stdint.h>
#include <stddef.h>
#include <ucp/api/ucp.h>

// One RMA descriptor; the layout matches the Go type Op.
typedef struct {
	uint64_t loff;
	uint64_t roff;
	uint64_t len;
} ucxg_op_t;

// Endpoint wrapper: the error callback records the first error here.
typedef struct {
	ucp_ep_h ep;
	volatile ucs_status_t err;
} ucxg_ep_t;

#define UCXG_CONN_QUEUE 64

// Listener wrapper: connection requests queue up here until Accept.
typedef struct {
	ucp_listener_h l;
	ucp_conn_request_h q[UCXG_CONN_QUEUE];
	unsigned head, count;
} ucxg_listener_t;

ucs_status_t ucxg_context_create(char **keys, char **vals, int n, ucp_context_h *out);
ucs_status_t ucxg_worker_create(ucp_context_h ctx, int thread_mode, ucp_worker_h *out);
int ucxg_wait_fd(int fd, int timeout_ms);

ucs_status_t ucxg_listener_create(ucp_worker_h w, const char *ip, uint16_t port, ucxg_listener_t **out);
ucs_status_t ucxg_listener_port(ucxg_listener_t *l, uint16_t *port);
ucp_conn_request_h ucxg_listener_pop(ucxg_listener_t *l);
void ucxg_listener_destroy(ucxg_listener_t *l);

ucs_status_t ucxg_ep_connect(ucp_worker_h w, int peer_errors, const char *ip, uint16_t port, ucxg_ep_t **out);
ucs_status_t ucxg_ep_accept(ucp_worker_h w, int peer_errors, ucp_conn_request_h req, ucxg_ep_t **out);
ucs_status_t ucxg_ep_by_address(ucp_worker_h w, int peer_errors, const void *addr, ucxg_ep_t **out);
void *ucxg_ep_close(ucxg_ep_t *e, int force, ucs_status_t *st);
void ucxg_ep_free(ucxg_ep_t *e);

// UCXG_HAS_MEMORY_TYPE: ucp_mem_map takes the memory type (UCX 1.10+); older
// UCX registers host memory only and ucxg_mem_map refuses other types.
#if UCP_API_VERSION >= UCP_VERSION(1, 10)
#define UCXG_HAS_MEMORY_TYPE 1
#else
#define UCXG_HAS_MEMORY_TYPE 0
#endif

ucs_status_t ucxg_mem_map(ucp_context_h ctx, uintptr_t addr, size_t len, int allocate,
			  int mem_type, ucp_mem_h *memh, void **base);
uint64_t ucxg_context_mem_types(ucp_context_h ctx);
int ucxg_context_info(ucp_context_h ctx, char **out, size_t *len);

void *ucxg_rma_batch(ucxg_ep_t *e, int get, char *lbase, ucp_mem_h memh, uint64_t rbase,
		     ucp_rkey_h rkey, const ucxg_op_t *ops, size_t n, ucs_status_t *st);
void *ucxg_ep_flush(ucxg_ep_t *e, ucs_status_t *st);
void *ucxg_worker_flush(ucp_worker_h w, ucs_status_t *st);
ucs_status_t ucxg_request_status(void *req);

ucs_status_t ucxg_set_am_handler(ucp_worker_h w, uint16_t id, uintptr_t handle);
ucs_status_t ucxg_clear_am_handler(ucp_worker_h w, uint16_t id);
void *ucxg_am_send(ucxg_ep_t *e, uint16_t id, const void *hdr, size_t hlen, const void *data,
		   size_t dlen, ucs_status_t *st);
int64_t ucxg_am_buffers(void);
char *ucxg_ep_info(ucxg_ep_t *e);

#endif
