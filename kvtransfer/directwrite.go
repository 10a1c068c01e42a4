package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Direct small writes. Over tcp a small write through kvproxy crosses four
// processes (engine → its kvproxy → the peer kvproxy → back twice); each
// wake-up costs tens of µs on a busy host. So an engine may send a small
// host-memory write itself, straight to the peer kvproxy's peer port, as a
// write-only client: MEM_CLIENT instead of MEM_HELLO, answered with the
// region table, then DATA frames and a fence, answered once the bytes are
// in the peer engine's memory, exactly as on a link. Its own kvproxy only
// says whether the peer is reached over tcp (DirectRoute). A client is
// never a link: no table pushes, rooms or writes go to it, and it cannot
// displace the link between the two kvproxies.

// directStats count write-only clients, for kvproxy's status and metrics.
type directStats struct {
	clients atomic.Int64  // connected now
	writes  atomic.Uint64 // fences answered
}

// DirectRoute says whether this session's engine may write small host
// buffers to peer itself: ok when the link to peer (dialled if need be)
// moves host memory as DATA frames over tcp; why says why not otherwise.
// timeout is what the engine gives such a write: the plane's write
// timeout.
func (s *MemorySession) DirectRoute(ctx context.Context, peer string) (ok bool, why string, timeout time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, s.p.cfg.WriteTimeout)
	defer cancel()
	stop := context.AfterFunc(s.ctx, cancel)
	defer stop()
	l, err := s.p.link(ctx, peer)
	if err != nil {
		return false, "", 0, fmt.Errorf("route to %s: %w", peer, err)
	}
	if path := l.hostPath(); path != PathTCP {
		return false, fmt.Sprintf("host memory goes to %s by %s, not tcp", peer, path), 0, nil
	}
	l.directRoutes.Add(1)
	return true, "", s.p.cfg.WriteTimeout, nil
}

// acceptClient serves a write-only client on the goroutine that accepted
// it, until it hangs up or the plane closes (stop: the plane's closing
// closes c). slots is the handshake slot it holds until its MEM_CLIENT is
// answered; c's read deadline bounds that handshake.
func (p *MemoryPlane) acceptClient(c net.Conn, slots <-chan struct{}, stop func() bool) {
	defer c.Close()
	defer stop()
	conn := wire.NewConn(c)
	conn.SetWriteTimeout(p.cfg.WriteTimeout)
	m, err := conn.Read()
	h, ok := m.(*wire.MemClient)
	if err == nil && !ok {
		err = fmt.Errorf("%w: %s opened the connection", wire.ErrMalformed, m.Type())
	}
	if err == nil {
		err = conn.Write(p.clientTable(0))
	}
	<-slots
	if err == nil {
		_ = c.SetReadDeadline(time.Time{})
		err = p.serveClient(conn)
	}
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		name := ""
		if h != nil {
			name = h.Name
		}
		p.log.Warn("write-only client", zap.String("remote", c.RemoteAddr().String()), zap.String("name", name), zap.Error(err))
	}
}

// clientTable is the region table as a client's answer to seq (0: the
// handshake's).
func (p *MemoryPlane) clientTable(seq uint64) *wire.MemRegions {
	p.bmu.Lock()
	defer p.bmu.Unlock()
	return &wire.MemRegions{Seq: seq, Regions: p.table()}
}

// serveClient lands a client's DATA frames and answers its fences and
// table requests (on the reader: the client waits for each answer, and
// the write timeout bounds one it does not read).
func (p *MemoryPlane) serveClient(conn *wire.Conn) error {
	p.direct.clients.Add(1)
	defer p.direct.clients.Add(-1)
	var dropped string
	for {
		m, err := conn.Read()
		if err != nil {
			return err
		}
		switch m := m.(type) {
		case *wire.Data:
			err = p.landHost(conn, p.hostRegion(m.Region), m, &dropped)
		case *wire.MemFence:
			err = conn.Write(&wire.MemFenceAck{Seq: m.Seq, Err: dropped})
			dropped = ""
			p.direct.writes.Add(1)
		case *wire.MemRegionsReq:
			err = conn.Write(p.clientTable(m.Seq))
		default:
			err = fmt.Errorf("%w: %s from a write-only client", wire.ErrMalformed, m.Type())
		}
		if err != nil {
			return err
		}
	}
}
