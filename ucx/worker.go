//go:build cgo

package ucx

/*
#include <stdlib.h>
#include "glue.h"
*/
import "C"

import (
	"fmt"
	"net"
	"runtime"
	"runtime/cgo"
	"strconv"
	"time"
	"unsafe"
)

// Worker is a UCP worker. Its methods must be called from its owner
// goroutine (locked to its OS thread); Signal is the exception.
type Worker struct {
	ctx       *Context
	p         C.ucp_worker_h
	efd       int
	eps       map[*Endpoint]struct{}
	listeners map[*Listener]struct{}
	am        map[uint16]cgo.Handle
	closed    bool
	addressed bool      // Address was called: peers may have endpoints to it
	work      int       // pace units since the last clock read
	lastSched time.Time // when pace last let the scheduler run
}

// schedEvery bounds how long the owner goroutine runs without passing
// through the Go scheduler; it is half of sysmon's 10 ms limit. The owner's
// loops make only cgo calls, which never pass through it: after 10 ms on
// one scheduling tick sysmon takes the P out of the running cgo call and
// goes back to waking every 20 µs, and where the process shares a core
// (pinned, or a busy machine) each wake-up preempts the worker thread.
// Measured with both peers pinned to one core each, as in make bench-ucx:
// 1 MiB puts over shared memory ran at 0.74–0.78 of ucx_perftest's
// bandwidth without pace and 0.91–0.96 with it; one PutBatch of every put
// (a single cgo call) ran at 0.91–0.99.
const schedEvery = 5 * time.Millisecond

// paceUnits is how many units (one per call, one more per 64 KiB moved)
// pass between clock reads in pace, so that the cheapest calls (an idle
// progress, an 8-byte put) do not each pay for one.
const paceUnits = 64

// pace yields to the scheduler once per schedEvery so that sysmon never
// sees the owner goroutine running too long. Yielding a goroutine locked to
// its thread hands the P to another thread and back.
func (w *Worker) pace(units int) {
	if w.work += units; w.work < paceUnits {
		return
	}
	w.work = 0
	if now := time.Now(); now.Sub(w.lastSched) >= schedEvery {
		w.lastSched = now
		runtime.Gosched()
	}
}

// NewWorker creates a worker with event-fd wakeups. Call it from the
// goroutine that will own the worker.
func (c *Context) NewWorker(mode ThreadMode) (*Worker, error) {
	if err := c.addChild(); err != nil {
		return nil, err
	}
	w := &Worker{
		ctx:       c,
		eps:       map[*Endpoint]struct{}{},
		listeners: map[*Listener]struct{}{},
		am:        map[uint16]cgo.Handle{},
	}
	if err := statusErr("ucp_worker_create", C.ucxg_worker_create(c.p, C.int(mode), &w.p)); err != nil {
		c.dropChild()
		return nil, err
	}
	var fd C.int
	if err := statusErr("ucp_worker_get_efd", C.ucp_worker_get_efd(w.p, &fd)); err != nil {
		C.ucp_worker_destroy(w.p)
		c.dropChild()
		return nil, err
	}
	w.efd = int(fd)
	live.workers.Add(1)
	return w, nil
}

// Progress runs UCX's progress engine once and reports whether anything
// happened. Completions and active-message handlers run inside it.
func (w *Worker) Progress() bool {
	w.pace(1)
	return C.ucp_worker_progress(w.p) != 0
}

// Address returns the worker address a peer passes to ConnectAddress.
func (w *Worker) Address() ([]byte, error) {
	var a *C.ucp_address_t
	var n C.size_t
	if err := statusErr("ucp_worker_get_address", C.ucp_worker_get_address(w.p, &a, &n)); err != nil {
		return nil, err
	}
	defer C.ucp_worker_release_address(w.p, a)
	w.addressed = true
	return C.GoBytes(unsafe.Pointer(a), C.int(n)), nil
}

// EventFD is the worker's event file descriptor; it becomes readable when
// the worker is armed and an event arrives.
func (w *Worker) EventFD() int { return w.efd }

// Arm prepares the event fd for sleeping. It returns false when events are
// already pending: progress again instead of sleeping.
func (w *Worker) Arm() (bool, error) {
	st := C.ucp_worker_arm(w.p)
	if st == C.UCS_ERR_BUSY {
		return false, nil
	}
	return st == C.UCS_OK, statusErr("ucp_worker_arm", st)
}

// WaitEvents sleeps until the worker has events, Signal is called or the
// timeout passes (negative: no timeout). It returns at once when events are
// pending; the caller progresses afterwards either way.
func (w *Worker) WaitEvents(timeout time.Duration) error {
	armed, err := w.Arm()
	if err != nil || !armed {
		return err
	}
	ms := -1
	if timeout >= 0 {
		ms = int((timeout + time.Millisecond - 1) / time.Millisecond)
	}
	if r, err := C.ucxg_wait_fd(C.int(w.efd), C.int(ms)); r < 0 {
		return fmt.Errorf("ucx: poll on worker event fd: %w", err)
	}
	return nil
}

// Signal wakes a WaitEvents on this worker. It is safe from any goroutine
// while the worker is open.
func (w *Worker) Signal() error {
	return statusErr("ucp_worker_signal", C.ucp_worker_signal(w.p))
}

// Flush returns a request that completes when every operation posted on
// the worker has completed remotely.
func (w *Worker) Flush() (*Request, error) {
	var st C.ucs_status_t
	p := C.ucxg_worker_flush(w.p, &st)
	return w.request("ucp_worker_flush_nbx", p, st)
}

// SetAMHandler installs fn for active-message id; nil removes it.
func (w *Worker) SetAMHandler(id uint16, fn AMHandler) error {
	if fn == nil {
		err := statusErr("ucp_worker_set_am_recv_handler", C.ucxg_clear_am_handler(w.p, C.uint16_t(id)))
		w.dropAM(id)
		return err
	}
	h := cgo.NewHandle(fn)
	if err := statusErr("ucp_worker_set_am_recv_handler", C.ucxg_set_am_handler(w.p, C.uint16_t(id), C.uintptr_t(h))); err != nil {
		h.Delete()
		return err
	}
	w.dropAM(id)
	w.am[id] = h
	return nil
}

func (w *Worker) dropAM(id uint16) {
	if h, ok := w.am[id]; ok {
		h.Delete()
		delete(w.am, id)
	}
}

// closeQuiet is how long Close waits without events before it destroys a
// worker whose address was handed out; a live peer acknowledges a
// connection well within it. closeDrainTimeout bounds the whole wait.
const (
	closeQuiet        = 100 * time.Millisecond
	closeDrainTimeout = 2 * time.Second
)

// Close closes the worker's listeners and endpoints, then destroys it; a
// worker whose Address was taken first lets peers' wireup finish (up to
// closeDrainTimeout). Requests still pending must have been waited for or
// freed.
func (w *Worker) Close() error {
	if w.closed {
		return ErrClosed
	}
	var first error
	for l := range w.listeners {
		l.Close()
	}
	for e := range w.eps {
		if err := e.Close(); err != nil && first == nil {
			first = err
		}
	}
	if w.addressed {
		w.drainPeerWireup()
	}
	for id := range w.am {
		if err := w.SetAMHandler(id, nil); err != nil && first == nil {
			first = err
		}
	}
	w.closed = true
	C.ucp_worker_destroy(w.p)
	live.workers.Add(-1)
	w.ctx.dropChild()
	return first
}

// drainPeerWireup progresses the worker until closeQuiet passes without an
// event (at most closeDrainTimeout). A peer that connects to this worker's
// address makes UCX create an endpoint here that only UCX knows of, and
// over tcp its wireup reply waits in the tcp endpoint's pending queue until
// the peer acknowledges the new connection. UCX 1.13's ucp_worker_destroy
// purges that queue and aborts on the reply (assertion "got REP message",
// removed upstream in openucx/ucx#8175). UCX can neither list those
// endpoints nor flush them (a worker flush skips endpoints when no
// operation is counted), so Close waits for the acknowledgement, which
// arrives as an event and sends the reply.
func (w *Worker) drainPeerWireup() {
	start := time.Now()
	last := start
	for {
		if w.Progress() {
			last = time.Now()
			continue
		}
		now := time.Now()
		idle := now.Sub(last)
		if idle >= closeQuiet || now.Sub(start) >= closeDrainTimeout {
			return
		}
		// Short slices: not every UCX event signals the event fd.
		if err := w.WaitEvents(min(closeQuiet-idle, 10*time.Millisecond)); err != nil {
			return
		}
	}
}

// Listener accepts sockaddr connections (needs tcp in UCX_TLS).
type Listener struct {
	w      *Worker
	l      *C.ucxg_listener_t
	addr   string
	closed bool
}

// Listen listens on "ip:port" (port 0 picks a free one; see Addr).
func (w *Worker) Listen(addr string) (*Listener, error) {
	if !tlsHasTCP(w.ctx.tls) {
		return nil, fmt.Errorf("ucx: listen %s: UCX_TLS=%q has no tcp, which sockaddr connections need", addr, w.ctx.tls)
	}
	ip, port, err := splitAddr(addr)
	if err != nil {
		return nil, fmt.Errorf("ucx: listen %s: %w", addr, err)
	}
	cip := C.CString(ip)
	defer C.free(unsafe.Pointer(cip))
	l := &Listener{w: w}
	if err := statusErr("ucp_listener_create", C.ucxg_listener_create(w.p, cip, C.uint16_t(port), &l.l)); err != nil {
		return nil, fmt.Errorf("ucx: listen %s: %w", addr, err)
	}
	var p C.uint16_t
	if err := statusErr("ucp_listener_query", C.ucxg_listener_port(l.l, &p)); err != nil {
		C.ucxg_listener_destroy(l.l)
		return nil, fmt.Errorf("ucx: listen %s: %w", addr, err)
	}
	l.addr = net.JoinHostPort(ip, strconv.Itoa(int(p)))
	w.listeners[l] = struct{}{}
	live.listeners.Add(1)
	return l, nil
}

// Addr is the address the listener is bound to, with the real port.
func (l *Listener) Addr() string { return l.addr }

// Accept progresses the worker until a connection request arrives and
// returns its endpoint, or ErrTimeout after timeout (0: check once).
func (l *Listener) Accept(timeout time.Duration) (*Endpoint, error) {
	if l.closed {
		return nil, ErrClosed
	}
	deadline := time.Now().Add(timeout)
	for {
		if r := C.ucxg_listener_pop(l.l); r != nil {
			var e *C.ucxg_ep_t
			if err := statusErr("ucp_ep_create(conn_request)", C.ucxg_ep_accept(l.w.p, 1, r, &e)); err != nil {
				return nil, fmt.Errorf("ucx: accept on %s: %w", l.addr, err)
			}
			return l.w.newEndpoint(e), nil
		}
		if !time.Now().Before(deadline) {
			return nil, ErrTimeout
		}
		if !l.w.Progress() {
			// Bounded sleep: a connection request may not signal the event fd.
			if err := l.w.WaitEvents(min(time.Until(deadline), 10*time.Millisecond)); err != nil {
				return nil, err
			}
		}
	}
}

// Close stops listening and rejects queued connection requests.
func (l *Listener) Close() {
	if l.closed {
		return
	}
	l.closed = true
	C.ucxg_listener_destroy(l.l)
	delete(l.w.listeners, l)
	live.listeners.Add(-1)
}

func splitAddr(addr string) (string, uint16, error) {
	host, ps, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.ParseUint(ps, 10, 16)
	if err != nil {
		return "", 0, fmt.Errorf("bad port %q", ps)
	}
	if host == "" {
		host = "0.0.0.0"
	}
	if net.ParseIP(host) == nil {
		ips, err := net.LookupIP(host)
		if err != nil || len(ips) == 0 {
			return "", 0, fmt.Errorf("resolve %q: %v", host, err)
		}
		host = ips[0].String()
	}
	return host, uint16(port), nil
}
