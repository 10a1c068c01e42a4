//go:build cgo

package ucx

/*
#cgo pkg-config: ucx
#include <stdlib.h>
#include "glue.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// live counts UCX objects for LiveObjects.
var live struct {
	contexts, workers, listeners, endpoints, memory, rkeys, requests atomic.Int64
}

// LiveObjects reports how many UCX objects this process holds right now.
func LiveObjects() Live {
	return Live{
		Contexts:  live.contexts.Load(),
		Workers:   live.workers.Load(),
		Listeners: live.listeners.Load(),
		Endpoints: live.endpoints.Load(),
		Memory:    live.memory.Load(),
		Rkeys:     live.rkeys.Load(),
		Requests:  live.requests.Load(),
		AMBuffers: int64(C.ucxg_am_buffers()),
	}
}

func statusErr(op string, st C.ucs_status_t) error {
	if st == C.UCS_OK {
		return nil
	}
	return &Error{Op: op, Status: int(st), Text: C.GoString(C.ucs_status_string(st))}
}

// Context is a UCP context with the RMA, AM and wakeup features. It is safe
// for concurrent use.
type Context struct {
	p          C.ucp_context_h
	tls        string // effective UCX_TLS, to check sockaddr support
	peerErrors C.int  // 1: endpoints use error handling mode PEER

	mu       sync.Mutex
	children int // open workers and memory regions
	closed   bool
}

// NewContext reads the UCX_* environment, applies cfg.Options and creates
// the context.
func NewContext(cfg Config) (*Context, error) {
	keys := make([]*C.char, 0, len(cfg.Options))
	vals := make([]*C.char, 0, len(cfg.Options))
	defer func() {
		for i := range keys {
			C.free(unsafe.Pointer(keys[i]))
			C.free(unsafe.Pointer(vals[i]))
		}
	}()
	for k, v := range cfg.Options {
		keys = append(keys, C.CString(k))
		vals = append(vals, C.CString(v))
	}
	// C memory for the arrays: cgo forbids passing Go memory holding pointers.
	n := len(keys)
	ck := (**C.char)(C.calloc(C.size_t(n+1), C.size_t(unsafe.Sizeof(uintptr(0)))))
	cv := (**C.char)(C.calloc(C.size_t(n+1), C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(ck))
	defer C.free(unsafe.Pointer(cv))
	copy(unsafe.Slice(ck, n), keys)
	copy(unsafe.Slice(cv, n), vals)

	c := &Context{tls: tlsSetting(cfg), peerErrors: 1}
	if cfg.NoPeerErrorHandling {
		c.peerErrors = 0
	}
	if err := statusErr("ucp_init", C.ucxg_context_create(ck, cv, C.int(n), &c.p)); err != nil {
		return nil, err
	}
	live.contexts.Add(1)
	return c, nil
}

// Close releases the context. Every worker and memory region of it must be
// closed first.
func (c *Context) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if c.children > 0 {
		return fmt.Errorf("ucx: context close: %d workers or memory regions still open", c.children)
	}
	c.closed = true
	C.ucp_cleanup(c.p)
	live.contexts.Add(-1)
	return nil
}

func (c *Context) addChild() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	c.children++
	return nil
}

func (c *Context) dropChild() {
	c.mu.Lock()
	c.children--
	c.mu.Unlock()
}

// tlsSetting returns the UCX_TLS value the context will use.
func tlsSetting(cfg Config) string {
	if v, ok := cfg.Options["TLS"]; ok {
		return v
	}
	return os.Getenv("UCX_TLS")
}

// tlsHasTCP reports whether a UCX_TLS value enables tcp, which sockaddr
// connection establishment needs.
func tlsHasTCP(tls string) bool {
	tls = strings.TrimSpace(tls)
	if tls == "" {
		return true
	}
	exclude := strings.HasPrefix(tls, "^")
	found := false
	for _, t := range strings.Split(strings.TrimPrefix(tls, "^"), ",") {
		t = strings.TrimSpace(t)
		if t == "tcp" || (!exclude && t == "all") {
			found = true
		}
	}
	return found != exclude
}

// Memory is a registered region. It is safe to share between goroutines;
// close it once no operation uses it.
type Memory struct {
	ctx    *Context
	memh   C.ucp_mem_h
	base   unsafe.Pointer
	n      int
	typ    MemoryType
	closed atomic.Bool
}

// Alloc lets UCX allocate and register n bytes (UCP_MEM_MAP_ALLOCATE). Over
// shared-memory transports peers can then store into it directly.
func (c *Context) Alloc(n int) (*Memory, error) {
	if n <= 0 {
		return nil, fmt.Errorf("ucx: alloc: bad length %d", n)
	}
	return c.mapMem(0, n, MemoryHost, true)
}

// Map registers existing memory. b must not be Go heap memory: use mmap'd
// memory (a memfd, shared segment) or C-allocated memory, and keep it
// mapped until the Memory is closed.
func (c *Context) Map(b []byte) (*Memory, error) {
	if len(b) == 0 {
		return nil, fmt.Errorf("ucx: map: empty buffer")
	}
	return c.mapMem(uintptr(unsafe.Pointer(unsafe.SliceData(b))), len(b), MemoryHost, false)
}

// MapAddr registers n bytes at addr of memory type t: device memory, which
// Go cannot address, or host memory known only by address. The memory must
// stay allocated until the Memory is closed.
func (c *Context) MapAddr(addr uintptr, n int, t MemoryType) (*Memory, error) {
	if addr == 0 || n <= 0 {
		return nil, fmt.Errorf("ucx: map: bad range %#x+%d", addr, n)
	}
	if t != MemoryHost && !c.Supports(t) {
		return nil, fmt.Errorf("ucx: map: this UCX (API %s) cannot register %s memory: no transport for it", APIVersion(), t)
	}
	return c.mapMem(addr, n, t, false)
}

// Supports reports whether the context's transports register memory of type t.
func (c *Context) Supports(t MemoryType) bool {
	if t < 0 || t >= 64 {
		return false
	}
	return C.ucxg_context_mem_types(c.p)&(1<<uint(ucsMemType(t))) != 0
}

// Transports lists the transport/device pairs the context uses, as
// ucp_context_print_info names them ("tcp/lo", "rc_mlx5/mlx5_0:1").
func (c *Context) Transports() ([]string, error) {
	var out *C.char
	var n C.size_t
	if C.ucxg_context_info(c.p, &out, &n) != 0 {
		return nil, errors.New("ucx: context info: open_memstream failed")
	}
	defer C.free(unsafe.Pointer(out))
	return parseResources(C.GoStringN(out, C.int(n))), nil
}

// parseResources takes the "tl/dev" of each "resource" line of
// ucp_context_print_info's report.
func parseResources(info string) []string {
	var tls []string
	for _, line := range strings.Split(info, "\n") {
		if !strings.Contains(line, "resource") {
			continue
		}
		if _, after, ok := strings.Cut(line, "--"); ok {
			if tl := strings.TrimSpace(after); tl != "" {
				tls = append(tls, tl)
			}
		}
	}
	return tls
}

// APIVersion is the UCP API version the package was compiled against.
func APIVersion() string {
	return fmt.Sprintf("%d.%d", int(C.UCP_API_MAJOR), int(C.UCP_API_MINOR))
}

// ucsMemType maps t to ucs_memory_type_t.
func ucsMemType(t MemoryType) C.int {
	if t == MemoryCUDA {
		return C.UCS_MEMORY_TYPE_CUDA
	}
	return C.UCS_MEMORY_TYPE_HOST
}

func (c *Context) mapMem(addr uintptr, n int, t MemoryType, alloc bool) (*Memory, error) {
	if err := c.addChild(); err != nil {
		return nil, err
	}
	m := &Memory{ctx: c, n: n, typ: t}
	a := C.int(0)
	if alloc {
		a = 1
	}
	st := C.ucxg_mem_map(c.p, C.uintptr_t(addr), C.size_t(n), a, ucsMemType(t), &m.memh, &m.base)
	if err := statusErr("ucp_mem_map", st); err != nil {
		c.dropChild()
		return nil, err
	}
	live.memory.Add(1)
	return m, nil
}

// Bytes views a host region; valid until Close. It is nil for device
// memory, which the CPU cannot address.
func (m *Memory) Bytes() []byte {
	if m.typ != MemoryHost {
		return nil
	}
	return unsafe.Slice((*byte)(m.base), m.n)
}

// Type is the region's memory type.
func (m *Memory) Type() MemoryType { return m.typ }

// Addr is the region's base address, the one a peer puts to.
func (m *Memory) Addr() uint64 { return uint64(uintptr(m.base)) }

// Len is the region's length in bytes.
func (m *Memory) Len() int { return m.n }

// PackRkey returns the remote key a peer passes to Endpoint.UnpackRkey.
func (m *Memory) PackRkey() ([]byte, error) {
	if m.closed.Load() {
		return nil, ErrClosed
	}
	var buf unsafe.Pointer
	var size C.size_t
	if err := statusErr("ucp_rkey_pack", C.ucp_rkey_pack(m.ctx.p, m.memh, &buf, &size)); err != nil {
		return nil, err
	}
	defer C.ucp_rkey_buffer_release(buf)
	return C.GoBytes(buf, C.int(size)), nil
}

// Close unregisters the region (and frees it if UCX allocated it).
func (m *Memory) Close() error {
	if !m.closed.CompareAndSwap(false, true) {
		return ErrClosed
	}
	err := statusErr("ucp_mem_unmap", C.ucp_mem_unmap(m.ctx.p, m.memh))
	live.memory.Add(-1)
	m.ctx.dropChild()
	return err
}
