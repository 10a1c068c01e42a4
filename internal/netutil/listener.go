// Package netutil holds the listener both binaries serve on: an Accept that
// survives running out of file descriptors, and a connection limit.
package netutil

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Options configure a Listener.
type Options struct {
	// MaxConns bounds the open connections; one over it is refused. 0: no
	// limit. SetMaxConns changes it later.
	MaxConns int
	// Refusal is written to a refused connection before it is closed (a
	// canned HTTP 503, say); nil closes it at once.
	Refusal []byte
	// OnAcceptError is told each temporary accept error and the pause
	// before the next try (a log line).
	OnAcceptError func(err error, pause time.Duration)
}

// Listener wraps a net.Listener. Accept retries temporary errors (EMFILE,
// ENFILE, ECONNABORTED...) after a pause, as net/http does, instead of
// returning them to a server that would stop on them.
type Listener struct {
	net.Listener
	opt      Options
	maxConns atomic.Int64 // Options.MaxConns, or as SetMaxConns set it since
	open     atomic.Int64
	refused  atomic.Uint64
	refusing chan struct{} // slots for refusals in progress
	closed   chan struct{}
	once     sync.Once
}

// Listen wraps ln.
func Listen(ln net.Listener, opt Options) *Listener {
	l := &Listener{Listener: ln, opt: opt, closed: make(chan struct{}), refusing: make(chan struct{}, 64)}
	l.maxConns.Store(int64(opt.MaxConns))
	return l
}

// SetMaxConns changes the limit (0: none). Connections already open over a
// lowered limit stay; new ones are refused until the open count is below it.
func (l *Listener) SetMaxConns(n int) { l.maxConns.Store(int64(n)) }

// MaxConns is the limit now (0: none).
func (l *Listener) MaxConns() int { return int(l.maxConns.Load()) }

// Backoff bounds, as net/http's Serve.
const (
	firstPause = 5 * time.Millisecond
	maxPause   = time.Second
	// refusalLinger is how long a refused connection may take to read the
	// refusal before it is closed.
	refusalLinger = time.Second
)

// Backoff is the pause schedule between retried accepts, for accept loops
// that cannot use Listener (a Unix socket passing fds needs *net.UnixConn).
type Backoff struct{ pause time.Duration }

// Next is the pause before the next try: 5 ms, doubling up to 1 s.
func (b *Backoff) Next() time.Duration {
	b.pause = min(max(2*b.pause, firstPause), maxPause)
	return b.pause
}

// Reset starts the schedule over (after an accept succeeded).
func (b *Backoff) Reset() { b.pause = 0 }

func (l *Listener) Accept() (net.Conn, error) {
	var b Backoff
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if !Temporary(err) {
				return nil, err
			}
			pause := b.Next()
			if l.opt.OnAcceptError != nil {
				l.opt.OnAcceptError(err, pause)
			}
			select {
			case <-time.After(pause):
				continue
			case <-l.closed:
				return nil, net.ErrClosed
			}
		}
		b.Reset()
		// One read of the limit per connection: SetMaxConns may run meanwhile.
		if maxConns := l.maxConns.Load(); l.open.Add(1) > maxConns && maxConns > 0 {
			l.open.Add(-1)
			l.refuse(c)
			continue
		}
		return &conn{Conn: c, l: l}, nil
	}
}

// refuse answers c with the refusal, off the accept loop; when many
// refusals are already in progress it just closes c.
func (l *Listener) refuse(c net.Conn) {
	l.refused.Add(1)
	if len(l.opt.Refusal) == 0 {
		_ = c.Close()
		return
	}
	select {
	case l.refusing <- struct{}{}:
	default:
		_ = c.Close()
		return
	}
	go func() {
		defer func() { <-l.refusing }()
		// The request's head first: an HTTP client that reads an answer
		// before it sent its request takes it for a broken connection.
		_ = c.SetReadDeadline(time.Now().Add(refusalLinger))
		skipHead(c)
		_ = c.SetDeadline(time.Now().Add(refusalLinger))
		if _, err := c.Write(l.opt.Refusal); err == nil {
			// Read what the client sent, so closing does not reset the
			// connection before the refusal is read.
			inner := c
			if wc, ok := c.(*conn); ok {
				inner = wc.Conn
			}
			if tc, ok := inner.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			}
			var buf [512]byte
			for {
				if _, err := c.Read(buf[:]); err != nil {
					break
				}
			}
		}
		_ = c.Close()
	}()
}

// skipHead reads from c up to the end of an HTTP request head, 4 KiB, or
// an error (the deadline).
func skipHead(c net.Conn) {
	var buf [4 << 10]byte
	n := 0
	for n < len(buf) && !bytes.Contains(buf[:n], []byte("\r\n\r\n")) {
		k, err := c.Read(buf[n:])
		n += k
		if err != nil {
			return
		}
	}
}

// Refuse answers c, a connection Accept returned, as one over MaxConns is
// (a caller with its own admission rules refuses alike), and closes it.
func (l *Listener) Refuse(c net.Conn) { l.refuse(c) }

// Close stops accepting; a pause in progress ends at once.
func (l *Listener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// Open is the number of accepted connections not yet closed.
func (l *Listener) Open() int { return int(l.open.Load()) }

// Refused counts the connections refused over the limit.
func (l *Listener) Refused() uint64 { return l.refused.Load() }

// Temporary reports whether an accept error passes: out of file
// descriptors or buffers, a connection aborted before it was accepted, a
// timeout.
func Temporary(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
		syscall.ECONNABORTED, syscall.ECONNRESET, syscall.EINTR, syscall.EAGAIN, syscall.EPROTO} {
		if errors.Is(err, e) {
			return true
		}
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

type conn struct {
	net.Conn
	l    *Listener
	once sync.Once
}

func (c *conn) Close() error {
	c.once.Do(func() { c.l.open.Add(-1) })
	return c.Conn.Close()
}

// Unwrap is the accepted connection itself, for code that takes its
// socket over (the router's event loops); Close still frees its slot.
func (c *conn) Unwrap() net.Conn { return c.Conn }

// SyscallConn exposes the socket, so code that polls it (the router's
// departed-client watch) still can.
func (c *conn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.New("netutil: connection has no file descriptor")
	}
	return sc.SyscallConn()
}
