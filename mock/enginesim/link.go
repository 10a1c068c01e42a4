package enginesim

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/control"
)

// registerTimeout bounds one dial + register. While the kvproxy is down a
// dial fails at once (no socket, or refused), so every request tries one.
const registerTimeout = 10 * time.Second

// link is one control connection and the pool registered on it. A kvproxy
// that restarts knows nothing of the pool, so a new link registers it and
// its layout again; requests already running keep the link they started
// on.
type link struct {
	cl        *control.Client
	transport string
	users     int // requests holding it (Sim.lmu)
}

func (l *link) close() error { return l.cl.Close() }

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

// dial connects to the kvproxy and registers the pool (its memfd, and its
// GPU memory if there) and the pool's layout, as SGLang registers its KV
// buffers with its transfer engine.
func (s *Sim) dial(ctx context.Context) (*link, error) {
	cl, err := control.Dial(s.o.Control)
	if err != nil {
		return nil, err
	}
	_, tr, err := cl.Hello(ctx)
	if err == nil {
		err = cl.RegisterMemory(ctx, addrOf(s.seg.Mem), uint64(s.size), s.seg.Fd())
	}
	if err == nil {
		err = s.kv.register(ctx, cl)
	}
	if err == nil {
		err = cl.RoomLayout(ctx, s.layout)
	}
	if err != nil {
		cl.Close()
		return nil, fmt.Errorf("register the KV pool with kvproxy: %w", err)
	}
	return &link{cl: cl, transport: tr}, nil
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
