//go:build cgo

package ucx

/*
#include <stdlib.h>
#include "glue.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"time"
	"unsafe"
)

// closeFlushTimeout bounds the flush Endpoint.Close attempts before it
// force-closes, so a dead peer cannot hang Close.
const closeFlushTimeout = 2 * time.Second

// Endpoint is a connection to one peer worker, created with error handling
// mode PEER unless Config.NoPeerErrorHandling: a dead peer fails pending and
// new operations instead of hanging them. Note that UCX 1.13 never uses
// shared memory for sockaddr (Connect/Accept) endpoints in mode PEER; use
// ConnectAddress with NoPeerErrorHandling for that. Owned by its worker's
// goroutine.
type Endpoint struct {
	w      *Worker
	e      *C.ucxg_ep_t
	rkeys  map[*Rkey]struct{}
	closed bool
}

func (w *Worker) newEndpoint(e *C.ucxg_ep_t) *Endpoint {
	ep := &Endpoint{w: w, e: e, rkeys: map[*Rkey]struct{}{}}
	w.eps[ep] = struct{}{}
	live.endpoints.Add(1)
	return ep
}

// Connect opens an endpoint to a Listener at "ip:port" and waits up to
// timeout for the connection to be established. Sockaddr connections need
// tcp in UCX_TLS; without it UCX would accept the endpoint and never
// connect, so Connect fails fast instead.
func (w *Worker) Connect(addr string, timeout time.Duration) (*Endpoint, error) {
	if !tlsHasTCP(w.ctx.tls) {
		return nil, fmt.Errorf("ucx: connect %s: UCX_TLS=%q has no tcp, which sockaddr connections need", addr, w.ctx.tls)
	}
	ip, port, err := splitAddr(addr)
	if err != nil {
		return nil, fmt.Errorf("ucx: connect %s: %w", addr, err)
	}
	cip := C.CString(ip)
	defer C.free(unsafe.Pointer(cip))
	var e *C.ucxg_ep_t
	if err := statusErr("ucp_ep_create(sockaddr)", C.ucxg_ep_connect(w.p, 1, cip, C.uint16_t(port), &e)); err != nil {
		return nil, fmt.Errorf("ucx: connect %s: %w", addr, err)
	}
	ep := w.newEndpoint(e)
	// A flush completes only once wireup with the server is done.
	req, err := ep.Flush()
	if err == nil {
		err = req.Wait(timeout)
		if errors.Is(err, ErrTimeout) {
			req.Cancel()
			req.Free()
		}
	}
	if err == nil {
		err = ep.Err()
	}
	if err != nil {
		ep.forceClose()
		return nil, fmt.Errorf("ucx: connect %s: connection not established: %w", addr, err)
	}
	return ep, nil
}

// ConnectAddress opens an endpoint to the worker whose Address is addr.
// The connection is established lazily by the first operation.
func (w *Worker) ConnectAddress(addr []byte) (*Endpoint, error) {
	if len(addr) == 0 {
		return nil, fmt.Errorf("ucx: connect by worker address: empty address")
	}
	ca := C.CBytes(addr)
	defer C.free(ca)
	var e *C.ucxg_ep_t
	if err := statusErr("ucp_ep_create(address)", C.ucxg_ep_by_address(w.p, w.ctx.peerErrors, ca, &e)); err != nil {
		return nil, fmt.Errorf("ucx: connect by worker address: %w", err)
	}
	return w.newEndpoint(e), nil
}

// Err returns the peer failure the endpoint's error handler recorded, if any.
func (ep *Endpoint) Err() error {
	return statusErr("endpoint error", ep.e.err)
}

// Rkey is a peer's remote key unpacked on one endpoint.
type Rkey struct {
	ep     *Endpoint
	p      C.ucp_rkey_h
	closed bool
}

// UnpackRkey unpacks a key from the peer's Memory.PackRkey.
func (ep *Endpoint) UnpackRkey(packed []byte) (*Rkey, error) {
	if len(packed) == 0 {
		return nil, fmt.Errorf("ucx: rkey unpack: empty key")
	}
	cb := C.CBytes(packed)
	defer C.free(cb)
	r := &Rkey{ep: ep}
	if err := statusErr("ucp_ep_rkey_unpack", C.ucp_ep_rkey_unpack(ep.e.ep, cb, &r.p)); err != nil {
		return nil, err
	}
	ep.rkeys[r] = struct{}{}
	live.rkeys.Add(1)
	return r, nil
}

// Close destroys the key.
func (r *Rkey) Close() {
	if r.closed {
		return
	}
	r.closed = true
	C.ucp_rkey_destroy(r.p)
	delete(r.ep.rkeys, r)
	live.rkeys.Add(-1)
}

// Put writes n bytes from local at localOff to remoteAddr under rkey.
func (ep *Endpoint) Put(local *Memory, localOff uint64, rkey *Rkey, remoteAddr, n uint64) (*Request, error) {
	op := [1]Op{{LocalOff: localOff, Len: n}}
	return ep.rma(false, local, rkey, remoteAddr, op[:])
}

// Get reads n bytes from remoteAddr under rkey into local at localOff.
func (ep *Endpoint) Get(local *Memory, localOff uint64, rkey *Rkey, remoteAddr, n uint64) (*Request, error) {
	op := [1]Op{{LocalOff: localOff, Len: n}}
	return ep.rma(true, local, rkey, remoteAddr, op[:])
}

// PutBatch posts one put per op (remote address remoteBase+RemoteOff) in a
// single cgo call and returns only the last pending request: its
// completion does not imply the others', so use Flush to wait for all.
func (ep *Endpoint) PutBatch(local *Memory, rkey *Rkey, remoteBase uint64, ops []Op) (*Request, error) {
	return ep.rma(false, local, rkey, remoteBase, ops)
}

// GetBatch is PutBatch for gets.
func (ep *Endpoint) GetBatch(local *Memory, rkey *Rkey, remoteBase uint64, ops []Op) (*Request, error) {
	return ep.rma(true, local, rkey, remoteBase, ops)
}

func (ep *Endpoint) rma(get bool, local *Memory, rkey *Rkey, rbase uint64, ops []Op) (*Request, error) {
	name := "ucp_put_nbx"
	if get {
		name = "ucp_get_nbx"
	}
	if ep.closed || rkey.closed || local.closed.Load() {
		return nil, ErrClosed
	}
	if rkey.ep != ep {
		return nil, fmt.Errorf("ucx: %s: rkey was unpacked on another endpoint", name)
	}
	if len(ops) == 0 {
		return nil, nil
	}
	size, total := uint64(local.n), uint64(0)
	for i := range ops {
		if o := &ops[i]; o.LocalOff > size || o.Len > size-o.LocalOff {
			return nil, fmt.Errorf("ucx: %s: op %d [%d,+%d) outside local region of %d bytes", name, i, o.LocalOff, o.Len, size)
		}
		total += ops[i].Len
	}
	ep.w.pace(len(ops) + int(total>>16))
	g := C.int(0)
	if get {
		g = 1
	}
	var st C.ucs_status_t
	p := C.ucxg_rma_batch(ep.e, g, (*C.char)(local.base), local.memh, C.uint64_t(rbase), rkey.p,
		(*C.ucxg_op_t)(unsafe.Pointer(&ops[0])), C.size_t(len(ops)), &st)
	return ep.w.request(name, p, st)
}

// Flush returns a request that completes when every operation posted on
// the endpoint has completed remotely.
func (ep *Endpoint) Flush() (*Request, error) {
	if ep.closed {
		return nil, ErrClosed
	}
	var st C.ucs_status_t
	p := C.ucxg_ep_flush(ep.e, &st)
	return ep.w.request("ucp_ep_flush_nbx", p, st)
}

// SendAM sends active message id with header and data (eager protocol).
// Both are copied before the call returns, so the slices may be reused.
func (ep *Endpoint) SendAM(id uint16, header, data []byte) (*Request, error) {
	if ep.closed {
		return nil, ErrClosed
	}
	var st C.ucs_status_t
	p := C.ucxg_am_send(ep.e, C.uint16_t(id), bytesPtr(header), C.size_t(len(header)),
		bytesPtr(data), C.size_t(len(data)), &st)
	return ep.w.request("ucp_am_send_nbx", p, st)
}

func bytesPtr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(&b[0])
}

// Close flushes the endpoint (bounded by closeFlushTimeout), destroys its
// rkeys and force-closes it; the peer sees its endpoint fail.
func (ep *Endpoint) Close() error {
	if ep.closed {
		return ErrClosed
	}
	var err error
	if ep.Err() == nil {
		var req *Request
		if req, err = ep.Flush(); err == nil {
			if err = req.Wait(closeFlushTimeout); errors.Is(err, ErrTimeout) {
				req.Free()
			}
		}
	}
	ep.forceClose()
	// A peer that closed first leaves nothing to flush to: the flush fails
	// as not connected, or is cancelled when the endpoint fails under it,
	// and the error callback may simply not have run yet. That is how two
	// closes race, not a failure of this one.
	if err != nil && !peerClosedDuringFlush(err) {
		return fmt.Errorf("ucx: endpoint close: flush: %w", err)
	}
	return nil
}

func peerClosedDuringFlush(err error) bool {
	var e *Error
	if !errors.As(err, &e) {
		return false
	}
	switch C.ucs_status_t(e.Status) {
	case C.UCS_ERR_NOT_CONNECTED, C.UCS_ERR_CONNECTION_RESET, C.UCS_ERR_ENDPOINT_TIMEOUT,
		C.UCS_ERR_UNREACHABLE, C.UCS_ERR_CANCELED:
		return true
	}
	return false
}

func (ep *Endpoint) forceClose() {
	for r := range ep.rkeys {
		r.Close()
	}
	ep.closed = true
	var st C.ucs_status_t
	p := C.ucxg_ep_close(ep.e, 1, &st)
	if p != nil {
		// A force close completes locally; progress until it does.
		for C.ucxg_request_status(p) == C.UCS_INPROGRESS {
			C.ucp_worker_progress(ep.w.p)
		}
		C.ucp_request_free(p)
	}
	C.ucxg_ep_free(ep.e)
	delete(ep.w.eps, ep)
	live.endpoints.Add(-1)
}

// Request is a pending operation. A nil *Request is an operation that
// completed immediately; all methods accept it. Every non-nil request must
// end with a successful Wait or with Free.
type Request struct {
	w *Worker
	p unsafe.Pointer
}

func (w *Worker) request(op string, p unsafe.Pointer, st C.ucs_status_t) (*Request, error) {
	if p == nil {
		return nil, statusErr(op, st)
	}
	live.requests.Add(1)
	return &Request{w: w, p: p}, nil
}

// Test reports whether the request is done and, if so, its error.
func (r *Request) Test() (bool, error) {
	if r == nil {
		return true, nil
	}
	if r.p == nil {
		return false, ErrClosed
	}
	st := C.ucxg_request_status(r.p)
	if st == C.UCS_INPROGRESS {
		return false, nil
	}
	return true, statusErr("request", st)
}

// Wait progresses the worker until the request completes and frees it. On
// ErrTimeout (timeout < 0: none) the request stays pending: Wait again,
// Cancel or Free it.
func (r *Request) Wait(timeout time.Duration) error {
	if r == nil {
		return nil
	}
	if r.p == nil {
		return ErrClosed
	}
	var deadline time.Time
	if timeout >= 0 {
		deadline = time.Now().Add(timeout)
	}
	for i := 0; ; i++ {
		st := C.ucxg_request_status(r.p)
		if st != C.UCS_INPROGRESS {
			r.Free()
			return statusErr("request", st)
		}
		r.w.pace(1)
		C.ucp_worker_progress(r.w.p)
		// Reading the clock every iteration would cost more than progress.
		if timeout >= 0 && i%256 == 255 && time.Now().After(deadline) {
			return ErrTimeout
		}
	}
}

// Cancel asks UCX to complete the request with UCS_ERR_CANCELED; it still
// needs Wait or Free.
func (r *Request) Cancel() {
	if r == nil || r.p == nil {
		return
	}
	C.ucp_request_cancel(r.w.p, r.p)
}

// Free releases the request; a pending operation continues in the background.
func (r *Request) Free() {
	if r == nil || r.p == nil {
		return
	}
	C.ucp_request_free(r.p)
	r.p = nil
	live.requests.Add(-1)
}

// Info returns UCX's description of the endpoint (ucp_ep_print_info): its
// lanes and the transport and device each uses.
func (ep *Endpoint) Info() (string, error) {
	if ep.closed {
		return "", ErrClosed
	}
	p := C.ucxg_ep_info(ep.e)
	if p == nil {
		return "", fmt.Errorf("ucx: endpoint info: out of memory")
	}
	defer C.free(unsafe.Pointer(p))
	return C.GoString(p), nil
}
