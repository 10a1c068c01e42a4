//go:build linux

package router

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
	"golang.org/x/sys/unix"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// evLoops are the event loops of one Server (evloop.go). A client
// connection's socket sits in a loop's epoll set beside Go's netpoller, as
// a parked one does (parkconn.go); nothing reads it through its net.Conn
// while the loop holds it, and it is closed through the net.Conn, which
// the client limit counts. Worker connections are the loop's own
// non-blocking sockets, kept alive in a pool per loop and worker.
type evLoops struct {
	s     *Server
	loops []*evLoop
	next  atomic.Uint32
	owned atomic.Int64 // client connections the loops hold
	// stopping refuses new connections; handoffs counts connections on
	// their way to fasthttp.
	stopping  atomic.Bool
	handoffs  sync.WaitGroup
	handedOff atomic.Int64 // connections given to fasthttp so far
	running   sync.WaitGroup
}

// newEvLoops starts n loops; nil when n is 0 or the router is not in
// regular mode.
func newEvLoops(s *Server, n int) (*evLoops, error) {
	if n <= 0 || s.cfg.PDDisaggregation || s.frontTLS != nil {
		return nil, nil
	}
	e := &evLoops{s: s}
	for range n {
		l, err := newEvLoop(e)
		if err != nil {
			for _, l := range e.loops {
				l.closeFDs()
			}
			return nil, err
		}
		e.loops = append(e.loops, l)
	}
	for _, l := range e.loops {
		e.running.Add(1)
		go l.run()
	}
	return e, nil
}

// take gives c to a loop; false leaves it to the caller (fasthttp).
func (e *evLoops) take(c net.Conn) bool {
	if e == nil || e.stopping.Load() {
		return false
	}
	fd, ok := detach(c)
	if !ok {
		return false
	}
	l := e.loops[e.next.Add(1)%uint32(len(e.loops))]
	e.owned.Add(1)
	e.s.metrics.httpConnections.Inc()
	if !l.post(func() { l.adopt(c, fd) }) { // the loop has stopped: fasthttp serves it
		e.owned.Add(-1)
		l.handOffSocket(c, fd, nil)
	}
	return true
}

// detach takes c's socket out of Go's netpoller, which would otherwise
// be woken for every request the loop reads from it too: a duplicate
// descriptor keeps the socket, and the connection itself is closed. c's
// own Close then only frees its slot under --max-connections (netutil).
func detach(c net.Conn) (int, bool) {
	u, ok := c.(interface{ Unwrap() net.Conn })
	if !ok {
		return -1, false
	}
	tcp, ok := u.Unwrap().(*net.TCPConn)
	if !ok {
		return -1, false
	}
	rc, err := tcp.SyscallConn()
	if err != nil {
		return -1, false
	}
	fd := -1
	if rc.Control(func(f uintptr) { fd, err = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) }) != nil || err != nil {
		return -1, false
	}
	_ = tcp.Close()
	return fd, true // non-blocking: the flag is the socket's, shared with the duplicate
}

// slotConn is a socket the loops gave back to fasthttp, as a net.Conn of
// its own; closing it frees the accepted connection's slot too.
type slotConn struct {
	*net.TCPConn
	slot net.Conn
}

func (c *slotConn) Close() error {
	_ = c.slot.Close() // its socket is closed already (detach)
	return c.TCPConn.Close()
}

// shutdown stops taking connections, closes the idle ones, lets requests
// in flight finish until ctx ends, answers those left shuttingDown, then
// stops the loops.
func (e *evLoops) shutdown(ctx context.Context) {
	if e == nil {
		return
	}
	e.stopping.Store(true)
	for _, l := range e.loops {
		l.post(l.drain)
	}
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
wait:
	for e.owned.Load() > 0 {
		select {
		case <-ctx.Done():
			for _, l := range e.loops {
				l.post(l.closeAll)
			}
			break wait
		case <-t.C:
		}
	}
	for _, l := range e.loops {
		l.post(nil) // nil: stop
	}
	e.running.Wait()
}

// awaitHandoffs waits, until ctx ends, for the connections the loops gave
// fasthttp to be done: after fasthttp's own shutdown, which closes them.
func (e *evLoops) awaitHandoffs(ctx context.Context) {
	if e == nil {
		return
	}
	done := make(chan struct{})
	go func() { e.handoffs.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// evLoop is one loop: its epoll set, an eventfd that wakes it for posted
// work, and what it holds.
type evLoop struct {
	e    *evLoops
	s    *Server
	ep   int
	wake int

	mu      sync.Mutex
	inbox   []func() // posted work; a nil entry stops the loop
	stopped bool     // its descriptors are closed

	conns map[uint32]*evConn // by token
	ups   map[uint32]*evUp
	token uint32
	pool  map[string][]*evUp // idle worker connections by address
	// snap is the worker snapshot follow last saw; endpoints its workers'
	// addresses, when snapOK (the loops can reach them all).
	snap      *balancer.Snapshot
	snapOK    bool
	endpoints map[*balancer.Worker]endpoint
	events    [128]unix.EpollEvent
	scratch   evScratch
	// now is when epoll_wait last returned: the connections' idle and
	// read timestamps, which only the 100 ms sweep reads, need no finer
	// clock than one read per wakeup.
	now time.Time
}

// evScratch is the loop's parsing and writing state, reused request after
// request: a loop serves one at a time.
type evScratch struct {
	rd   bytes.Reader
	br   *bufio.Reader
	resp fasthttp.Response
	out  outBuf
	bw   *bufio.Writer
	info splice.Info
	reqs []*fasthttp.RequestCtx // idle contexts
	free []*evRequest           // ended, and held by no retry timer
}

// outBuf is where bw writes a response: the client connection's output.
type outBuf struct{ b *[]byte }

func (o outBuf) Write(p []byte) (int, error) { *o.b = append(*o.b, p...); return len(p), nil }

// Tokens tell a loop's sockets apart in epoll events: client connections
// below upTokens, worker connections from it.
const upTokens = 1 << 31

func newEvLoop(e *evLoops) (*evLoop, error) {
	l := &evLoop{e: e, s: e.s, ep: -1, wake: -1, conns: map[uint32]*evConn{}, ups: map[uint32]*evUp{}, pool: map[string][]*evUp{},
		endpoints: map[*balancer.Worker]endpoint{}}
	var err error
	if l.ep, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return nil, fmt.Errorf("event loop: epoll_create: %w", err)
	}
	if l.wake, err = unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC); err != nil {
		l.closeFDs()
		return nil, fmt.Errorf("event loop: eventfd: %w", err)
	}
	if err = unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, l.wake, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: 0}); err != nil {
		l.closeFDs()
		return nil, fmt.Errorf("event loop: epoll_ctl: %w", err)
	}
	l.scratch.br = bufio.NewReaderSize(nil, max(e.s.cfg.MaxHeaderSize, 4096))
	l.scratch.bw = bufio.NewWriterSize(nil, 4096)
	return l, nil
}

func (l *evLoop) closeFDs() {
	for _, fd := range []int{l.wake, l.ep} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// post runs f on the loop; nil stops it. False once it has stopped: f
// is dropped.
func (l *evLoop) post(f func()) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stopped {
		return false
	}
	l.inbox = append(l.inbox, f)
	one := [8]byte{1}
	_, _ = unix.Write(l.wake, one[:])
	return true
}

// sweepEvery is how often a loop looks for connections past a timeout.
const sweepEvery = 100 * time.Millisecond

func (l *evLoop) run() {
	runtime.LockOSThread()
	defer l.e.running.Done()
	defer func() {
		l.mu.Lock()
		l.stopped = true
		l.closeFDs()
		l.mu.Unlock()
	}()
	l.now = time.Now()
	nextSweep := l.now.Add(sweepEvery)
	for {
		wait := -1
		if len(l.conns) > 0 || len(l.ups) > 0 {
			wait = max(int(time.Until(nextSweep)/time.Millisecond), 0) + 1
		}
		n, err := unix.EpollWait(l.ep, l.events[:], wait)
		l.now = time.Now()
		if err != nil && err != unix.EINTR {
			l.s.log.Error("event loop stopped: epoll_wait failed; its connections are closed")
			l.closeAll()
			return
		}
		for _, ev := range l.events[:max(n, 0)] {
			tok := uint32(ev.Fd)
			switch {
			case tok == 0:
				if !l.runInbox() {
					return
				}
			case tok >= upTokens:
				if u := l.ups[tok]; u != nil {
					l.upEvent(u, ev.Events)
				}
			default:
				if c := l.conns[tok]; c != nil {
					l.clientEvent(c, ev.Events)
				}
			}
		}
		if !l.now.Before(nextSweep) {
			l.sweep(l.now)
			nextSweep = l.now.Add(sweepEvery)
		}
	}
}

// runInbox runs the posted work; false once told to stop.
func (l *evLoop) runInbox() bool {
	var b [8]byte
	_, _ = unix.Read(l.wake, b[:])
	l.mu.Lock()
	work := l.inbox
	l.inbox = nil
	l.mu.Unlock()
	for _, f := range work {
		if f == nil {
			l.closeAll()
			return false
		}
		f()
	}
	return true
}

func (l *evLoop) nextToken(up bool) uint32 {
	for {
		l.token = (l.token + 1) % upTokens
		t := l.token
		if up {
			t |= upTokens
		}
		if _, used := l.conns[t]; t != 0 && !used {
			if _, used := l.ups[t]; !used {
				return t
			}
		}
	}
}

// evConn is a client connection a loop holds. buf[:n] are the bytes read
// and not yet answered; a request in flight spans the first of them.
type evConn struct {
	nc    net.Conn
	fd    int
	token uint32
	buf   []byte
	n     int
	out   []byte // the response being written, from off on
	off   int
	// since is when the connection went idle, or when the request now
	// being read began (its head complete: headAt).
	since, headAt time.Time
	req           *evRequest
	readable      bool
	closeAfter    bool
	gone          bool // closed or handed off: no longer the loop's
	hup           bool // the client shut its side: read to the end
	late          bool // its partial request ran out of time
	answered      bool // it has had a reply: it waits for a next request
}

// clientBuf is a client connection's first buffer; it grows for a larger
// request and shrinks back after it.
const clientBuf = 16 << 10

func (l *evLoop) adopt(c net.Conn, fd int) {
	ec := &evConn{nc: c, fd: fd, token: l.nextToken(false), buf: make([]byte, clientBuf), since: l.now, readable: true}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(ec.token)}
	if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		l.handOff(ec) // fasthttp serves it as it would have
		return
	}
	l.conns[ec.token] = ec
	l.serve(ec)
}

// release forgets c: it leaves the epoll set and the loop.
func (l *evLoop) release(c *evConn) {
	c.gone = true
	_ = unix.EpollCtl(l.ep, unix.EPOLL_CTL_DEL, c.fd, nil)
	delete(l.conns, c.token)
	l.e.owned.Add(-1)
}

// closeConn closes c, through its net.Conn: the client limit counts it.
func (l *evLoop) closeConn(c *evConn) {
	if c.req != nil {
		l.abandon(c.req, errClientGone)
	}
	l.release(c)
	l.s.metrics.httpConnections.Dec()
	unix.Close(c.fd)
	_ = c.nc.Close() // frees its slot
}

// handOff gives c to fasthttp with the bytes read so far in front, for the
// request they begin and all after it.
func (l *evLoop) handOff(c *evConn) {
	if _, held := l.conns[c.token]; held {
		l.release(c)
	} else { // adopt's: never in the set
		c.gone = true
		l.e.owned.Add(-1)
	}
	var kept []byte
	if c.n > 0 {
		kept = c.buf[:c.n]
	}
	l.handOffSocket(c.nc, c.fd, &handOffState{kept: kept, late: c.late})
}

type handOffState struct {
	kept []byte // read already: the start of the next request
	late bool   // its partial request ran out of time
}

// handOffSocket serves fd, the socket of slot, on fasthttp.
func (l *evLoop) handOffSocket(slot net.Conn, fd int, st *handOffState) {
	f := os.NewFile(uintptr(fd), "")
	fc, err := net.FileConn(f) // in Go's netpoller again
	f.Close()
	tcp, ok := fc.(*net.TCPConn)
	if err != nil || !ok {
		if fc != nil {
			fc.Close()
		}
		_ = slot.Close()
		l.s.metrics.httpConnections.Dec()
		return
	}
	var conn net.Conn = &lazyDeadlineConn{Conn: &slotConn{TCPConn: tcp, slot: slot}} // as Serve's listeners wrap it
	if st != nil && st.late {
		conn = &expiredConn{Conn: conn}
	}
	hc := &headConn{Conn: conn}
	if st != nil && len(st.kept) > 0 {
		hc.keep(st.kept)
	}
	l.e.handedOff.Add(1)
	l.e.handoffs.Add(1)
	go func() {
		defer l.e.handoffs.Done()
		// ServeConn closes it, and ConnState the gauge's count; what it
		// failed on is logged as fasthttp's worker pool does.
		if err := l.s.srv.ServeConn(hc); err != nil && !quietServeError(err) {
			l.s.srv.Logger.Printf("error when serving connection %q<->%q: %v", hc.LocalAddr(), hc.RemoteAddr(), err)
		}
	}()
}

// quietServeError reports the errors of serving a connection that
// fasthttp's worker pool does not log.
func quietServeError(err error) bool {
	s := err.Error()
	return strings.Contains(s, "broken pipe") || strings.Contains(s, "reset by peer") ||
		strings.Contains(s, "request headers: "+fasthttp.ErrSmallReadBuffer.Error()) ||
		strings.Contains(s, "unexpected EOF") || strings.Contains(s, "i/o timeout") ||
		errors.Is(err, fasthttp.ErrBadTrailer)
}

func (l *evLoop) clientEvent(c *evConn, ev uint32) {
	if ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 && c.req != nil {
		l.closeConn(c) // the client left before its reply
		return
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		c.readable = true
	}
	c.hup = c.hup || ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0
	if c.off < len(c.out) && !l.flush(c) {
		return
	}
	l.serve(c)
}

// serve reads and answers c's requests until it must wait.
func (l *evLoop) serve(c *evConn) {
	for !c.gone && c.req == nil && c.off == len(c.out) {
		if c.closeAfter {
			l.closeConn(c)
			return
		}
		if done := l.next(c); done {
			continue
		}
		if !c.readable {
			return
		}
		if c.n == len(c.buf) {
			l.handOff(c) // a head larger than the buffer: fasthttp's 431 or more reading
			return
		}
		m, err := unix.Read(c.fd, c.buf[c.n:])
		if err == unix.EAGAIN {
			c.readable = false
			return
		}
		if err != nil || m == 0 {
			if c.n > 0 {
				l.handOff(c) // fasthttp answers what the partial request deserves
			} else {
				l.closeConn(c)
			}
			return
		}
		if c.n == 0 {
			c.since = l.now
		}
		// A short read drained the socket: the next bytes raise a new
		// edge, so waiting for it saves a read that would find none.
		if m < len(c.buf)-c.n && !c.hup {
			c.readable = false
		}
		c.n += m
	}
}

// next starts the request at the front of c's bytes; false when they are
// not a whole request yet. A request the loop does not serve goes to
// fasthttp (and true: c is then no longer the loop's).
func (l *evLoop) next(c *evConn) bool {
	if c.n == 0 {
		return false
	}
	end := bytes.Index(c.buf[:c.n], []byte("\r\n\r\n"))
	if end < 0 {
		return false
	}
	end += 4
	ctx := l.ctx()
	l.scratch.rd.Reset(c.buf[:end])
	l.scratch.br.Reset(&l.scratch.rd)
	h := &ctx.Request.Header
	var route generationRoute
	ok := false
	if h.Read(l.scratch.br) == nil {
		route, ok = l.s.loopLane(h)
	}
	if !ok {
		l.putCtx(ctx)
		l.handOff(c)
		return true
	}
	if c.headAt.IsZero() {
		c.headAt = l.now
	}
	need := end + h.ContentLength()
	if c.n < need {
		if need > len(c.buf) {
			c.buf = append(c.buf[:c.n], make([]byte, need-c.n)...)
		}
		l.putCtx(ctx)
		return false
	}
	body := c.buf[end:need]
	info := &l.scratch.info
	*info = splice.Info{}
	if splice.Inspect(body, info) != nil || info.Stream {
		l.putCtx(ctx)
		l.handOff(c)
		return true
	}
	snap := l.s.reg.Snapshot()
	if !l.follow(snap) {
		l.putCtx(ctx)
		l.handOff(c)
		return true
	}
	ctx.Request.SetBodyRaw(body)
	l.begin(c, ctx, route, need, snap)
	return true
}

// follow reports whether the loops can send a request to any worker a
// policy may pick in snap, and keeps their addresses for send: a snapshot
// changes far less often than requests come.
func (l *evLoop) follow(snap *balancer.Snapshot) bool {
	if snap == l.snap {
		return l.snapOK
	}
	l.snap, l.snapOK = snap, false
	clear(l.endpoints)
	avail := snap.Available(balancer.Regular)
	for _, w := range avail {
		addr, host, ok := loopWorker(w)
		if !ok {
			return false
		}
		l.endpoints[w] = endpoint{addr: addr, host: host}
	}
	l.snapOK = len(avail) > 0
	return l.snapOK
}

func (l *evLoop) ctx() *fasthttp.RequestCtx {
	if n := len(l.scratch.reqs); n > 0 {
		ctx := l.scratch.reqs[n-1]
		l.scratch.reqs = l.scratch.reqs[:n-1]
		return ctx
	}
	ctx := new(fasthttp.RequestCtx)
	ctx.Init2(nil, fasthttpLog{l.s.log}, false)
	return ctx
}

func (l *evLoop) putCtx(ctx *fasthttp.RequestCtx) {
	ctx.Request.Reset()
	ctx.Response.Reset()
	ctx.SetUserValue(nil, nil)
	l.scratch.reqs = append(l.scratch.reqs, ctx)
}

// evRequest is a request a loop serves: fasthttp's RequestCtx for what the
// router's functions read and write, the router's request, and its leg's
// worker connection.
type evRequest struct {
	c     *evConn
	ctx   *fasthttp.RequestCtx
	r     *request
	start time.Time
	size  int // of its bytes in c.buf
	up    *evUp
	addr  string
	fail  *apiError // the last try's, while the next waits
	ended bool      // answered, or its client left
	timed bool      // a retry's backoff timer holds it
}

// newRequest is an ended request of the loop's, or a new one: a request
// allocates nothing (TestRegularRequestAllocations).
func (l *evLoop) newRequest() *evRequest {
	if n := len(l.scratch.free); n > 0 {
		q := l.scratch.free[n-1]
		l.scratch.free = l.scratch.free[:n-1]
		return q
	}
	return new(evRequest)
}

// recycle keeps q for a next request once nothing refers to it: it has
// ended, no retry timer will run it, and no worker connection serves it.
func (l *evLoop) recycle(q *evRequest) {
	if q.ended && !q.timed && q.up == nil {
		*q = evRequest{}
		l.scratch.free = append(l.scratch.free, q)
	}
}

// begin does what handle, generation, serve and regularAttempt do for
// a request up to its send, and sends it.
func (l *evLoop) begin(c *evConn, ctx *fasthttp.RequestCtx, g generationRoute, size int, snap *balancer.Snapshot) {
	s := l.s
	q := l.newRequest()
	*q = evRequest{c: c, ctx: ctx, start: time.Now(), size: size}
	c.req = q
	s.setRequestID(ctx)
	rr := regularRequests.Get().(*regularRequest)
	r := &rr.request
	r.out, r.whole = &rr.out, rr
	r.s, r.route, r.path, r.start, r.requestID = s, g.kind, g.path, q.start, responseRequestID(ctx)
	r.body = ctx.PostBody()
	r.info = l.scratch.info
	r.header = forwardHeaders(r.headerSpace[:0], ctx, false, r.requestID)
	r.refs.Store(1)
	r.pins.Store(1)
	s.live.Add(1)
	q.r = r
	r.rec.admission = admitted
	r.rec.model, r.rec.routed = s.modelLabel(r), true
	l.attempt(q, snap)
}

// attempt makes r's next try, as serve's loop and regularAttempt do.
func (l *evLoop) attempt(q *evRequest, snap *balancer.Snapshot) {
	s, r := l.s, q.r
	w, fail := s.pick(snap, balancer.Regular, r, s.policyRequest(q.ctx, r))
	if fail != nil {
		l.failed(q, fail)
		return
	}
	r.out.Reset(r.body)
	lg := &r.leg
	lg.open(r, w, s.setRID(r, r.out, batchSize(r.route, r.body, &r.info)))
	lg.sc = &r.scope
	w.AwaitReply()
	ep := l.endpoints[w]
	q.addr = ep.addr
	if err := l.send(q, ep.host, false); err != nil {
		l.sendFailed(q, err)
	}
}

// send writes q's request to a pooled connection to its worker, or a new
// one (fresh).
func (l *evLoop) send(q *evRequest, host string, fresh bool) error {
	u, err := l.upstream(q.addr, fresh)
	if err != nil {
		return err
	}
	u.req, q.up = q, u
	b := u.out[:0]
	b = append(b, "POST "...)
	b = append(b, q.r.path...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, host...)
	b = append(b, "\r\nContent-Type: application/json\r\nContent-Length: "...)
	b = strconv.AppendInt(b, int64(q.r.out.Len()), 10)
	b = append(b, "\r\n"...)
	b = append(b, q.r.header...)
	b = append(b, "\r\n"...)
	for seg := range q.r.out.Segments {
		b = append(b, seg...)
	}
	u.out, u.off = b, 0
	u.host = host
	if !u.connecting {
		l.upWrite(u)
	}
	return nil
}

// sendFailed ends q's try on a failure before its reply's head, as
// regularAttempt does.
func (l *evLoop) sendFailed(q *evRequest, err error) {
	r := q.r
	_ = r.leg.answered(nil, err)
	r.leg.close()
	if errors.Is(err, context.DeadlineExceeded) {
		l.failed(q, &apiError{Status: 504, Code: "call_upstream_timeout", Message: "Upstream request timed out: " + err.Error()})
		return
	}
	l.failed(q, &apiError{Status: 502, Code: "call_upstream_connection_failed", Message: "Failed to reach worker: " + err.Error()})
}

// bodyFailed ends q's try on a reply whose body broke off, as replyWhole
// does.
func (l *evLoop) bodyFailed(q *evRequest, status int, err error) {
	lg := &q.r.leg
	lg.reply = upstreamResponse{StatusCode: status}
	_ = lg.answered(&lg.reply, nil)
	lg.bodyFailed()
	lg.close()
	l.failed(q, &apiError{Status: 502, Code: "read_response_failed", Message: "Failed to read worker response: " + err.Error()})
}

// failed ends q's try with fail: serve's loop makes another, after its
// backoff and once the engine aborts of this one are answered (settle),
// or answers the last failure.
func (l *evLoop) failed(q *evRequest, fail *apiError) {
	s, r := l.s, q.r
	attempts := s.cfg.Retry.Attempts()
	if !balancer.Retryable(fail.Status) || r.attempt == attempts-1 {
		r.rec.exhausted = balancer.Retryable(fail.Status) && attempts > 1
		l.answer(q, fail)
		return
	}
	r.attempt++
	backoff := s.cfg.Retry.Backoff(r.attempt - 1)
	r.rec.backoffs = append(r.rec.backoffs, backoff)
	q.fail, q.timed = fail, true
	r.pin() // r's memory outlives the request if it ends meanwhile
	time.AfterFunc(backoff, func() {
		r.aborts.Wait()
		if !l.post(func() { l.retry(q) }) { // the loop has stopped, and answered q
			r.unpin()
		}
	})
}

// retry makes q's next try, unless q has ended meanwhile (its client left,
// it timed out, the router stops).
func (l *evLoop) retry(q *evRequest) {
	r := q.r
	defer r.unpin()
	q.timed = false
	if q.ended {
		l.recycle(q)
		return
	}
	snap := l.s.reg.Snapshot()
	if r.scope.Err() != nil || !l.follow(snap) {
		l.answer(q, q.fail) // a worker the loop cannot reach is a case for fasthttp's next request
		return
	}
	l.attempt(q, snap)
}

// finishRequest is request.finish for a request no inflight tracker
// holds: the loop times it out and watches its client itself.
func (l *evLoop) finishRequest(r *request) {
	r.rec.responded(r)
	if r.refs.Add(-1) == 0 {
		r.emit()
		r.cancel(context.Canceled)
		l.s.live.Add(-1)
		r.unpin()
	}
}

// replied makes the worker's whole reply, its head parsed into resp, q's
// answer, as replyWhole and regularAttempt do.
func (l *evLoop) replied(q *evRequest, resp *fasthttp.Response, body []byte) {
	r, ctx := q.r, q.ctx
	lg := &r.leg
	lg.reply = upstreamResponse{StatusCode: resp.StatusCode(), Header: &resp.Header, eof: true}
	_ = lg.answered(&lg.reply, nil)
	status := resp.StatusCode()
	var fail *apiError
	if status/100 == 2 {
		ctx.Response.ResetBody()
		ctx.Response.AppendBody(body)
		ctx.SetStatusCode(status)
		copyHeaders(ctx, &lg.reply)
		r.observeFirstByte()
	} else {
		raw := append([]byte{}, body[:min(len(body), maxErrorBody)]...)
		fail = &apiError{Status: status, Code: "upstream_" + statusLabel(status), raw: raw, rawType: string(resp.Header.ContentType())}
	}
	lg.close()
	if fail != nil {
		l.failed(q, fail)
		return
	}
	l.answer(q, nil)
}

// answer ends q with its reply or fail, as answerFailure and handle do,
// and writes the response.
func (l *evLoop) answer(q *evRequest, fail *apiError) {
	s, r, ctx, c := l.s, q.r, q.ctx, q.c
	q.ended = true
	if fail := r.ending(fail); fail != nil {
		fail.write(ctx)
	}
	path := r.path // r is recycled once finished
	l.finishRequest(r)
	s.metrics.observeHTTP("POST", path, ctx.Response.StatusCode(), errorCode(ctx), since(q.start))
	ctx.Response.Header.SetServer(s.srv.Name) // fasthttp's server adds its name
	if s.draining.Load() {
		ctx.Response.SetConnectionClose()
		c.closeAfter = true
	}
	c.out = c.out[:0]
	l.scratch.out.b = &c.out
	l.scratch.bw.Reset(l.scratch.out)
	_ = ctx.Response.Write(l.scratch.bw)
	_ = l.scratch.bw.Flush()
	l.scratch.bw.Reset(nil)
	c.off = 0
	c.req = nil
	l.putCtx(ctx)
	l.consume(c, q.size)
	l.recycle(q)
	if l.flush(c) {
		l.serve(c)
	}
}

// consume drops the bytes of the request just answered.
func (l *evLoop) consume(c *evConn, k int) {
	c.n = copy(c.buf, c.buf[k:c.n])
	if len(c.buf) > clientBuf && c.n <= clientBuf {
		c.buf = append(make([]byte, 0, clientBuf), c.buf[:c.n]...)[:clientBuf]
	}
	c.since, c.headAt = l.now, time.Time{}
	c.answered = true
}

// flush writes c's response; false while some is left (or c closed).
func (l *evLoop) flush(c *evConn) bool {
	for c.off < len(c.out) {
		m, err := unix.Write(c.fd, c.out[c.off:])
		if err == unix.EAGAIN {
			return false
		}
		if err != nil {
			l.closeConn(c)
			return false
		}
		c.off += m
	}
	c.out, c.off = c.out[:0], 0
	if cap(c.out) > clientBuf {
		c.out = nil
	}
	return true
}

// abandon ends q without a reply from its worker: its client left, it
// timed out, or the router stops. The leg's scope says which.
func (l *evLoop) abandon(q *evRequest, cause error) {
	r := q.r
	r.cancel(cause)
	if q.up != nil {
		l.closeUp(q.up)
	}
	if !r.leg.closed {
		if r.leg.resp == nil {
			_ = r.leg.answered(nil, r.scope.Cause())
		}
		r.leg.close()
	}
	if cause == errClientGone {
		q.ended = true
		r.rec.fail("client_disconnected")
		path := r.path
		l.finishRequest(r)
		l.s.metrics.observeHTTP("POST", path, q.ctx.Response.StatusCode(), errorCode(q.ctx), since(q.start))
		q.c.req = nil
		l.putCtx(q.ctx)
		l.recycle(q)
		return
	}
	l.answer(q, nil) // the cause's own answer (answer)
}

// sweep closes connections past a timeout and times requests out.
func (l *evLoop) sweep(now time.Time) {
	cfg := &l.s.cfg
	for _, c := range l.conns {
		switch {
		case c.req != nil:
			if now.Sub(c.req.start) >= cfg.RequestTimeout {
				l.abandon(c.req, errRequestTimeout)
			}
		case c.off < len(c.out):
			if now.Sub(c.since) >= cfg.RequestTimeout+writeGrace {
				l.closeConn(c)
			}
		case c.n == 0 && c.answered: // a fresh one has the header read timeout below, as fasthttp's first request
			if now.Sub(c.since) >= cfg.IdleConnectionTimeout {
				l.closeConn(c)
			}
		case !c.headAt.IsZero() && now.Sub(c.headAt) >= cfg.BodyReadTimeout,
			c.headAt.IsZero() && now.Sub(c.since) >= cfg.HeaderReadTimeout:
			l.handOffLate(c)
		}
	}
	for addr, idle := range l.pool {
		keep := idle[:0]
		for _, u := range idle {
			if now.Sub(u.since) >= l.s.cfg.UpstreamIdleTimeout {
				l.closeUp(u)
				continue
			}
			keep = append(keep, u)
		}
		l.pool[addr] = keep
	}
}

// handOffLate gives fasthttp a connection whose partial request ran out of
// time, with its read deadline already past: fasthttp answers the timeout
// as it does its own.
func (l *evLoop) handOffLate(c *evConn) {
	c.late = true
	l.handOff(c)
}

// expiredConn keeps the first read deadline set on it in the past.
type expiredConn struct {
	net.Conn
	set bool
}

func (c *expiredConn) SetReadDeadline(t time.Time) error {
	if !c.set {
		c.set, t = true, time.Unix(1, 0)
	}
	return c.Conn.SetReadDeadline(t)
}

func (c *expiredConn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.Conn.SetWriteDeadline(t)
}

// drain closes idle connections and has the others close after their
// current request (Shutdown).
func (l *evLoop) drain() {
	for _, c := range l.conns {
		switch {
		case c.req != nil || c.off < len(c.out):
			c.closeAfter = true
		case c.n == 0:
			l.closeConn(c)
		default:
			l.handOff(c) // a partial request: fasthttp's shutdown decides
		}
	}
}

// closeAll ends everything the loop holds: requests in flight are answered
// shuttingDown (the router stops).
func (l *evLoop) closeAll() {
	for _, c := range l.conns {
		if c.req != nil {
			c.closeAfter = true
			l.abandon(c.req, errShuttingDown)
		}
		if _, held := l.conns[c.token]; held {
			l.closeConn(c)
		}
	}
	for _, u := range l.ups {
		l.closeUp(u)
	}
}
