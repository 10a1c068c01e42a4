package router

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
)

// Client connections (headConn) end every read that fasthttp makes at the
// end of a request head. fasthttp's read buffer then holds
// nothing past a head, so it goes back to its pool once the head is parsed
// (ReduceMemoryUsage), and a body fasthttp is told not to read (frameBody)
// is still whole on the connection, for the router to read at its size
// (readBody). What a socket read brings past a head waits in a pooled
// buffer, normally only until fasthttp's next read.
//
// In PD mode fasthttp waits for a keep-alive connection's next request
// with a read of one byte (ReduceMemoryUsage: no buffer held while idle),
// then reads the rest: two system calls for what arrives in one. A
// headConn over a socket waits for that byte without a buffer too, but
// then reads all that came into a pooled one, and the read of the rest
// takes it from there. Regular mode keeps fasthttp's buffer and reads
// through it (firstByteWait off), so a headConn there may sit on a
// connection that reads the socket itself (lazyDeadlineConn).

// headListener wraps ln's connections in headConns.
type headListener struct {
	net.Listener
	firstByteWait bool // fasthttp reads one byte to wait for a request: wait on the socket
}

func (l headListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	h := &headConn{Conn: c}
	if t, ok := c.(*tls.Conn); ok { // fasthttp tells TLS by its methods
		return &headTLSConn{headConn: h, tls: t}, nil
	}
	if sc, ok := c.(syscall.Conn); ok && l.firstByteWait {
		h.raw, _ = sc.SyscallConn()
		h.readFn = h.readSocket
	}
	return h, nil
}

type headConn struct {
	net.Conn
	raw   syscall.RawConn // the socket, for readAhead; nil: none (TLS, tests)
	rest  *[]byte         // bytes read and not yet returned, from off on; pooled
	off   int
	state lineState

	// readFn is readSocket, made once per connection rather than once per
	// request; it leaves its read's outcome in readN and readErr.
	readFn  func(fd uintptr) bool
	readN   int
	readErr error
}

// firstByteRead is the largest read that readAhead serves: fasthttp's wait
// for a request's first byte reads one.
const firstByteRead = 1

// lineState is how far the bytes read so far end in an empty line.
type lineState uint8

const (
	midLine     lineState = iota
	lineStart             // after "\n"
	lineStartCR           // after "\n\r"
)

// restPool holds the buffers for what one read brings past a head.
var restPool = sync.Pool{New: func() any { b := make([]byte, 0, 16<<10); return &b }}

// Read is fasthttp's: it ends at the end of the first empty line ("\n\n"
// or "\n\r\n", the end of a head; fasthttp accepts no other).
func (c *headConn) Read(p []byte) (int, error) {
	if c.rest == nil && len(p) <= firstByteRead && c.raw != nil {
		if err := c.readAhead(); err != nil {
			return 0, err
		}
	}
	if c.rest != nil {
		n := copy(p, (*c.rest)[c.off:])
		n = c.headEnd(p[:n])
		c.consume(n)
		return n, nil
	}
	n, err := c.Conn.Read(p)
	if k := c.headEnd(p[:n]); k < n {
		c.keep(p[k:n])
		n = k
	}
	return n, err
}

// readAhead waits until the socket is readable, holding no buffer, then
// reads all it holds (up to a pooled buffer's size) into rest.
func (c *headConn) readAhead() error {
	err := c.raw.Read(c.readFn)
	switch {
	case err != nil: // closed, or the read deadline passed
		return err
	case c.readErr != nil:
		return os.NewSyscallError("read", c.readErr)
	case c.readN == 0:
		return io.EOF
	}
	return nil
}

// readSocket is readAhead's read, false when the socket had nothing yet.
func (c *headConn) readSocket(fd uintptr) bool {
	buf := restPool.Get().(*[]byte)
	var err error
	n := 0
	for {
		n, err = syscall.Read(int(fd), (*buf)[:cap(*buf)])
		if err != syscall.EINTR {
			break
		}
	}
	if n > 0 {
		*buf = (*buf)[:n]
		c.rest, c.off = buf, 0
	} else {
		restPool.Put(buf)
	}
	c.readN, c.readErr = n, err
	return err != syscall.EAGAIN
}

// readBody is the router's read of a body fasthttp left on the connection:
// it does not stop at empty lines.
func (c *headConn) readBody(p []byte) (int, error) {
	if c.rest != nil {
		n := copy(p, (*c.rest)[c.off:])
		c.consume(n)
		return n, nil
	}
	return c.Conn.Read(p)
}

// bodyDone puts back what was read past the body's end (a pipelined
// request's bytes) for fasthttp's next read.
func (c *headConn) bodyDone(unread []byte) {
	c.state = midLine
	if len(unread) > 0 {
		c.keep(unread)
	}
}

// keep puts b before the bytes still kept.
func (c *headConn) keep(b []byte) {
	var left []byte
	if c.rest != nil {
		left = (*c.rest)[c.off:]
	}
	buf := restPool.Get().(*[]byte)
	if cap(*buf) < len(b)+len(left) { // more than a usual read: a large body's first bytes
		*buf = make([]byte, 0, len(b)+len(left))
	}
	*buf = append(append((*buf)[:0], b...), left...)
	c.release()
	c.rest, c.off = buf, 0
}

func (c *headConn) consume(n int) {
	c.off += n
	if c.off == len(*c.rest) {
		c.release()
	}
}

func (c *headConn) release() {
	if c.rest != nil {
		if cap(*c.rest) == 16<<10 {
			restPool.Put(c.rest)
		}
		c.rest, c.off = nil, 0
	}
}

// headEnd returns the length of b up to and including the end of its first
// empty line, counting the line begun in earlier reads; len(b) if none.
func (c *headConn) headEnd(b []byte) int {
	for i := 0; i < len(b); {
		switch c.state {
		case lineStart:
			switch b[i] {
			case '\n': // which starts a line too
				return i + 1
			case '\r':
				c.state = lineStartCR
				i++
				continue
			}
		case lineStartCR:
			if b[i] == '\n' {
				c.state = lineStart
				return i + 1
			}
		}
		c.state = midLine
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			break
		}
		i += j + 1
		c.state = lineStart
	}
	return len(b)
}

// SyscallConn lets the disconnect watch see the socket (connwatch.go).
func (c *headConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errNoSocket
}

var errNoSocket = errors.New("connection has no socket of its own")

// headTLSConn is a headConn over TLS, which fasthttp tells by these
// methods (ctx.IsTLS, TLSConnectionState).
type headTLSConn struct {
	*headConn
	tls *tls.Conn
}

func (c *headTLSConn) Handshake() error                     { return c.tls.Handshake() }
func (c *headTLSConn) ConnectionState() tls.ConnectionState { return c.tls.ConnectionState() }

// clientHeadConn is the headConn under ctx's connection, nil if none.
func clientHeadConn(c net.Conn) *headConn {
	switch c := c.(type) {
	case *headConn:
		return c
	case *headTLSConn:
		return c.headConn
	}
	return nil
}
