package kvtransfer

import "github.com/pdrouter/pdrouter/kvtransfer/wire"

// TCP is the pure-Go transport: a write's bytes travel as DATA frames on
// the peer link, written with writev straight from the source mapping and
// read by the peer's link reader straight into the destination mapping; a
// fence after them says when they are all in memory.
type TCP struct{}

var _ Transport = (*TCP)(nil)

func (*TCP) Name() string { return "tcp" }

// Done is nil: tcp shares nothing between peers that could break.
func (*TCP) Done() <-chan struct{} { return nil }

func (*TCP) Err() error { return nil }

func (*TCP) Close() error { return nil }

// appendPieces adds src, bound for region at off, as DATA frames of at most
// wire.MaxDataLen bytes.
func appendPieces(pieces []wire.DataPiece, region uint32, off uint64, src []byte) []wire.DataPiece {
	for len(src) > 0 {
		n := min(len(src), wire.MaxDataLen)
		pieces = append(pieces, wire.DataPiece{Region: region, Offset: off, Data: src[:n]})
		src, off = src[n:], off+uint64(n)
	}
	return pieces
}

// RegisterMemory needs nothing: tcp reads and writes any mapping.
func (*TCP) RegisterMemory([]byte, int) (MemoryRegistration, error) { return tcpRegistration{}, nil }

// WorkerAddress is nil: tcp moves bytes on the peer link itself.
func (*TCP) WorkerAddress() ([]byte, error) { return nil, nil }

// MemoryEndpoint is nil: the peer link carries the DATA frames.
func (*TCP) MemoryEndpoint([]byte) (MemoryEndpoint, error) { return nil, nil }

type tcpRegistration struct{}

func (tcpRegistration) RKey() []byte { return nil }
func (tcpRegistration) Close() error { return nil }
