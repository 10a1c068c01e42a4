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

// connWatcher watches one client connection until stopped.
type connWatcher struct {
	conn net.Conn
	done chan struct{}
}

// watchConn calls onGone (from another goroutine) if the peer closes c. It
// returns nil when c cannot be watched (not a socket, e.g. in-memory tests).
func watchConn(c net.Conn, onGone func()) *connWatcher {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	w := &connWatcher{conn: c, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		var buf [1]byte
		gone := false
		err := rc.Read(func(fd uintptr) bool {
			n, _, err := syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
			if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINTR) {
				return false // not readable yet: park in the netpoller
			}
			gone = err != nil || n == 0
			return true
		})
		if err == nil && gone {
			onGone()
		}
	}()
	return w
}

// stop ends the watch before the server reads from the connection again.
// A deadline in the past wakes the parked read; it is cleared afterwards so
// the server's own deadlines apply.
func (w *connWatcher) stop() {
	if w == nil {
		return
	}
	select {
	case <-w.done:
	default:
		_ = w.conn.SetReadDeadline(time.Unix(1, 0))
		<-w.done
	}
	_ = w.conn.SetReadDeadline(time.Time{})
}
