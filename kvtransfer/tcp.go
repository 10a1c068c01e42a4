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
	for _, r := range runs {
		mem := w.pool.Regions[r.Region].Mem
		for done := uint64(0); done < r.Len; {
			n := min(r.Len-done, wire.MaxDataLen)
			src := mem[r.SrcOff+done : r.SrcOff+done+n]
			if err := w.conn.WriteData(uint32(r.Region), r.DstOff+done, src); err != nil {
				return err
			}
			done += n
		}
	}
	return nil
}

func (*tcpWriter) Close() {}
