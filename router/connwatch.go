package router

import (
	"errors"
	"net"
	"sync"
	"syscall"
	"time"
)

// fasthttp never tells a handler that its client went away (valyala/fasthttp
// #468, #965): RequestCtx.Done() only fires at server shutdown. While a
// handler waits on upstream we therefore watch the socket ourselves: once
// it turns readable we peek, so EOF or a reset means the client is gone
// while bytes mean a pipelined request (then we stop watching).
//
// On Linux one epoll set per router holds every watched socket and one
// goroutine waits on it (connwatch_linux.go): an open stream costs an
// epoll registration, not a goroutine stack. Elsewhere, or if epoll cannot
// be set up, each watch is a goroutine parked in a read of its own.
//
// The watch starts only once a request has lasted watchDelay (see
// inflight.go): short requests pay nothing for it, and a generation
// request learns of a departed client at most watchDelay plus a sweep tick
// late, which costs the engine a few tokens of work. It is well above a
// short request's queueing under load: at 2 ms a saturated router armed a
// watch (an epoll_ctl, a descriptor reference and two locks) for half its
// requests.
const watchDelay = 50 * time.Millisecond

// watcher starts and ends the watches of one router. The zero value is
// ready; the epoll set is made at the first watch.
type watcher struct {
	mu     sync.Mutex
	ep     *epoller
	epErr  error // epoll could not be set up: watches use goroutines
	closed bool

	lot parkingLot // idle client connections (parkconn.go)
}

// connWatch is one connection's watch. It lives in the request (no
// allocation of its own on the epoll path).
type connWatch struct {
	rc     syscall.RawConn
	conn   net.Conn
	onGone func()
	ep     *epoller      // nil: watched by a goroutine of its own
	token  uint64        // its key in ep
	done   chan struct{} // goroutine watch: closed when it has ended
}

// start makes cw watch c and call onGone (from another goroutine) if the
// peer closes it. False when c cannot be watched (not a socket, e.g. TLS
// or in-memory tests) or the watcher is closed.
func (w *watcher) start(cw *connWatch, c net.Conn, onGone func()) bool {
	rc := rawConn(c)
	if rc == nil {
		return false
	}
	*cw = connWatch{rc: rc, conn: c, onGone: onGone}
	if ep := w.epoller(); ep != nil && ep.add(cw) == nil {
		return true
	}
	cw.ep = nil
	cw.done = make(chan struct{})
	// A read deadline left from reading the request would end the
	// parked read early.
	_ = c.SetReadDeadline(time.Time{})
	go cw.watchAlone()
	return true
}

// epoller is the shared epoll set, made on first use; nil when there is
// none to use.
func (w *watcher) epoller() *epoller {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil
	}
	if w.ep == nil && w.epErr == nil {
		w.ep, w.epErr = newEpoller()
	}
	return w.ep
}

// close ends the shared watch (at hard shutdown, when every request is
// cancelled anyway); watches still registered end with their requests,
// parked connections close.
func (w *watcher) close() {
	w.mu.Lock()
	w.closed = true
	ep := w.ep
	w.mu.Unlock()
	w.lot.closeAll()
	if ep != nil {
		ep.close()
	}
}

// peekPeer tells what a readable socket holds: gone is EOF or an error,
// sent is bytes (a pipelined request), neither is nothing yet.
func peekPeer(fd uintptr) (gone, sent bool) {
	var buf [1]byte
	n, _, err := syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINTR) {
		return false, false
	}
	return err != nil || n == 0, err == nil && n > 0
}

// watchAlone is the goroutine watch: it parks in the netpoller until the
// socket turns readable or stop expires its deadline.
func (cw *connWatch) watchAlone() {
	defer close(cw.done)
	gone := false
	err := cw.rc.Read(func(fd uintptr) bool {
		var sent bool
		gone, sent = peekPeer(fd)
		return gone || sent
	})
	if err == nil && gone {
		cw.onGone()
	}
}

// stop ends the watch before the server reads from the connection again;
// onGone is not called after stop returns. A goroutine watch is woken by a
// read deadline in the past, cleared afterwards so the server's own
// deadlines apply.
func (cw *connWatch) stop() {
	switch {
	case cw.ep != nil:
		cw.ep.remove(cw)
	case cw.done != nil:
		select {
		case <-cw.done:
		default:
			_ = cw.conn.SetReadDeadline(time.Unix(1, 0))
			<-cw.done
		}
		_ = cw.conn.SetReadDeadline(time.Time{})
	}
}

// rawConn is c's socket, nil when c is none (TLS, in-memory tests).
func rawConn(c net.Conn) syscall.RawConn {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}
