package router

import (
	"errors"
	"net"
	"syscall"
	"time"
)

// fasthttp never tells a handler that its client went away (valyala/fasthttp
// #468, #965): RequestCtx.Done() only fires at server shutdown. While a
// handler waits on upstream we therefore watch the socket ourselves: wait
// until it turns readable and peek, so EOF or a reset means the client is
// gone while bytes mean a pipelined request (then we stop watching).
//
// The watch starts only once a request has lasted watchDelay (see
// inflight.go): most of its cost (a goroutine, a peek, parking in the
// netpoller) is then paid only by requests long enough for a disconnect to
// matter, and a generation request learns of a departed client at most
// watchDelay plus a sweep tick late.
const watchDelay = 2 * time.Millisecond

// connWatcher watches one client connection until stopped.
type connWatcher struct {
	conn   syscall.Conn
	onGone func()
	done   chan struct{} // closed when the watch has ended
}

// startWatch calls onGone (from another goroutine) if the peer closes c. It
// returns nil when c cannot be watched (not a socket, e.g. in-memory tests).
func startWatch(c net.Conn, onGone func()) *connWatcher {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	w := &connWatcher{conn: sc, onGone: onGone, done: make(chan struct{})}
	go w.watch()
	return w
}

// watch runs until the peer leaves or stop.
func (w *connWatcher) watch() {
	defer close(w.done)
	rc, err := w.conn.SyscallConn()
	if err != nil {
		return
	}
	var buf [1]byte
	gone := false
	err = rc.Read(func(fd uintptr) bool {
		n, _, err := syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINTR) {
			return false // not readable yet: park in the netpoller
		}
		gone = err != nil || n == 0
		return true
	})
	if err == nil && gone {
		w.onGone()
	}
}

// stop ends the watch before the server reads from the connection again.
// A deadline in the past wakes a parked read (or makes a read about to
// start fail at once); it is cleared afterwards so the server's own
// deadlines apply.
func (w *connWatcher) stop() {
	if w == nil {
		return
	}
	select {
	case <-w.done:
	default:
		_ = w.conn.(net.Conn).SetReadDeadline(time.Unix(1, 0))
		<-w.done
	}
	_ = w.conn.(net.Conn).SetReadDeadline(time.Time{})
}
