package router

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/router/splice"
)

// upstream is the router's HTTP/1.1 client towards workers. It is our own
// because neither stock client fits the PD path: fasthttp's cannot cancel a
// request in flight (a leg must die when the client leaves or the other leg
// fails), and net/http hands every request across two goroutines per
// connection, which costs more than the rest of the router together. Here a
// request is written and its head read by the calling goroutine on a pooled
// keep-alive connection, with fasthttp's parsers; ending the request's
// scope expires the connection's deadline, which ends any read or write at
// once.
//
// Pooled connections follow the registry (follow): a worker that leaves
// keeps none, and a connection idle for idleTimeout is closed by a timer
// that runs only while the pool holds any, so neither a removed nor an idle
// worker holds a file descriptor until shutdown.
type upstream struct {
	dialer      net.Dialer
	tls         *tls.Config   // for https workers; nil = system roots
	maxIdle     int           // idle connections kept per worker
	idleTimeout time.Duration // a connection idle this long is closed
	localWait   time.Duration // how long a dial out of local descriptors retries

	h2c *h2c // for the workers that serve h2c (upstream_h2c.go)

	// endpoints are the registered workers' base URLs split once
	// (follow), not at every request.
	endpoints atomic.Pointer[map[string]endpoint]

	mu      sync.Mutex
	idle    map[string][]*upConn // by host:port, most recent last
	workers map[string]bool      // the registered workers' host:port; nil = any
	reaper  *time.Timer          // runs reap
	reaping bool                 // reaper is armed
	closed  bool                 // shut down: nothing is pooled any more
}

// newUpstream pools up to 500 idle connections per worker (as smg), each
// closed after idleTimeout unused.
func newUpstream(idleTimeout time.Duration) *upstream {
	u := &upstream{
		dialer:      net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second},
		maxIdle:     500,
		idleTimeout: idleTimeout,
		localWait:   time.Second,
		idle:        map[string][]*upConn{},
	}
	u.h2c = newH2C(u)
	return u
}

type upConn struct {
	c        net.Conn
	br       *bufio.Reader
	addr     string
	lastUsed time.Time
	// warm: taken from the pool within warmReuse of its last reply, too
	// soon for a worker's close of it to be waiting unread.
	warm bool

	// raw is a plain TCP connection's socket (nil over TLS), through which
	// writeWait writes a request from inside the wait for its reply; step
	// is writeStep, made once per connection, call the request it writes
	// and wrote, failed its outcome.
	raw    syscall.RawConn
	step   func(uintptr) bool
	call   *upCall
	wrote  bool
	failed error
}

func newUpConn(nc net.Conn, addr string) *upConn {
	c := &upConn{c: nc, br: bufio.NewReaderSize(nc, upReadBuffer), addr: addr}
	if tc, ok := nc.(*net.TCPConn); ok {
		if raw, err := tc.SyscallConn(); err == nil {
			c.raw, c.step = raw, c.writeStep
		}
	}
	return c
}

// A connection keeps a reader the size of fasthttp's own default (its
// replies' heads must fit; longer reads bypass it), while the buffer a
// request is written through is lent only for the write: with thousands of
// streams open, per-connection buffers are most of the router's memory.
const upReadBuffer = 4 << 10

var requestWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 16<<10) }}

// cancelled expires the connection's deadline: a read or write in progress
// fails at once. Such a connection is never pooled again.
func (c *upConn) cancelled(error) { _ = c.c.SetDeadline(time.Unix(1, 0)) }

// upstreamResponse is a worker's reply: status and headers are read, the
// body streams from the connection. Close must be called; the connection
// goes back to the pool only if the body was read to its end.
type upstreamResponse struct {
	StatusCode int
	Header     *fasthttp.ResponseHeader
	body       io.Reader
	resp       *fasthttp.Response
	conn       *upConn
	u          *upstream
	scope      *scope // the connection is registered with it while in use
	eof        bool
	failed     bool

	h2     *h2cStream // an h2c reply's stream (conn is then nil)
	fields []byte     // the head's fields for the client, once packed (packHead): Header is then spent

	// idle, once set (idleTimeout), bounds every read: a reply silent that
	// long fails with errStreamIdle. idleUntil is the read deadline set.
	idle      time.Duration
	idleUntil time.Time
	idleGone  bool // awaitBody's wait ran out: the next read fails with errStreamIdle
}

func (r *upstreamResponse) Read(p []byte) (int, error) {
	if r.idleGone {
		r.failed = true
		return 0, errStreamIdle
	}
	if r.h2 != nil {
		return r.readH2C(p)
	}
	if r.idle > 0 {
		r.armIdle()
	}
	n, err := r.body.Read(p)
	if err == io.EOF {
		r.eof = true
	} else if err != nil {
		r.failed = true
		if r.idle > 0 && !time.Now().Before(r.idleUntil) && r.scope.Cause() == nil {
			err = errStreamIdle
		}
	}
	return n, err
}

// idleTimeout makes every later read fail with errStreamIdle once the
// reply has been silent for d (0: never).
func (r *upstreamResponse) idleTimeout(d time.Duration) { r.idle = d }

// armIdle keeps the connection's read deadline between idle and 9/8 idle
// ahead, moving it only when it is nearer than idle: at most once per
// idle/8, not once per chunk.
func (r *upstreamResponse) armIdle() {
	now := time.Now()
	if r.idleUntil.Sub(now) >= r.idle {
		return
	}
	r.idleUntil = now.Add(r.idle + r.idle/8)
	_ = r.conn.c.SetReadDeadline(r.idleUntil)
	// A cancellation that came first set a deadline in the past, which
	// this one just replaced: put it back.
	if r.scope.Cause() != nil {
		r.conn.cancelled(nil)
	}
}

// The stream relay reads a reply's chunk framing through the three methods
// below; only they look into the connection's reader.

// awaitBody waits until r's connection has received some of its body,
// in the connection's own reader: a stream waiting long for its first event
// (decode's comes after prefill and the KV transfer) holds no relay buffer
// meanwhile. A body of known length 0 has nothing to wait for, and an error
// is left to the read that follows, which meets it again.
func (r *upstreamResponse) awaitBody() {
	if r.h2 != nil {
		r.awaitH2C()
		return
	}
	if cl := r.Header.ContentLength(); r.conn != nil && (cl == -1 || cl > 0) {
		if r.idle > 0 { // the idle timeout covers the wait for the first byte
			r.armIdle()
		}
		_, err := r.conn.br.Peek(1)
		r.idleGone = err != nil && r.idle > 0 && !time.Now().Before(r.idleUntil) && r.scope.Cause() == nil
	}
}

// buffered reports whether r's connection (or h2c stream) holds bytes
// already received: a read of them cannot wait for the network.
func (r *upstreamResponse) buffered() bool {
	if r.h2 != nil {
		return r.h2.buffered()
	}
	return r.conn != nil && r.conn.br.Buffered() > 0
}

// readBuffered adds to buf[:n], which the last read of r filled short of
// its end, the chunks that r's connection has already received, as long
// as reading them cannot wait for the network: the events that arrived
// together reach the client in one write (and wake it once) instead of one
// flushed HTTP chunk each. It returns the new length and the error of the
// read that ended the body, if one did.
func (r *upstreamResponse) readBuffered(buf []byte, n int) (int, error) {
	// fasthttp reads a chunked body through the connection's reader, and a
	// read that ends short of its buffer with bytes still buffered has
	// ended at a chunk's end (it would otherwise have taken them): what is
	// buffered starts with the next chunk's size line.
	if r.Header.ContentLength() != -1 || r.conn == nil {
		return n, nil
	}
	br := r.conn.br
	for n < len(buf) {
		next, _ := br.Peek(br.Buffered())
		if !wholeChunk(next) {
			return n, nil
		}
		m, err := r.Read(buf[n:])
		n += m
		if err != nil || m == 0 {
			return n, err
		}
	}
	return n, nil
}

// wholeChunk reports whether b starts with a whole HTTP chunk with data: its
// size line, its bytes and the CRLF after them, so that reading it takes
// nothing from the network. The last chunk (size 0) is left to the next
// read, since its trailer section can be of any length; a malformed size
// line is too, and fails there.
func wholeChunk(b []byte) bool {
	size, i := 0, 0
	for ; i < len(b) && unhex(b[i]) >= 0; i++ {
		size = size<<4 | unhex(b[i])
	}
	if size == 0 || i > 8 { // a chunk under 4 GiB
		return false
	}
	end := bytes.IndexByte(b[i:], '\n')
	if end < 1 || b[i+end-1] != '\r' {
		return false
	}
	return len(b)-(i+end+1) >= size+2
}

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c - 'a' + 10)
	case 'A' <= c && c <= 'F':
		return int(c - 'A' + 10)
	}
	return -1
}

// ContentType is the reply's Content-Type.
func (r *upstreamResponse) ContentType() string { return string(r.Header.ContentType()) }

func (r *upstreamResponse) Close() error {
	if r.h2 != nil {
		return r.closeH2C()
	}
	if r.conn == nil {
		return nil
	}
	cancelled := !r.scope.unregister(r.conn)
	// Bytes already past the reply's end (a worker's wrong Content-Length)
	// would be read as the next request's reply.
	reusable := r.eof && !r.failed && !cancelled && !r.Header.ConnectionClose() && r.conn.br.Buffered() == 0
	_ = r.resp.CloseBodyStream()
	fasthttp.ReleaseResponse(r.resp)
	if reusable && !r.idleUntil.IsZero() {
		reusable = r.conn.c.SetReadDeadline(time.Time{}) == nil
	}
	if reusable {
		r.u.put(r.conn)
	} else {
		r.conn.c.Close()
	}
	r.conn = nil
	return nil
}

// post sends body to baseURL+path with the given extra header lines
// ("Name: value\r\n" each) and returns once the reply's head has arrived.
// The body's segments are written as they are: a large body is never
// copied into a buffer of its own.
//
// guard, when not nil, is how the body's owner takes it back while the
// call may still be writing it (guard.release).
func (u *upstream) post(sc *scope, baseURL, path string, body *splice.Body, extra []byte, guard *writeGuard) (*upstreamResponse, error) {
	var c upCall
	if _, err := c.writeWait(u, sc, baseURL, path, body, extra, guard, nil, 0); err != nil {
		return nil, err
	}
	return c.head()
}

// upCall is post in two steps, so that a caller can write two requests
// before it waits for either reply (a PD attempt): write sends the request,
// head reads the reply's head. A leg holds one, so it allocates nothing.
type upCall struct {
	u                *upstream
	sc               *scope
	addr, host, path string
	tlsHost          string
	body             *splice.Body
	extra            []byte
	guard            *writeGuard
	after            afterWrite // writeWait's, and its wait
	wait             time.Duration
	conn             *upConn           // the connection written on, until head
	reused           bool              // conn came from the pool
	into             *upstreamResponse // where head puts the reply; nil: a new one
}

// write sends the request (post's arguments) on a pooled connection, or a
// fresh one.
func (c *upCall) write(u *upstream, sc *scope, baseURL, path string, body *splice.Body, extra []byte, guard *writeGuard) error {
	addr, host, tlsHost, err := u.endpoint(baseURL)
	if err != nil {
		return err
	}
	*c = upCall{u: u, sc: sc, addr: addr, host: host, path: path, tlsHost: tlsHost, body: body, extra: extra, guard: guard}
	return c.send(true)
}

// send writes the request on a pooled connection (pooled) or a fresh one.
// A reused connection the worker closed while idle fails before any reply
// byte: the request goes again on a fresh one, as net/http does (the other
// pooled connections may be as dead as the first).
func (c *upCall) send(pooled bool) error {
	var conn *upConn
	reused := false
	if pooled {
		conn, reused = c.u.get(c.addr)
	}
	if conn == nil {
		nc, err := c.u.dial(c.sc, c.addr, c.tlsHost)
		if err != nil {
			if cause := c.sc.Cause(); cause != nil { // say why the dial was cut short
				return cause
			}
			return dialError{err}
		}
		conn = newUpConn(nc, c.addr)
	}
	return c.sendOn(conn, reused)
}

// sendOn writes the request on conn, which reused says came from the pool.
func (c *upCall) sendOn(conn *upConn, reused bool) error {
	c.conn, c.reused = conn, reused
	err := c.u.writeRequest(c.sc, conn, c.host, c.path, c.body, c.extra, c.guard)
	if err != nil && c.retryable(err) {
		return c.send(false)
	}
	return err
}

// afterWrite is what writeWait runs once its request is written, before it
// waits for the reply; false: no wait (the caller knows why).
type afterWrite interface{ afterWrite() bool }

// writeWait is write, after, then answered(d) (d 0: no limit) in one. On a
// pooled plain TCP connection the request is written from inside the wait
// for the reply's first byte (RawConn.Read), whose readiness is reset
// before the write, so that no read is tried before the reply can have
// come: one that finds nothing costs a system call, then waits anyway. A
// worker that closed the pooled connection meanwhile answers the write
// with a reset, which ends the wait as a reply would. It returns write's
// failure, or whether the reply began within d.
func (c *upCall) writeWait(u *upstream, sc *scope, baseURL, path string, body *splice.Body, extra []byte, guard *writeGuard, after afterWrite, d time.Duration) (bool, error) {
	addr, host, tlsHost, err := u.endpoint(baseURL)
	if err != nil {
		return false, err
	}
	*c = upCall{u: u, sc: sc, addr: addr, host: host, path: path, tlsHost: tlsHost, body: body, extra: extra, guard: guard, after: after}
	conn, reused := u.get(addr)
	if conn == nil || conn.raw == nil || !conn.warm {
		if conn == nil {
			err = c.send(false)
		} else {
			err = c.sendOn(conn, reused)
		}
		return c.then(after, d, err)
	}
	c.conn, c.reused, c.wait = conn, true, d
	conn.call, conn.wrote, conn.failed = c, false, nil
	werr := conn.raw.Read(conn.step)
	conn.call = nil
	if d > 0 {
		_ = conn.c.SetReadDeadline(time.Time{})
		if sc.Cause() != nil { // a cancellation's deadline, just replaced
			conn.cancelled(nil)
		}
	}
	switch {
	case !conn.wrote: // the wait failed before the write (never on a pooled connection)
		err = upFail(sc, conn, fmt.Errorf("%w: %v", errUpstreamClosed, werr))
	case conn.failed == errWriteFailed:
		err = upFail(sc, conn, nil)
	case conn.failed != nil:
		err = upFail(sc, conn, conn.failed)
	default:
		if werr != nil && errors.Is(werr, os.ErrDeadlineExceeded) && sc.Cause() == nil {
			return false, nil // silent for d
		}
		return true, nil // a reply began, or the wait's failure, which head meets again
	}
	if c.retryable(err) {
		err = c.send(false)
		return c.then(after, d, err)
	}
	return false, err
}

// then is writeWait's after and wait once write sent the request on a
// connection it could not wait on that way.
func (c *upCall) then(after afterWrite, d time.Duration, err error) (bool, error) {
	if err != nil {
		return false, err
	}
	if after != nil && !after.afterWrite() {
		return true, nil
	}
	if d == 0 {
		return true, nil // head waits
	}
	return c.answered(d), nil
}

// warmReuse bounds how long a connection may have idled for writeWait's
// path. That path resets the socket's readiness, so a worker's FIN that
// arrived while the connection idled is not seen until the worker answers
// the write: a half-closed worker, or one whose host vanished, never does.
// The plain path reads first and retries such a connection at once; under
// load connections come back within microseconds and take writeWait's.
const warmReuse = 50 * time.Millisecond

// errWriteFailed is writeOn's failure that the scope's cause explains.
var errWriteFailed = errors.New("write failed")

// writeStep is writeWait's RawConn.Read function: its first call writes
// the request and runs the call's after, the next reports the reply begun.
// It never closes the connection, whose read lock the wait holds (Close
// would wait for it).
func (c *upConn) writeStep(uintptr) bool {
	if c.wrote {
		return true
	}
	c.wrote = true
	call := c.call
	if c.failed = call.u.writeOn(call.sc, c, call.host, call.path, call.body, call.extra, call.guard); c.failed != nil {
		return true
	}
	if call.after != nil && !call.after.afterWrite() {
		return true
	}
	if call.wait > 0 { // from now, as answered's
		_ = c.c.SetReadDeadline(time.Now().Add(call.wait))
		if call.sc.Cause() != nil { // a cancellation's deadline, just replaced
			c.cancelled(nil)
		}
	}
	return false
}

func (c *upCall) retryable(err error) bool {
	return c.reused && c.sc.Err() == nil && errors.Is(err, errUpstreamClosed)
}

// head reads the reply's head of the request write sent.
func (c *upCall) head() (*upstreamResponse, error) {
	resp, err := c.u.readHead(c.sc, c.conn, c.into)
	if err != nil && c.retryable(err) {
		if err := c.send(false); err != nil {
			return nil, err
		}
		resp, err = c.u.readHead(c.sc, c.conn, c.into)
	}
	c.conn = nil
	return resp, err
}

// abandon closes the connection of a request written whose reply is not
// wanted any more.
func (c *upCall) abandon() {
	_ = upFail(c.sc, c.conn, nil)
	c.conn = nil
}

// answered reports whether the reply's first byte arrives within d (or the
// wait ended for another reason, which head then meets again): false means
// the worker is still silent, and nothing of its reply has been read.
func (c *upCall) answered(d time.Duration) bool {
	conn := c.conn
	_ = conn.c.SetReadDeadline(time.Now().Add(d))
	if c.sc.Cause() != nil { // a cancellation's deadline, just replaced
		conn.cancelled(nil)
	}
	_, err := conn.br.Peek(1)
	_ = conn.c.SetReadDeadline(time.Time{})
	if c.sc.Cause() != nil {
		conn.cancelled(nil)
		return true
	}
	return err == nil || !errors.Is(err, os.ErrDeadlineExceeded)
}

// dialError is a send that failed before a connection to the worker
// existed: the engine never saw the request.
type dialError struct{ error }

func (e dialError) Unwrap() error { return e.error }

// upFail ends a request on conn that failed: the connection is closed, and
// the error is the scope's cause if the scope ended (which is then why).
func upFail(sc *scope, conn *upConn, err error) error {
	sc.unregister(conn)
	conn.c.Close()
	if cause := sc.Cause(); cause != nil {
		return cause
	}
	return err
}

// writeRequest writes the request on conn, which the scope's end then
// cancels until the reply is closed.
func (u *upstream) writeRequest(sc *scope, conn *upConn, host, path string, body *splice.Body, extra []byte, guard *writeGuard) error {
	switch err := u.writeOn(sc, conn, host, path, body, extra, guard); err {
	case nil:
		return nil
	case errWriteFailed:
		return upFail(sc, conn, nil)
	default:
		return upFail(sc, conn, err)
	}
}

// writeOn is writeRequest but for closing conn when it fails (upFail's
// error: errWriteFailed where the scope's cause says why).
func (u *upstream) writeOn(sc *scope, conn *upConn, host, path string, body *splice.Body, extra []byte, guard *writeGuard) error {
	if !sc.register(conn) {
		return errWriteFailed
	}
	if !guard.begin() { // the reply is over: this attempt has nothing left to send
		sc.cancel(errBodyReleased)
		return errWriteFailed
	}
	bw := requestWriters.Get().(*bufio.Writer)
	bw.Reset(conn.c)
	bw.WriteString("POST ")
	bw.WriteString(path)
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	bw.WriteString(host)
	bw.WriteString("\r\nContent-Type: application/json\r\nContent-Length: ")
	bw.Write(strconv.AppendInt(bw.AvailableBuffer(), int64(body.Len()), 10))
	bw.WriteString("\r\n")
	bw.Write(extra)
	bw.WriteString("\r\n")
	// bufio copies the small segments and writes a large one straight
	// from the client's buffer.
	for seg := range body.Segments {
		bw.Write(seg)
	}
	err := bw.Flush()
	guard.end()
	bw.Reset(nil)
	requestWriters.Put(bw)
	if err != nil {
		return fmt.Errorf("%w: %v", errUpstreamClosed, err)
	}
	return nil
}

// readHead reads the head of the reply to the request written on conn into
// r (nil: a new one).
func (u *upstream) readHead(sc *scope, conn *upConn, r *upstreamResponse) (*upstreamResponse, error) {
	resp := fasthttp.AcquireResponse()
	resp.StreamBody = true
	if err := resp.Read(conn.br); err != nil {
		fasthttp.ReleaseResponse(resp)
		if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || isReset(err) {
			err = fmt.Errorf("%w: %v", errUpstreamClosed, err)
		}
		return nil, upFail(sc, conn, err)
	}
	if r == nil {
		r = new(upstreamResponse)
	}
	*r = upstreamResponse{StatusCode: resp.StatusCode(), Header: &resp.Header, resp: resp, conn: conn, u: u, scope: sc}
	r.body = resp.BodyStream()
	if r.body == nil { // no body (e.g. 204)
		r.body = strings.NewReader("")
	}
	return r, nil
}

// writeGuard hands a body back to its owner: a leg that may outlive the
// handler (prefill) writes it only under the guard, and release, called
// before the client's buffer may be reused, makes sure no write reads that
// buffer afterwards.
type writeGuard struct {
	mu       sync.Mutex
	writing  sync.Mutex // held during a write
	wrote    bool       // a write has been made
	released bool       // the owner took the buffer back
	detached bool       // then the body was given a copy of its own
}

var errBodyReleased = errors.New("request body released before it was sent")

// begin starts a write; false when the buffer is gone (a retry after
// release, on a connection the worker had closed).
func (g *writeGuard) begin() bool {
	if g == nil {
		return true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.released && !g.detached {
		return false
	}
	g.writing.Lock()
	return true
}

func (g *writeGuard) end() {
	if g == nil {
		return
	}
	g.mu.Lock()
	g.wrote = true
	g.mu.Unlock()
	g.writing.Unlock()
}

// releaseIdle is release when no write is under way: false otherwise,
// with nothing released.
func (g *writeGuard) releaseIdle(body *splice.Body) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.releaseIdleLocked(body)
}

// releaseIdleLocked, g.mu held, releases body unless a write is under way
// (false): a body not written yet gets a copy of its own.
func (g *writeGuard) releaseIdleLocked(body *splice.Body) bool {
	if !g.writing.TryLock() {
		return false
	}
	g.released = true
	if !g.wrote {
		body.Detach()
		g.detached = true
	}
	g.writing.Unlock()
	return true
}

// bodyWriteGrace is how long release lets a write under way finish: into a
// socket buffer that takes microseconds, so only a worker that does not
// read its socket is cut.
const bodyWriteGrace = 100 * time.Millisecond

// release returns once no write will read body's client bytes. A write
// under way gets bodyWriteGrace to end, then is ended by cancel; a body not
// written yet (its leg still dialing, or not yet scheduled) gets a copy of
// its own, which costs a copy only then.
func (g *writeGuard) release(body *splice.Body, cancel func()) {
	g.mu.Lock()
	g.released = true
	idle := g.releaseIdleLocked(body)
	g.mu.Unlock()
	if idle {
		return
	}
	for deadline := time.Now().Add(bodyWriteGrace); time.Now().Before(deadline); time.Sleep(50 * time.Microsecond) {
		if g.writing.TryLock() {
			g.writing.Unlock()
			return
		}
	}
	cancel()
	g.writing.Lock()
	g.writing.Unlock()
}

func isReset(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && !op.Timeout()
}

func (u *upstream) get(addr string) (*upConn, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	conns := u.idle[addr]
	for len(conns) > 0 {
		c := conns[len(conns)-1]
		conns = conns[:len(conns)-1]
		// No deadline to clear: a connection whose cancellation hook ran
		// is closed, never pooled (upstreamResponse.Close).
		if idle := time.Since(c.lastUsed); idle < u.idleTimeout {
			c.warm = idle < warmReuse
			u.idle[addr] = conns
			return c, true
		}
		c.c.Close()
	}
	u.idle[addr] = conns
	return nil, false
}

// put pools c, unless its worker has left the registry, the pool for it is
// full or the upstream is shut down: then c is closed.
func (u *upstream) put(c *upConn) {
	c.lastUsed = time.Now()
	u.mu.Lock()
	keep := !u.closed && len(u.idle[c.addr]) < u.maxIdle && (u.workers == nil || u.workers[c.addr])
	if keep {
		u.idle[c.addr] = append(u.idle[c.addr], c)
		if !u.reaping {
			u.reaping = true
			if u.reaper == nil {
				u.reaper = time.AfterFunc(u.idleTimeout, u.reap)
			} else {
				u.reaper.Reset(u.idleTimeout)
			}
		}
	}
	u.mu.Unlock()
	if !keep {
		c.c.Close()
	}
}

// reap closes the connections idle for idleTimeout and sets the timer for
// the next to expire, if any is left.
func (u *upstream) reap() {
	now := time.Now()
	u.mu.Lock()
	defer u.mu.Unlock()
	var next time.Duration
	for addr, conns := range u.idle {
		n := 0 // oldest first: the expired ones are a prefix
		for n < len(conns) && now.Sub(conns[n].lastUsed) >= u.idleTimeout {
			conns[n].c.Close()
			n++
		}
		if n == len(conns) {
			delete(u.idle, addr)
			continue
		}
		conns = slices.Delete(conns, 0, n)
		u.idle[addr] = conns
		if d := u.idleTimeout - now.Sub(conns[0].lastUsed); next == 0 || d < next {
			next = d
		}
	}
	u.reaping = next > 0 && !u.closed
	if u.reaping {
		u.reaper.Reset(next)
	}
}

// follow makes the registered workers in snap the only ones whose
// connections are pooled: the idle connections of any other are closed
// now, and those in use when their request ends. It reports whether a
// worker left.
func (u *upstream) follow(snap *balancer.Snapshot) bool {
	workers := make(map[string]bool, len(snap.All))
	endpoints := make(map[string]endpoint, len(snap.All))
	for _, w := range snap.All {
		if addr, host, tlsHost, err := hostPort(w.BaseURL); err == nil {
			workers[addr] = true
			endpoints[w.BaseURL] = endpoint{addr, host, tlsHost}
		}
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	u.endpoints.Store(&endpoints) // under mu: the last snapshot's wins
	left := false
	for addr := range u.workers {
		left = left || !workers[addr]
	}
	u.workers = workers
	for addr, conns := range u.idle {
		if !workers[addr] {
			closeAll(conns)
			delete(u.idle, addr)
		}
	}
	return left
}

// close closes every pooled connection and pools none from now on (at
// shutdown).
func (u *upstream) close() {
	u.mu.Lock()
	u.closed = true
	if u.reaper != nil {
		u.reaper.Stop()
	}
	u.mu.Unlock()
	u.dropIdle()
	u.h2c.close()
}

func closeAll(conns []*upConn) {
	for _, c := range conns {
		c.c.Close()
	}
}

// endpoint is a worker base URL split by hostPort.
type endpoint struct{ addr, host, tlsHost string }

// endpoint is hostPort for baseURL, from the registered workers' when it is
// one of them.
func (u *upstream) endpoint(baseURL string) (addr, host, tlsHost string, err error) {
	if m := u.endpoints.Load(); m != nil {
		if e, ok := (*m)[baseURL]; ok {
			return e.addr, e.host, e.tlsHost, nil
		}
	}
	return hostPort(baseURL)
}

// hostPort splits a worker base URL into a dial address, a Host header and,
// for https, the TLS server name.
func hostPort(baseURL string) (addr, host, tlsHost string, err error) {
	rest, secure := strings.CutPrefix(baseURL, "https://")
	if !secure {
		var ok bool
		if rest, ok = strings.CutPrefix(baseURL, "http://"); !ok {
			return "", "", "", errors.New("unsupported worker URL " + baseURL)
		}
	}
	host, _, _ = strings.Cut(rest, "/")
	addr = host
	if _, _, err := net.SplitHostPort(host); err != nil {
		port := "80"
		if secure {
			port = "443"
		}
		addr = net.JoinHostPort(strings.Trim(host, "[]"), port)
	}
	if secure {
		tlsHost, _, _ = net.SplitHostPort(addr)
	}
	return addr, host, tlsHost, nil
}

// dial connects to addr. A dial that fails for want of the router's own
// descriptors (outOfLocalResources) first frees the pooled idle ones, then
// waits for others to close (prefill legs end in milliseconds), for up to
// localWait in all, before it fails: a burst of streams at the fd limit
// then waits a little instead of failing.
func (u *upstream) dial(ctx context.Context, addr, tlsHost string) (net.Conn, error) {
	var b netutil.Backoff
	deadline := time.Now().Add(u.localWait)
	for {
		c, err := u.dialOnce(ctx, addr, tlsHost)
		if err == nil || !outOfLocalResources(err) || !time.Now().Before(deadline) {
			return c, err
		}
		u.dropIdle()
		t := time.NewTimer(min(b.Next(), time.Until(deadline)))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, err
		}
	}
}

// dropIdle closes every pooled connection (they hold descriptors a dial
// needs).
func (u *upstream) dropIdle() {
	u.mu.Lock()
	defer u.mu.Unlock()
	for addr, conns := range u.idle {
		closeAll(conns)
		delete(u.idle, addr)
	}
}

func (u *upstream) dialOnce(ctx context.Context, addr, tlsHost string) (net.Conn, error) {
	if tlsHost == "" {
		return u.dialer.DialContext(ctx, "tcp", addr)
	}
	d := tls.Dialer{NetDialer: &u.dialer, Config: workerTLSFor(u.tls, tlsHost)}
	return d.DialContext(ctx, "tcp", addr)
}
