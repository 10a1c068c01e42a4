package kvtransfer

import (
	"context"
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// TCP is the pure-Go transport: pages travel as DATA frames on the peer
// connection, written with writev straight from the source pages and read by
// the receiving engine straight into the destination pages. DONE follows the
// data on the same ordered stream, so no flush is needed.
type TCP struct {
	pool *Pool
}

var _ Transport = (*TCP)(nil)

func (*TCP) Name() string { return "tcp" }

// Alloc makes a memfd: tcp reads and writes any memory.
func (*TCP) Alloc(size int) (*shm.Segment, error) { return shm.Create("kvpool", size) }

func (t *TCP) Register(p *Pool) (LocalMeta, error) {
	t.pool = p
	return LocalMeta{Bases: make([]uint64, len(p.Regions)), RKeys: make([][]byte, len(p.Regions))}, nil
}

func (t *TCP) Connect(_ *wire.Hello, conn *wire.Conn) (Writer, error) {
	if t.pool == nil {
		return nil, fmt.Errorf("tcp transport: no pool registered")
	}
	return &tcpWriter{pool: t.pool, conn: conn}, nil
}

// Done is nil: tcp shares nothing between peers that could break.
func (*TCP) Done() <-chan struct{} { return nil }

func (*TCP) Err() error { return nil }

func (*TCP) Close() error { return nil }

type tcpWriter struct {
	pool *Pool
	conn *wire.Conn
}

func (w *tcpWriter) Write(_ context.Context, runs []Run) error {
	var pieces []wire.DataPiece
	for _, r := range runs {
		src := w.pool.Regions[r.Region].Mem[r.SrcOff : r.SrcOff+r.Len]
		pieces = appendPieces(pieces, uint32(r.Region), r.DstOff, src)
	}
	return w.conn.WriteDataBatch(pieces)
}

func (*tcpWriter) Close() {}

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

var _ MemoryTransport = (*TCP)(nil)

// RegisterMemory needs nothing: tcp reads and writes any mapping.
func (*TCP) RegisterMemory([]byte, int) (MemoryRegistration, error) { return tcpRegistration{}, nil }

// WorkerAddress is nil: tcp moves bytes on the peer link itself.
func (*TCP) WorkerAddress() ([]byte, error) { return nil, nil }

// MemoryEndpoint is nil: the peer link carries the DATA frames.
func (*TCP) MemoryEndpoint([]byte) (MemoryEndpoint, error) { return nil, nil }

type tcpRegistration struct{}

func (tcpRegistration) RKey() []byte { return nil }
func (tcpRegistration) Close() error { return nil }
