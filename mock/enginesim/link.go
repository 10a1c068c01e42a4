package enginesim

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"syscall"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/control"
	"github.com/pdrouter/pdrouter/kvtransfer/shm"
)

// registerTimeout bounds one dial + register. While the kvproxy is down a
// dial fails at once (no socket, or refused), so every request tries one.
// It runs apart from the request's context: the kvproxy keeps a pool it
// registered even if we stop waiting for the reply, and refuses a second.
const registerTimeout = 10 * time.Second

// link is one control connection and the pool segment registered on it. A
// kvproxy that restarts knows nothing of the old pool, so a new link
// registers the same layout again and maps the new segment; requests
// already running keep the link they started on.
type link struct {
	cl        *control.Client
	seg       *shm.Segment
	transport string
	bufs      [][]byte // one per KV buffer
	aux       []byte
	users     int // requests holding it (Sim.lmu)
}

func (l *link) close() error {
	return errors.Join(l.cl.Close(), l.seg.Close())
}

func (l *link) broken() bool {
	select {
	case <-l.cl.Done():
		return true
	default:
		return false
	}
}

// ErrKVProxyDown is returned while the kvproxy cannot be reached; it carries
// HTTPStatus 503 (retryable) for the mockworker to answer with.
var ErrKVProxyDown error = statusError{http.StatusServiceUnavailable, "kvproxy unavailable"}

// dial connects to the kvproxy, has it allocate and register the pool, and
// maps the pool.
func (s *Sim) dial(ctx context.Context) (*link, error) {
	cl, err := control.Dial(s.o.Control)
	if err != nil {
		return nil, err
	}
	// The kvproxy allocates the pool (so its transport can use memory it
	// owns) and hands back the segment's fd; we map the same pages.
	tr, fd, err := cl.Register(ctx, s.layout)
	var seg *shm.Segment
	if err == nil {
		seg, err = shm.Map(fd)
		if err != nil {
			syscall.Close(fd)
		} else if len(seg.Mem) < s.size {
			seg.Close()
			err = fmt.Errorf("segment of %d bytes, layout needs %d", len(seg.Mem), s.size)
		}
	}
	if err != nil {
		cl.Close()
		return nil, fmt.Errorf("register KV pool with kvproxy: %w", err)
	}
	l := &link{cl: cl, seg: seg, transport: tr}
	span := s.pages * s.item
	for b := 0; b < s.nbuf; b++ {
		l.bufs = append(l.bufs, seg.Mem[b*span:(b+1)*span])
	}
	l.aux = seg.Mem[s.nbuf*span : s.size]
	return l, nil
}

// acquire returns the live link for one request, connecting again when the
// kvproxy went away. The caller must give it back with put.
func (s *Sim) acquire() (*link, error) {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	if s.cur != nil && s.cur.broken() {
		s.retireLocked(s.cur)
	}
	if s.cur == nil {
		if s.linkClosed {
			return nil, fmt.Errorf("%w: engine closed", ErrKVProxyDown)
		}
		dctx, cancel := context.WithTimeout(context.Background(), registerTimeout)
		l, err := s.dial(dctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%w at %s: %v", ErrKVProxyDown, s.o.Control, err)
		}
		s.cur = l
		s.links++
	}
	s.cur.users++
	return s.cur, nil
}

// put gives back a link taken by acquire, with the error of its last call.
// It reports whether that error says the connection is gone; the link is
// then replaced for the next request, and closes once its last request is
// done.
func (s *Sim) put(l *link, err error) (lost bool) {
	lost = errors.Is(err, control.ErrClientClosed)
	s.lmu.Lock()
	defer s.lmu.Unlock()
	l.users--
	if lost && s.cur == l {
		s.retireLocked(l)
		return lost
	}
	if l != s.cur && l.users == 0 {
		_ = l.close()
	}
	return lost
}

func (s *Sim) retireLocked(l *link) {
	s.cur = nil
	if l.users == 0 {
		_ = l.close()
	}
}

// Links counts the control connections made so far: 1 plus one per
// reconnect (for tests).
func (s *Sim) Links() int {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	return s.links
}

// linkState is the Sim's current link. lmu is kept apart from mu (the page
// allocator) so a dial never holds up page bookkeeping.
type linkState struct {
	lmu        sync.Mutex
	cur        *link // nil: dial on the next request
	links      int
	linkClosed bool
}
