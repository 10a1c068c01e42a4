package router

import (
	"errors"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
)

// fasthttp moves a keep-alive connection's read deadline three times per
// request (idle wait, head, body) and its write deadline once. On a
// net.Conn each move is a runtime timer update under the poller's lock and
// two clock reads, together about 2 % of a regular request's CPU. A
// lazyDeadlineConn keeps the deadline it is asked for and moves the
// socket's only when the new one is earlier than the one armed there (or
// none); a read or write that the armed deadline ends too early re-arms it
// at the deadline asked for and goes on. Callers see the deadlines they
// set, to the nanosecond; the socket's timer moves about once per
// connection per timeout instead of four times per request.
//
// Only where nothing reads the socket past the wrapper with deadlines of
// its own: regular mode, whose headConn reads through it (PD mode's waits
// on the socket directly).
type lazyDeadlineListener struct{ net.Listener }

func (l lazyDeadlineListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &lazyDeadlineConn{Conn: c}, nil
}

type lazyDeadlineConn struct {
	net.Conn
	mu          sync.Mutex
	read, write lazyDeadline
}

// lazyDeadline is one direction's deadlines, in Unix nanoseconds (0: none).
type lazyDeadline struct{ want, armed int64 }

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// set records want, and reports the deadline to arm on the socket now, if
// any: want is earlier than the armed one, or is "none" (so that code that
// reads the socket past the wrapper, like a goroutine disconnect watch,
// finds no deadline after clearing it).
func (d *lazyDeadline) set(want int64) (arm bool) {
	d.want = want
	if want == d.armed || (d.armed != 0 && want > d.armed) {
		return false
	}
	d.armed = want
	return true
}

// retry reports whether a timeout the socket returned came before the
// deadline asked for, re-arming it there if so.
func (d *lazyDeadline) retry(err error, now int64) bool {
	if !errors.Is(err, os.ErrDeadlineExceeded) || (d.want != 0 && now >= d.want) {
		return false
	}
	d.armed = d.want
	return true
}

func armAt(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

func (c *lazyDeadlineConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.read.set(unixNano(t)) {
		return nil
	}
	return c.Conn.SetReadDeadline(t)
}

func (c *lazyDeadlineConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.write.set(unixNano(t)) {
		return nil
	}
	return c.Conn.SetWriteDeadline(t)
}

func (c *lazyDeadlineConn) SetDeadline(t time.Time) error {
	return errors.Join(c.SetReadDeadline(t), c.SetWriteDeadline(t))
}

func (c *lazyDeadlineConn) Read(b []byte) (int, error) {
	for {
		n, err := c.Conn.Read(b)
		if err == nil || n > 0 || !c.rearm(&c.read, err, c.Conn.SetReadDeadline) {
			return n, err
		}
	}
}

func (c *lazyDeadlineConn) Write(b []byte) (int, error) {
	written := 0
	for {
		n, err := c.Conn.Write(b[written:])
		written += n
		if err == nil || !c.rearm(&c.write, err, c.Conn.SetWriteDeadline) {
			return written, err
		}
	}
}

// rearm moves the socket's deadline of d to the one asked for when err is
// an early timeout; false: err stands.
func (c *lazyDeadlineConn) rearm(d *lazyDeadline, err error, setSocket func(time.Time) error) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !d.retry(err, time.Now().UnixNano()) {
		return false
	}
	return setSocket(armAt(d.armed)) == nil
}

// SyscallConn lets the disconnect watch see the socket (connwatch.go).
func (c *lazyDeadlineConn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.ErrUnsupported
	}
	return sc.SyscallConn()
}
