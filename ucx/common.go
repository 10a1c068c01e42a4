package ucx

import (
	"errors"
	"fmt"
)

// ErrUnavailable is returned by every constructor in builds without cgo.
var ErrUnavailable = errors.New("ucx: not available (built without cgo)")

// ErrTimeout means a bounded wait ended before the operation completed.
var ErrTimeout = errors.New("ucx: timed out")

// ErrClosed means the object was already closed.
var ErrClosed = errors.New("ucx: closed")

// Error is a failed UCX call with UCX's status code and text.
type Error struct {
	Op     string // what we were doing, e.g. "ucp_put_nbx"
	Status int    // ucs_status_t, negative
	Text   string // ucs_status_string
}

func (e *Error) Error() string {
	return fmt.Sprintf("ucx: %s: %s (%d)", e.Op, e.Text, e.Status)
}

// Op is one RMA descriptor of a batch: Len bytes between local memory at
// LocalOff and remote memory at RemoteOff (offsets from the bases given to
// PutBatch/GetBatch). Its layout matches the C descriptor.
type Op struct {
	LocalOff  uint64
	RemoteOff uint64
	Len       uint64
}

// ThreadMode is the worker's thread mode (ucs_thread_mode_t).
type ThreadMode int

// Thread modes; ThreadSingle is the fast one and fits the owner-goroutine rule.
const (
	ThreadSingle ThreadMode = iota
	ThreadSerialized
	ThreadMulti
)

// Config configures a Context.
type Config struct {
	// Options are UCX configuration overrides without the UCX_ prefix,
	// e.g. {"TLS": "tcp", "KEEPALIVE_INTERVAL": "1s"}. Unset keys come
	// from the UCX_* environment.
	Options map[string]string
	// NoPeerErrorHandling makes ConnectAddress endpoints use error handling
	// mode NONE instead of PEER (sockaddr endpoints always use PEER: UCX
	// 1.13 fails to wire them up in mode NONE). UCX 1.13's posix and sysv transports do not support
	// mode PEER, so shared memory is only used with this set; the price is
	// that a dead peer may leave operations pending (bound every Wait and
	// detect the peer's death another way, e.g. heartbeats).
	NoPeerErrorHandling bool
}

// Live counts UCX objects currently alive in this process, for leak checks.
type Live struct {
	Contexts, Workers, Listeners, Endpoints, Memory, Rkeys, Requests int64
	AMBuffers                                                        int64 // active-message copies still in flight
}

// AMHandler receives one active message. header and data point into UCX
// buffers valid only during the call: copy what must outlive it. It runs
// on the worker's owner goroutine inside Progress.
type AMHandler func(header, data []byte)

// LoopConfig configures a Loop.
type LoopConfig struct {
	Mode ThreadMode
	// Poll, if set, runs on the loop goroutine after every progress call;
	// it returns true while it has work in flight, which keeps the loop
	// spinning instead of sleeping.
	Poll func(w *Worker) (busy bool)
}

// MemoryType is where registered memory lives (ucs_memory_type_t).
type MemoryType int

// Memory types: host memory, and CUDA device memory, which needs a UCX
// built with CUDA (its cuda_copy/cuda_ipc transports).
const (
	MemoryHost MemoryType = iota
	MemoryCUDA
)

func (t MemoryType) String() string {
	switch t {
	case MemoryHost:
		return "host"
	case MemoryCUDA:
		return "cuda"
	}
	return fmt.Sprintf("memory type %d", int(t))
}
