#include "glue.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

// Implemented in Go (callbacks.go).
extern ucs_status_t ucxgoAMRecv(uintptr_t handle, void *hdr, size_t hlen, void *data, size_t len);

static int64_t am_buffers; // outstanding AM send copies, for leak checks

ucs_status_t ucxg_context_create(char **keys, char **vals, int n, ucp_context_h *out)
{
	ucp_config_t *cfg;
	ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
	if (st != UCS_OK) {
		return st;
	}
	for (int i = 0; i < n; i++) {
		st = ucp_config_modify(cfg, keys[i], vals[i]);
		if (st != UCS_OK) {
			ucp_config_release(cfg);
			return st;
		}
	}
	ucp_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_PARAM_FIELD_FEATURES;
	p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
	st = ucp_init(&p, cfg, out);
	ucp_config_release(cfg);
	return st;
}

ucs_status_t ucxg_worker_create(ucp_context_h ctx, int thread_mode, ucp_worker_h *out)
{
	ucp_worker_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
	p.thread_mode = (ucs_thread_mode_t)thread_mode;
	p.events = UCP_WAKEUP_RMA | UCP_WAKEUP_TX | UCP_WAKEUP_RX;
	return ucp_worker_create(ctx, &p, out);
}

// ucxg_wait_fd polls fd for input: 1 readable, 0 timeout or interrupted,
// -1 error. A signal is no error: the Go runtime signals its threads (e.g.
// SIGURG preemption racing with the cgo call) and poll never restarts, and
// the caller progresses the worker after every wakeup anyway.
int ucxg_wait_fd(int fd, int timeout_ms)
{
	struct pollfd pfd = {.fd = fd, .events = POLLIN};
	int r = poll(&pfd, 1, timeout_ms);
	if (r < 0 && errno == EINTR) {
		return 0;
	}
	return r < 0 ? -1 : r;
}

static int fill_sockaddr(struct sockaddr_storage *ss, const char *ip, uint16_t port)
{
	memset(ss, 0, sizeof(*ss));
	struct sockaddr_in *in4 = (struct sockaddr_in *)ss;
	if (inet_pton(AF_INET, ip, &in4->sin_addr) == 1) {
		in4->sin_family = AF_INET;
		in4->sin_port = htons(port);
		return sizeof(*in4);
	}
	struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
	if (inet_pton(AF_INET6, ip, &in6->sin6_addr) == 1) {
		in6->sin6_family = AF_INET6;
		in6->sin6_port = htons(port);
		return sizeof(*in6);
	}
	return -1;
}

static void conn_cb(ucp_conn_request_h req, void *arg)
{
	ucxg_listener_t *l = arg;
	if (l->count == UCXG_CONN_QUEUE) {
		ucp_listener_reject(l->l, req);
		return;
	}
	l->q[(l->head + l->count) % UCXG_CONN_QUEUE] = req;
	l->count++;
}

ucs_status_t ucxg_listener_create(ucp_worker_h w, const char *ip, uint16_t port, ucxg_listener_t **out)
{
	struct sockaddr_storage ss;
	int len = fill_sockaddr(&ss, ip, port);
	if (len < 0) {
		return UCS_ERR_INVALID_ADDR;
	}
	ucxg_listener_t *l = calloc(1, sizeof(*l));
	if (l == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_listener_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
	p.sockaddr.addr = (struct sockaddr *)&ss;
	p.sockaddr.addrlen = len;
	p.conn_handler.cb = conn_cb;
	p.conn_handler.arg = l;
	ucs_status_t st = ucp_listener_create(w, &p, &l->l);
	if (st != UCS_OK) {
		free(l);
		return st;
	}
	*out = l;
	return UCS_OK;
}

ucs_status_t ucxg_listener_port(ucxg_listener_t *l, uint16_t *port)
{
	ucp_listener_attr_t a;
	a.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
	ucs_status_t st = ucp_listener_query(l->l, &a);
	if (st != UCS_OK) {
		return st;
	}
	if (a.sockaddr.ss_family == AF_INET) {
		*port = ntohs(((struct sockaddr_in *)&a.sockaddr)->sin_port);
	} else {
		*port = ntohs(((struct sockaddr_in6 *)&a.sockaddr)->sin6_port);
	}
	return UCS_OK;
}

ucp_conn_request_h ucxg_listener_pop(ucxg_listener_t *l)
{
	if (l->count == 0) {
		return NULL;
	}
	ucp_conn_request_h r = l->q[l->head];
	l->head = (l->head + 1) % UCXG_CONN_QUEUE;
	l->count--;
	return r;
}

void ucxg_listener_destroy(ucxg_listener_t *l)
{
	ucp_conn_request_h r;
	while ((r = ucxg_listener_pop(l)) != NULL) {
		ucp_listener_reject(l->l, r);
	}
	ucp_listener_destroy(l->l);
	free(l);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t st)
{
	ucxg_ep_t *e = arg;
	(void)ep;
	if (e->err == UCS_OK) {
		e->err = st;
	}
}

static ucs_status_t ep_create(ucp_worker_h w, int peer_errors, ucp_ep_params_t *p, ucxg_ep_t **out)
{
	ucxg_ep_t *e = calloc(1, sizeof(*e));
	if (e == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	p->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
	p->err_mode = UCP_ERR_HANDLING_MODE_NONE;
	if (peer_errors) {
		p->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
		p->err_mode = UCP_ERR_HANDLING_MODE_PEER;
		p->err_handler.cb = ep_err_cb;
		p->err_handler.arg = e;
	}
	ucs_status_t st = ucp_ep_create(w, p, &e->ep);
	if (st != UCS_OK) {
		free(e);
		return st;
	}
	*out = e;
	return UCS_OK;
}

ucs_status_t ucxg_ep_connect(ucp_worker_h w, int peer_errors, const char *ip, uint16_t port, ucxg_ep_t **out)
{
	struct sockaddr_storage ss;
	int len = fill_sockaddr(&ss, ip, port);
	if (len < 0) {
		return UCS_ERR_INVALID_ADDR;
	}
	ucp_ep_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
	p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
	p.sockaddr.addr = (struct sockaddr *)&ss;
	p.sockaddr.addrlen = len;
	return ep_create(w, peer_errors, &p, out);
}

ucs_status_t ucxg_ep_accept(ucp_worker_h w, int peer_errors, ucp_conn_request_h req, ucxg_ep_t **out)
{
	ucp_ep_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
	p.conn_request = req;
	return ep_create(w, peer_errors, &p, out);
}

ucs_status_t ucxg_ep_by_address(ucp_worker_h w, int peer_errors, const void *addr, ucxg_ep_t **out)
{
	ucp_ep_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
	p.address = addr;
	return ep_create(w, peer_errors, &p, out);
}

static void *status_ptr(ucs_status_ptr_t r, ucs_status_t *st)
{
	if (r == NULL) {
		*st = UCS_OK;
		return NULL;
	}
	if (UCS_PTR_IS_ERR(r)) {
		*st = UCS_PTR_STATUS(r);
		return NULL;
	}
	*st = UCS_INPROGRESS;
	return r;
}

void *ucxg_ep_close(ucxg_ep_t *e, int force, ucs_status_t *st)
{
	ucp_request_param_t p;
	memset(&p, 0, sizeof(p));
	p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
	return status_ptr(ucp_ep_close_nbx(e->ep, &p), st);
}

void ucxg_ep_free(ucxg_ep_t *e)
{
	free(e);
}

ucs_status_t ucxg_mem_map(ucp_context_h ctx, uintptr_t addr, size_t len, int allocate,
			  int mem_type, ucp_mem_h *memh, void **base)
{
	ucp_mem_map_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
		       UCP_MEM_MAP_PARAM_FIELD_FLAGS;
	p.address = (void *)addr;
	p.length = len;
	p.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
	if (mem_type != UCS_MEMORY_TYPE_HOST) {
#if UCXG_HAS_MEMORY_TYPE
		p.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
		p.memory_type = (ucs_memory_type_t)mem_type;
#else
		return UCS_ERR_UNSUPPORTED;
#endif
	}
	ucs_status_t st = ucp_mem_map(ctx, &p, memh);
	if (st != UCS_OK) {
		return st;
	}
	ucp_mem_attr_t a;
	a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
	st = ucp_mem_query(*memh, &a);
	if (st != UCS_OK) {
		ucp_mem_unmap(ctx, *memh);
		return st;
	}
	*base = a.address;
	return UCS_OK;
}

// ucxg_context_mem_types returns the bit mask of ucs_memory_type_t values
// the context's transports can register (0 if the query fails).
uint64_t ucxg_context_mem_types(ucp_context_h ctx)
{
	ucp_context_attr_t a;
	a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
	if (ucp_context_query(ctx, &a) != UCS_OK) {
		return 0;
	}
	return a.memory_types;
}

// ucxg_rma_batch posts one put (or get) per descriptor and keeps only the
// last pending request: earlier ones are released and complete in the
// background, so the caller tracks completion with a flush.
void *ucxg_rma_batch(ucxg_ep_t *e, int get, char *lbase, ucp_mem_h memh, uint64_t rbase,
		     ucp_rkey_h rkey, const ucxg_op_t *ops, size_t n, ucs_status_t *st)
{
	ucp_request_param_t p;
	p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
	p.memh = memh;
	void *last = NULL;
	for (size_t i = 0; i < n; i++) {
		ucs_status_ptr_t r;
		if (get) {
			r = ucp_get_nbx(e->ep, lbase + ops[i].loff, ops[i].len, rbase + ops[i].roff,
					rkey, &p);
		} else {
			r = ucp_put_nbx(e->ep, lbase + ops[i].loff, ops[i].len, rbase + ops[i].roff,
					rkey, &p);
		}
		if (r == NULL) {
			continue;
		}
		if (UCS_PTR_IS_ERR(r)) {
			if (last != NULL) {
				ucp_request_free(last);
			}
			*st = UCS_PTR_STATUS(r);
			return NULL;
		}
		if (last != NULL) {
			ucp_request_free(last);
		}
		last = r;
	}
	*st = last == NULL ? UCS_OK : UCS_INPROGRESS;
	return last;
}

void *ucxg_ep_flush(ucxg_ep_t *e, ucs_status_t *st)
{
	ucp_request_param_t p;
	p.op_attr_mask = 0;
	return status_ptr(ucp_ep_flush_nbx(e->ep, &p), st);
}

void *ucxg_worker_flush(ucp_worker_h w, ucs_status_t *st)
{
	ucp_request_param_t p;
	p.op_attr_mask = 0;
	return status_ptr(ucp_worker_flush_nbx(w, &p), st);
}

ucs_status_t ucxg_request_status(void *req)
{
	return ucp_request_check_status(req);
}

static ucs_status_t am_cb(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
			  const ucp_am_recv_param_t *param)
{
	if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
		// Our senders always use eager; a rendezvous message is not ours.
		return UCS_OK;
	}
	return ucxgoAMRecv((uintptr_t)arg, (void *)hdr, hlen, data, len);
}

static ucs_status_t set_am(ucp_worker_h w, uint16_t id, ucp_am_recv_callback_t cb, void *arg)
{
	ucp_am_handler_param_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
		       UCP_AM_HANDLER_PARAM_FIELD_ARG;
	p.id = id;
	p.cb = cb;
	p.arg = arg;
	return ucp_worker_set_am_recv_handler(w, &p);
}

ucs_status_t ucxg_set_am_handler(ucp_worker_h w, uint16_t id, uintptr_t handle)
{
	return set_am(w, id, am_cb, (void *)handle);
}

ucs_status_t ucxg_clear_am_handler(ucp_worker_h w, uint16_t id)
{
	return set_am(w, id, NULL, NULL);
}

static void am_sent(void *req, ucs_status_t st, void *buf)
{
	(void)req;
	(void)st;
	free(buf);
	__atomic_sub_fetch(&am_buffers, 1, __ATOMIC_RELAXED);
}

// ucxg_am_send copies header and payload into one C buffer, so UCX never
// sees Go memory; the buffer is freed when the send completes.
void *ucxg_am_send(ucxg_ep_t *e, uint16_t id, const void *hdr, size_t hlen, const void *data,
		   size_t dlen, ucs_status_t *st)
{
	char *buf = malloc(hlen + dlen + 1);
	if (buf == NULL) {
		*st = UCS_ERR_NO_MEMORY;
		return NULL;
	}
	if (hlen > 0) {
		memcpy(buf, hdr, hlen);
	}
	if (dlen > 0) {
		memcpy(buf + hlen, data, dlen);
	}
	__atomic_add_fetch(&am_buffers, 1, __ATOMIC_RELAXED);
	ucp_request_param_t p;
	memset(&p, 0, sizeof(p));
	p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
			 UCP_OP_ATTR_FIELD_FLAGS;
	p.cb.send = am_sent;
	p.user_data = buf;
	p.flags = UCP_AM_SEND_FLAG_EAGER;
	ucs_status_ptr_t r = ucp_am_send_nbx(e->ep, id, buf, hlen, buf + hlen, dlen, &p);
	if (!UCS_PTR_IS_PTR(r)) {
		// Completed or failed immediately: the callback is not called.
		free(buf);
		__atomic_sub_fetch(&am_buffers, 1, __ATOMIC_RELAXED);
	}
	return status_ptr(r, st);
}

int64_t ucxg_am_buffers(void)
{
	return __atomic_load_n(&am_buffers, __ATOMIC_RELAXED);
}

// ucxg_ep_info returns ucp_ep_print_info's text in a malloc'd string.
char *ucxg_ep_info(ucxg_ep_t *e)
{
	char *buf = NULL;
	size_t n = 0;
	FILE *f = open_memstream(&buf, &n);
	if (f == NULL) {
		return NULL;
	}
	ucp_ep_print_info(e->ep, f);
	fclose(f);
	return buf;
}

// ucxg_context_info writes ucp_context_print_info's report into a buffer
// it allocates (*out, freed by the caller with free).
int ucxg_context_info(ucp_context_h ctx, char **out, size_t *len)
{
	FILE *f = open_memstream(out, len);
	if (f == NULL) {
		return -1;
	}
	ucp_context_print_info(ctx, f);
	return fclose(f);
}
