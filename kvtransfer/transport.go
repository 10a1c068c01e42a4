package kvtransfer

import "context"

// Transport moves bytes between engines' registered memory (registered at
// run time, addressed by the engine's own addresses): tcp, shm or ucx,
// chosen when kvproxy starts.
type Transport interface {
	Name() string
	// Done is closed once the transport stops: on Close, or by itself when
	// it broke as a whole (not one peer's connection), Err then saying why.
	// A broken transport fails every later transfer, so its owner must stop
	// instead of limping on. Nil when the transport cannot break.
	Done() <-chan struct{}
	Err() error
	Close() error
	// RegisterMemory makes b, the kvproxy's mapping of the memfd fd (which
	// the caller keeps open until the registration is closed), a source and
	// target of transfers until the registration is closed.
	RegisterMemory(b []byte, fd int) (MemoryRegistration, error)
	// WorkerAddress is what a peer's MemoryEndpoint connects to (nil: the
	// transport needs no address of its own, tcp).
	WorkerAddress() ([]byte, error)
	// MemoryEndpoint connects to the peer whose WorkerAddress is addr. A nil
	// endpoint (tcp) means the bytes travel as DATA frames on the peer link.
	MemoryEndpoint(addr []byte) (MemoryEndpoint, error)
}

// MemoryRegistration is one registered mapping.
type MemoryRegistration interface {
	// RKey is the packed key a peer needs to write into it (nil for tcp).
	RKey() []byte
	Close() error
}

// RemoteKey is a peer's RKey unpacked on one endpoint; it lives as long as
// the endpoint.
type RemoteKey any

// MemoryOp is one run of a memory write: Len bytes from Local at LocalOff
// to the peer's mapping at the absolute address Remote, under Key.
type MemoryOp struct {
	Local    MemoryRegistration
	LocalOff uint64
	Key      RemoteKey
	Remote   uint64
	Len      uint64
}

// MemoryEndpoint writes into one peer's registered memory.
type MemoryEndpoint interface {
	Unpack(rkey []byte) (RemoteKey, error)
	// Put posts ops as one batch with one flush and returns once every byte
	// is complete at the target. If ctx ends first it closes the endpoint,
	// so that no operation still reads local memory when it returns.
	Put(ctx context.Context, ops []MemoryOp) error
	// Forget releases a key no write uses any more (its region is gone).
	Forget(RemoteKey)
	Close()
}
