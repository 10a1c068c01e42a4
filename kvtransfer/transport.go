package kvtransfer

import (
	"context"
	"errors"
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Region is one registered buffer of the KV pool: for MHA, K of one layer or
// V of one layer (KindKV, one item = one page of that buffer), or an aux
// buffer (KindAux, one item per request slot).
type Region struct {
	Kind    wire.RegionKind
	ItemLen uint32
	Mem     []byte
}

// Pool is an engine's whole KV memory as the transfer engine sees it. Every
// KV region has the same number of pages, every aux region the same number
// of slots.
type Pool struct {
	Regions  []Region
	PageSize uint32 // tokens per page; must match the peer's
	Dtype    string // KV dtype tag; must match the peer's
}

// Pages is the number of pages of every KV region.
func (p *Pool) Pages() int { return p.items(wire.KindKV) }

// AuxSlots is the number of slots of every aux region.
func (p *Pool) AuxSlots() int { return p.items(wire.KindAux) }

func (p *Pool) items(k wire.RegionKind) int {
	for _, r := range p.Regions {
		if r.Kind == k {
			return len(r.Mem) / int(r.ItemLen)
		}
	}
	return 0
}

// Validate checks the layout invariants the engine relies on.
func (p *Pool) Validate() error {
	if len(p.Regions) == 0 {
		return errors.New("pool has no regions")
	}
	n := map[wire.RegionKind]int{}
	for i, r := range p.Regions {
		if r.Kind != wire.KindKV && r.Kind != wire.KindAux {
			return fmt.Errorf("region %d: bad kind %d", i, r.Kind)
		}
		if r.ItemLen == 0 || len(r.Mem)%int(r.ItemLen) != 0 {
			return fmt.Errorf("region %d: length %d is not a multiple of item length %d", i, len(r.Mem), r.ItemLen)
		}
		items := len(r.Mem) / int(r.ItemLen)
		if prev, ok := n[r.Kind]; ok && prev != items {
			return fmt.Errorf("region %d: %d items, other regions of its kind have %d", i, items, prev)
		}
		n[r.Kind] = items
	}
	return nil
}

// LocalMeta is what a transport publishes about the registered pool: the
// worker address, and per region its base address and packed remote key
// (zero and nil for tcp, which addresses regions by index and offset).
type LocalMeta struct {
	WorkerAddr []byte
	Bases      []uint64
	RKeys      [][]byte
}

// Run is one contiguous copy from the local region Region at SrcOff to the
// peer's region of the same index at DstOff.
type Run struct {
	Region         int
	SrcOff, DstOff uint64
	Len            uint64
}

// Transport moves bytes from the local pool into a peer's pool.
type Transport interface {
	Name() string
	// Alloc returns size bytes of shared memory for the pool, mapped here
	// and with an fd the engine maps too. The caller closes the Segment
	// after Close.
	Alloc(size int) (*shm.Segment, error)
	// Register makes the pool's regions transferable; called once.
	Register(p *Pool) (LocalMeta, error)
	// Connect prepares writes into the peer that sent remote (endpoint and
	// rkeys set up once per peer). conn is that peer's connection; the tcp
	// transport sends its DATA frames on it.
	Connect(remote *wire.Hello, conn *wire.Conn) (Writer, error)
	// Done is closed once the transport stops: on Close, or by itself when
	// it broke as a whole (not one peer's connection), Err then saying why.
	// A broken transport fails every later transfer, so its owner must stop
	// instead of limping on. Nil when the transport cannot break.
	Done() <-chan struct{}
	Err() error
	Close() error
}

// Writer writes into one peer's pool.
type Writer interface {
	// Write posts all runs as one batch and returns once every byte is
	// complete at the target (so a DONE sent afterwards is truthful), or
	// when ctx ends (the peer is gone).
	Write(ctx context.Context, runs []Run) error
	Close()
}

// MemoryTransport is what a transport adds to move engine-owned memory
// (control RegisterMemory/Write): memory registered at run time, addressed
// by the engine's own addresses, written in raw runs rather than pages.
type MemoryTransport interface {
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
