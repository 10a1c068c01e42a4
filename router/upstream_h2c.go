package router

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/pdrouter/pdrouter/router/splice"
)

// h2c is the router's HTTP/2 cleartext client towards the workers that
// serve it (--upstream-http2 and the engine's /server_info saying
// enable_http2, as SGLang's --enable-http2 reports): every request to such
// a worker is a stream on one of a few connections (prior knowledge, no
// upgrade), so an open stream holds no descriptor of its own.
//
// It is our own, on x/net's framer and HPACK, because net/http's HTTP/2
// transport keeps a goroutine, a pipe and a Request/Response pair per
// open stream (about 21 KiB per stream at 10,000 streams): here a
// connection has one reader goroutine, which appends each DATA frame to
// its stream's buffer, and one writer goroutine for control frames; a
// stream is a small struct whose buffer holds only what its relay has not
// read yet, and the request's own goroutine sends its HEADERS and body.
//
// Flow control: each stream may hold h2cStreamWindow unread bytes, and
// its window is credited only as its relay reads, so a client that reads
// slowly stalls its own stream only: its engine waits for WINDOW_UPDATEs.
// The connection's window is credited as frames arrive (the streams'
// windows already bound what is held), so the other streams on the
// connection flow on. Cancelling a request (its scope ends: client gone,
// timeout, the other leg failed, idle) resets its stream alone.
type h2c struct {
	u      *upstream
	mu     sync.Mutex
	pools  map[string]*h2cPool // by host:port
	closed bool
}

// h2cPool is one worker's connections.
type h2cPool struct {
	conns []*h2cConn
	dial  chan struct{} // a token: one dial at a time per worker
}

const (
	// h2cStreamWindow is what one stream may hold unread: tokens pile up
	// there while its client is slow, and past it the engine is
	// flow-controlled.
	h2cStreamWindow = 1 << 20
	// h2cConnWindow is the connection's receive window, topped up once
	// h2cConnRefill of it has arrived.
	h2cConnWindow = 1 << 30
	h2cConnRefill = 16 << 20
	// h2cDefaultStreams is the streams a connection takes before the
	// server's SETTINGS say how many (RFC 9113 suggests at least 100).
	h2cDefaultStreams = 100
	// A connection silent this long while it carries streams is pinged,
	// and closed (its streams fail) when the ping is unanswered for as
	// long again: a worker that vanished without a FIN fails its streams
	// instead of hanging them.
	h2cPingAfter = 30 * time.Second
	h2cPingWait  = 15 * time.Second
	// h2cPooledBuffer is the largest buffer a drained stream gives back.
	h2cPooledBuffer = 16 << 10
)

// h2cBuffers hold the streams' arrived bytes: a stream takes one when a
// DATA frame arrives and gives it back once its relay has read it all, so
// a stream waiting for its next token holds none.
var h2cBuffers = sync.Pool{New: func() any { b := make([]byte, 0, 2<<10); return &b }}

var (
	errH2CClosed = errors.New("h2c reply closed")
	// errH2CUnprocessed is a stream the worker never processed (GOAWAY
	// below its id, REFUSED_STREAM): it may be sent again.
	errH2CUnprocessed = errors.New("h2c stream refused by the worker")
	errH2CConnIdle    = errors.New("h2c connection idle")
	errH2CPingTimeout = errors.New("h2c connection unanswered ping")
	errH2CShutdown    = errors.New("h2c client closed")
)

func newH2C(u *upstream) *h2c { return &h2c{u: u, pools: map[string]*h2cPool{}} }

// close makes the client take no new streams and closes every idle
// connection; the others close when their last stream ends.
func (h *h2c) close() {
	h.mu.Lock()
	h.closed = true
	var conns []*h2cConn
	for _, p := range h.pools {
		conns = append(conns, p.conns...)
	}
	h.mu.Unlock()
	for _, c := range conns {
		c.drain()
	}
}

// h2cStream is one request on an h2c connection. Its fields below conn
// are guarded by conn.mu.
type h2cStream struct {
	conn   *h2cConn
	header *fasthttp.ResponseHeader // the reply head, filled by the reader (h2cHeaders)
	wake   chan struct{}            // one token: the reader or a canceller signals the stream's goroutine

	id      uint32
	open    bool    // in conn.streams, counted in conn.active
	head    bool    // the reply's head has arrived
	eof     bool    // and all its body
	err     error   // the stream failed; set once
	buf     *[]byte // what has arrived, from h2cBuffers while it holds any
	off     int     // (*buf)[off:] is unread
	used    int32   // of the stream's receive window: arrived and not yet credited back
	unacked int32   // of used: read (or padding), to be credited back
	sendWin int64   // what the request body may still send (int64: a peer's increments cannot wrap it)

	waiter   func() // resumes a relay parked until the stream is ready (parkH2C)
	idle     time.Duration
	lastRead atomic.Int64 // unix nanoseconds of the last read's return
	timer    *time.Timer  // ends the stream once idle; nil until armed
	expired  atomic.Bool  // the timer did
}

func (st *h2cStream) cancelled(cause error) { st.conn.reset(st, cause) }

// signal wakes whoever waits on the stream (under conn.mu): a relay parked
// without a goroutine (parkH2C) is resumed on a new one.
func (st *h2cStream) signal() {
	if resume := st.waiter; resume != nil {
		st.waiter = nil
		go resume() // a func value, not a method call: no closure to allocate per event
		return
	}
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// h2cConn is one connection to a worker.
type h2cConn struct {
	h    *h2c
	pool *h2cPool
	nc   net.Conn

	wmu  sync.Mutex // the framer's write side, the HPACK encoder, bw
	bw   *bufio.Writer
	fr   *http2.Framer
	henc *hpack.Encoder
	hbuf bytes.Buffer

	lastFrame atomic.Int64 // unix nanoseconds of the last frame read
	ctlWake   chan struct{}
	done      chan struct{} // closed when the reader has ended

	mu         sync.Mutex
	sendCond   sync.Cond // on mu: a send window grew, or a stream ended
	streams    map[uint32]*h2cStream
	nextID     uint32
	active     int    // streams open or reserved
	maxStreams int    // the server's SETTINGS_MAX_CONCURRENT_STREAMS
	initWin    int64  // the server's SETTINGS_INITIAL_WINDOW_SIZE
	maxFrame   int    // the server's SETTINGS_MAX_FRAME_SIZE
	sendWin    int64  // the connection's send window
	recvCredit uint32 // bytes arrived and not yet credited to the connection
	ctl        []h2cCtl
	goaway     bool  // no new streams
	err        error // the connection is over
	idleSince  time.Time
	idleArmed  bool
	idleTimer  *time.Timer
	pingTimer  *time.Timer
	pingSent   time.Time // an unanswered ping's time; zero when none
}

// h2cCtl is a control frame queued for the connection's writer: the
// goroutines that produce them (the reader, cancellers, relays) never
// wait on the socket.
type h2cCtl struct {
	kind uint8
	id   uint32
	n    uint32
	data [8]byte
}

const (
	ctlReset uint8 = iota
	ctlWindow
	ctlSettingsAck
	ctlPing
	ctlPingAck
)

// postH2C is post for an h2c worker: it returns once the reply's head has
// arrived. The request's goroutine writes the body from the client's
// buffer under guard, as the HTTP/1.1 path does. The reply goes into into
// (nil: a new one), as readHead's.
func (u *upstream) postH2C(sc *scope, baseURL, path string, body *splice.Body, extra []byte, guard *writeGuard, into *upstreamResponse) (*upstreamResponse, error) {
	addr, host, _, err := u.endpoint(baseURL)
	if err != nil {
		return nil, err
	}
	for attempt := 0; ; attempt++ {
		c, err := u.h2c.conn(sc, addr)
		if err != nil {
			if cause := sc.Cause(); cause != nil {
				return nil, cause
			}
			return nil, err
		}
		st := &h2cStream{conn: c, wake: make(chan struct{}, 1), header: h2cHeaders.Get().(*fasthttp.ResponseHeader)}
		if !sc.register(st) {
			c.unreserve()
			releaseH2CHeader(st.header)
			return nil, sc.Cause()
		}
		err = c.roundTrip(st, host, path, body, extra, guard)
		if err == nil {
			if into == nil {
				into = new(upstreamResponse)
			}
			*into = upstreamResponse{StatusCode: st.header.StatusCode(), Header: st.header, u: u, scope: sc, h2: st}
			return into, nil
		}
		sc.unregister(st)
		c.reset(st, err)
		releaseH2CHeader(st.header)
		if cause := sc.Cause(); cause != nil {
			return nil, cause
		}
		if errors.Is(err, errH2CUnprocessed) && attempt == 0 {
			continue
		}
		return nil, err
	}
}

// conn reserves a stream on a connection to addr, dialing one (one dial
// at a time per worker) when none has room.
func (h *h2c) conn(sc *scope, addr string) (*h2cConn, error) {
	for {
		p, c, err := h.reserve(addr)
		if c != nil || err != nil {
			return c, err
		}
		select {
		case p.dial <- struct{}{}:
		default:
			select {
			case p.dial <- struct{}{}:
			case <-sc.Done():
				return nil, sc.Cause()
			}
		}
		// A dial that ended while this one waited may have made room.
		if _, c, err := h.reserve(addr); c != nil || err != nil {
			<-p.dial
			return c, err
		}
		nc, err := h.u.dial(sc, addr, "")
		if err != nil {
			<-p.dial
			// The engine never saw the request; outOfLocalResources reads the cause.
			return nil, dialError{fmt.Errorf("%w: %w", errUpstreamClosed, err)}
		}
		c, err = h.start(p, nc)
		<-p.dial
		if err != nil {
			return nil, dialError{fmt.Errorf("%w: %w", errUpstreamClosed, err)}
		}
	}
}

// reserve takes a stream slot on one of addr's connections; c is nil when
// none has room.
func (h *h2c) reserve(addr string) (*h2cPool, *h2cConn, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, nil, errH2CShutdown
	}
	p := h.pools[addr]
	if p == nil {
		p = &h2cPool{dial: make(chan struct{}, 1)}
		h.pools[addr] = p
	}
	for _, c := range p.conns {
		if c.reserve() {
			return p, c, nil
		}
	}
	return p, nil, nil
}

// start opens an HTTP/2 session on nc (preface, SETTINGS, the
// connection's window) and pools it.
func (h *h2c) start(p *h2cPool, nc net.Conn) (*h2cConn, error) {
	c := &h2cConn{
		h: h, pool: p, nc: nc,
		bw:         bufio.NewWriterSize(nc, 16<<10),
		ctlWake:    make(chan struct{}, 1),
		done:       make(chan struct{}),
		streams:    map[uint32]*h2cStream{},
		nextID:     1,
		maxStreams: h2cDefaultStreams,
		initWin:    65535,
		maxFrame:   16 << 10,
		sendWin:    65535,
	}
	c.sendCond.L = &c.mu
	c.fr = http2.NewFramer(c.bw, bufio.NewReaderSize(nc, 16<<10))
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.MaxHeaderListSize = 1 << 20
	c.fr.SetReuseFrames()
	c.henc = hpack.NewEncoder(&c.hbuf)
	c.lastFrame.Store(time.Now().UnixNano())
	_, err := c.bw.WriteString(http2.ClientPreface)
	if err == nil {
		err = c.fr.WriteSettings(
			http2.Setting{ID: http2.SettingEnablePush, Val: 0},
			http2.Setting{ID: http2.SettingInitialWindowSize, Val: h2cStreamWindow},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: c.fr.MaxHeaderListSize},
		)
	}
	if err == nil {
		err = c.fr.WriteWindowUpdate(0, h2cConnWindow-65535)
	}
	if err == nil {
		err = c.bw.Flush()
	}
	if err != nil {
		nc.Close()
		return nil, err
	}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		nc.Close()
		return nil, errH2CShutdown
	}
	p.conns = append(p.conns, c)
	h.mu.Unlock()
	c.mu.Lock()
	c.pingTimer = time.AfterFunc(h2cPingWait, c.checkPing)
	c.markIdle()
	c.mu.Unlock()
	go c.writeLoop()
	go c.readLoop()
	return c, nil
}

// reserve counts a stream to come; false when the connection takes none.
func (c *h2cConn) reserve() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil || c.goaway || c.active >= c.maxStreams {
		return false
	}
	c.active++
	c.idleSince = time.Time{}
	return true
}

// unreserveLocked gives back a slot that never became a stream (under mu);
// a failed connection has dropped its count already.
func (c *h2cConn) unreserveLocked() {
	if c.err == nil {
		c.active--
		c.markIdle()
	}
}

func (c *h2cConn) unreserve() {
	c.mu.Lock()
	c.unreserveLocked()
	c.mu.Unlock()
}

// forget takes an ended stream off the connection (under mu).
func (c *h2cConn) forget(st *h2cStream) {
	if !st.open {
		return
	}
	st.open = false
	delete(c.streams, st.id)
	c.active--
	c.sendCond.Broadcast()
	c.markIdle()
}

// markIdle (under mu) starts the idle clock of a connection left without
// streams, or closes it when it takes no new ones.
func (c *h2cConn) markIdle() {
	if c.active > 0 || c.err != nil || c.h.u.idleTimeout <= 0 && !c.goaway {
		return
	}
	if c.goaway {
		c.failLocked(errH2CConnIdle)
		return
	}
	c.idleSince = time.Now()
	if !c.idleArmed {
		c.idleArmed = true
		if c.idleTimer == nil {
			c.idleTimer = time.AfterFunc(c.h.u.idleTimeout, c.checkIdle)
		} else {
			c.idleTimer.Reset(c.h.u.idleTimeout)
		}
	}
}

func (c *h2cConn) checkIdle() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.idleArmed = false
	if c.active > 0 || c.err != nil || c.idleSince.IsZero() {
		return
	}
	if left := c.h.u.idleTimeout - time.Since(c.idleSince); left > 0 {
		c.idleArmed = true
		c.idleTimer.Reset(left)
		return
	}
	c.failLocked(errH2CConnIdle)
}

// checkPing pings a connection silent for h2cPingAfter while it carries
// streams, and closes it if the ping goes unanswered for h2cPingWait.
func (c *h2cConn) checkPing() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return
	}
	now := time.Now()
	switch silent := now.Sub(time.Unix(0, c.lastFrame.Load())); {
	case !c.pingSent.IsZero() && now.Sub(c.pingSent) >= h2cPingWait:
		c.failLocked(errH2CPingTimeout)
		return
	case c.pingSent.IsZero() && c.active > 0 && silent >= h2cPingAfter:
		c.pingSent = now
		c.queue(h2cCtl{kind: ctlPing})
	}
	c.pingTimer.Reset(h2cPingWait)
}

// drain makes c take no new streams; it closes once it has none.
func (c *h2cConn) drain() {
	c.mu.Lock()
	c.goaway = true
	c.markIdle()
	c.mu.Unlock()
}

// failLocked (under mu) ends the connection: its streams fail with err,
// the socket closes (which ends the reader, and the reader's end the
// writer) and the pool forgets it.
func (c *h2cConn) failLocked(err error) {
	if c.err != nil {
		return
	}
	c.err = err
	for _, st := range c.streams {
		if st.err == nil && !st.eof {
			st.err = fmt.Errorf("%w: %w", errUpstreamClosed, err)
		}
		st.open = false
		st.signal()
	}
	clear(c.streams)
	c.active = 0
	c.sendCond.Broadcast()
	if c.idleTimer != nil {
		c.idleTimer.Stop()
	}
	if c.pingTimer != nil {
		c.pingTimer.Stop()
	}
	c.nc.Close()
	go c.h.remove(c) // h.mu comes before c.mu
}

func (h *h2c) remove(c *h2cConn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, pc := range c.pool.conns {
		if pc == c {
			c.pool.conns = append(c.pool.conns[:i], c.pool.conns[i+1:]...)
			return
		}
	}
}

// queue hands a control frame to the writer (under mu).
func (c *h2cConn) queue(f h2cCtl) {
	c.ctl = append(c.ctl, f)
	select {
	case c.ctlWake <- struct{}{}:
	default:
	}
}

// writeLoop writes the queued control frames until the reader ends.
func (c *h2cConn) writeLoop() {
	var batch []h2cCtl
	for {
		select {
		case <-c.ctlWake:
		case <-c.done:
			return
		}
		c.mu.Lock()
		batch, c.ctl = c.ctl, batch[:0]
		c.mu.Unlock()
		if len(batch) == 0 {
			continue
		}
		c.wmu.Lock()
		var err error
		for _, f := range batch {
			if err != nil {
				break
			}
			switch f.kind {
			case ctlReset:
				err = c.fr.WriteRSTStream(f.id, http2.ErrCodeCancel)
			case ctlWindow:
				err = c.fr.WriteWindowUpdate(f.id, f.n)
			case ctlSettingsAck:
				err = c.fr.WriteSettingsAck()
			case ctlPing:
				err = c.fr.WritePing(false, f.data)
			case ctlPingAck:
				err = c.fr.WritePing(true, f.data)
			}
		}
		if err == nil {
			err = c.bw.Flush()
		}
		c.wmu.Unlock()
		if err != nil {
			c.fail(err)
		}
	}
}

func (c *h2cConn) fail(err error) {
	c.mu.Lock()
	c.failLocked(err)
	c.mu.Unlock()
}

// roundTrip sends st's request on c and waits for the reply's head.
func (c *h2cConn) roundTrip(st *h2cStream, host, path string, body *splice.Body, extra []byte, guard *writeGuard) error {
	if !guard.begin() { // the reply is over: this attempt has nothing left to send
		c.unreserve()
		return errBodyReleased
	}
	err := c.send(st, host, path, body, extra)
	guard.end()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for !st.head && st.err == nil {
		c.mu.Unlock()
		<-st.wake
		c.mu.Lock()
	}
	return st.err
}

// send writes st's HEADERS and body frames, the body within the stream's
// and the connection's send windows.
func (c *h2cConn) send(st *h2cStream, host, path string, body *splice.Body, extra []byte) error {
	c.wmu.Lock()
	c.mu.Lock()
	if err := cmp.Or(st.err, c.err); err != nil { // cancelled, or the connection failed, before it was sent
		if st.err == nil {
			err = fmt.Errorf("%w: %w", errH2CUnprocessed, err)
		}
		c.unreserveLocked()
		c.mu.Unlock()
		c.wmu.Unlock()
		return err
	}
	st.id = c.nextID
	c.nextID += 2
	st.open = true
	st.sendWin = c.initWin
	c.streams[st.id] = st
	c.mu.Unlock()
	// Encoded only once it will be sent: the encoder's table must stay
	// the one the worker's decoder builds from what it receives.
	c.hbuf.Reset()
	c.encode(":method", "POST")
	c.encode(":scheme", "http")
	c.encode(":authority", host)
	c.encode(":path", path)
	c.encode("content-type", "application/json")
	c.encodeOnce("content-length", strconv.Itoa(body.Len()))
	for len(extra) > 0 { // the request's id and the like: its own values
		line, rest, _ := bytes.Cut(extra, []byte("\r\n"))
		extra = rest
		if k, v, ok := bytes.Cut(line, []byte(": ")); ok && !h2cHopHeader(k) {
			c.encodeOnce(string(bytes.ToLower(k)), string(v))
		}
	}
	remaining := body.Len()
	err := c.writeHeaderBlock(st.id, remaining == 0)
	for seg := range body.Segments {
		for len(seg) > 0 && err == nil {
			var n int
			n, err = c.takeWindow(st, len(seg))
			if err != nil {
				break
			}
			remaining -= n
			err = c.fr.WriteData(st.id, remaining == 0, seg[:n])
			seg = seg[n:]
		}
	}
	if err == nil {
		err = c.bw.Flush()
	}
	c.wmu.Unlock()
	if err != nil {
		c.fail(err)
	}
	return err
}

// takeWindow returns how much of want st may send now, waiting (with wmu
// released and its frames flushed) while the windows are shut.
func (c *h2cConn) takeWindow(st *h2cStream, want int) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		if st.err != nil {
			return 0, st.err
		}
		if c.err != nil {
			return 0, c.err
		}
		if n := int(min(c.sendWin, st.sendWin, int64(c.maxFrame), int64(want))); n > 0 {
			c.sendWin -= int64(n)
			st.sendWin -= int64(n)
			return n, nil
		}
		c.mu.Unlock()
		err := c.bw.Flush()
		c.wmu.Unlock()
		if err != nil {
			c.wmu.Lock()
			c.mu.Lock()
			return 0, err
		}
		c.mu.Lock()
		if st.err == nil && c.err == nil && (c.sendWin <= 0 || st.sendWin <= 0) {
			c.sendCond.Wait()
		}
		c.mu.Unlock()
		c.wmu.Lock()
		c.mu.Lock()
	}
}

// writeHeaderBlock writes hbuf as a HEADERS frame and what does not fit
// as CONTINUATIONs (under wmu).
func (c *h2cConn) writeHeaderBlock(id uint32, endStream bool) error {
	block := c.hbuf.Bytes()
	c.mu.Lock()
	max := c.maxFrame
	c.mu.Unlock()
	first := block[:min(len(block), max)]
	block = block[len(first):]
	err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first, EndStream: endStream, EndHeaders: len(block) == 0})
	for len(block) > 0 && err == nil {
		frag := block[:min(len(block), max)]
		block = block[len(frag):]
		err = c.fr.WriteContinuation(id, len(block) == 0, frag)
	}
	return err
}

func (c *h2cConn) encode(name, value string) {
	_ = c.henc.WriteField(hpack.HeaderField{Name: name, Value: value}) // into a bytes.Buffer
}

// encodeOnce adds a field whose value is the request's own (its length,
// its id) as a literal that is never indexed: indexed, each took a place
// in the HPACK table and evicted the oldest, on every request, and that
// eviction was the deepest call of a stream's goroutine, growing its stack
// from 4 to 8 KiB until a collection shrank it (bench/RESULTS.md).
func (c *h2cConn) encodeOnce(name, value string) {
	_ = c.henc.WriteField(hpack.HeaderField{Name: name, Value: value, Sensitive: true})
}

// h2cHopHeader reports the connection-specific headers HTTP/2 forbids.
func h2cHopHeader(k []byte) bool {
	for _, h := range [...]string{"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "host", "te"} {
		if bytes.EqualFold(k, []byte(h)) {
			return true
		}
	}
	return false
}

// reset ends st with cause: a stream still open is reset at the worker
// (RST_STREAM CANCEL), and whoever waits on it wakes. A stream whose reply
// has fully arrived keeps it.
func (c *h2cConn) reset(st *h2cStream, cause error) {
	if cause == nil {
		cause = errH2CClosed
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if st.err != nil || st.eof {
		return
	}
	st.err = cause
	if st.open {
		c.forget(st)
		if c.err == nil {
			c.queue(h2cCtl{kind: ctlReset, id: st.id})
		}
	}
	st.signal()
}

// readLoop reads the connection's frames until it fails or closes.
func (c *h2cConn) readLoop() {
	defer close(c.done)
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			if se, ok := err.(http2.StreamError); ok { // that stream alone is malformed
				c.streamFailed(se.StreamID, se, true)
				continue
			}
			c.fail(err)
			return
		}
		c.lastFrame.Store(time.Now().UnixNano())
		if err := c.handle(f); err != nil {
			c.fail(err)
			return
		}
	}
}

func (c *h2cConn) handle(f http2.Frame) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch f := f.(type) {
	case *http2.MetaHeadersFrame:
		c.onHeaders(f)
	case *http2.DataFrame:
		return c.onData(f)
	case *http2.RSTStreamFrame:
		if st := c.streams[f.StreamID]; st != nil {
			err := error(http2.StreamError{StreamID: f.StreamID, Code: f.ErrCode})
			if f.ErrCode == http2.ErrCodeRefusedStream {
				err = fmt.Errorf("%w: %w", errH2CUnprocessed, err)
			}
			c.endStream(st, fmt.Errorf("the worker reset the stream: %w", err), false)
		}
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		err := f.ForeachSetting(func(s http2.Setting) error {
			switch s.ID {
			case http2.SettingMaxConcurrentStreams:
				c.maxStreams = int(min(s.Val, 1<<20))
			case http2.SettingMaxFrameSize:
				c.maxFrame = int(s.Val)
			case http2.SettingInitialWindowSize:
				if s.Val > 1<<31-1 {
					return http2.ConnectionError(http2.ErrCodeFlowControl)
				}
				delta := int64(s.Val) - c.initWin
				c.initWin = int64(s.Val)
				for _, st := range c.streams {
					st.sendWin += delta
				}
				c.sendCond.Broadcast()
			}
			return nil
		})
		if err != nil {
			return err
		}
		c.queue(h2cCtl{kind: ctlSettingsAck})
	case *http2.WindowUpdateFrame:
		if f.StreamID == 0 {
			c.sendWin += int64(f.Increment)
		} else if st := c.streams[f.StreamID]; st != nil {
			st.sendWin += int64(f.Increment)
		}
		c.sendCond.Broadcast()
	case *http2.PingFrame:
		if f.IsAck() {
			c.pingSent = time.Time{}
		} else {
			c.queue(h2cCtl{kind: ctlPingAck, data: f.Data})
		}
	case *http2.GoAwayFrame:
		c.goaway = true
		for id, st := range c.streams {
			if id > f.LastStreamID {
				c.endStream(st, fmt.Errorf("%w: GOAWAY %v", errH2CUnprocessed, f.ErrCode), false)
			}
		}
		c.markIdle()
	case *http2.PushPromiseFrame:
		return http2.ConnectionError(http2.ErrCodeProtocol) // push was refused in SETTINGS
	}
	return nil
}

// onHeaders takes a reply's head, or its trailers (ignored but for the
// end of the stream they mark). Under mu: the stream's goroutine reads the
// head only once head is set, and releases it only after the stream is
// forgotten.
func (c *h2cConn) onHeaders(f *http2.MetaHeadersFrame) {
	st := c.streams[f.StreamID]
	if st == nil {
		return
	}
	if !st.head {
		status, err := strconv.Atoi(f.PseudoValue("status"))
		if err != nil || status < 100 || status > 999 {
			c.endStream(st, fmt.Errorf("malformed :status %q from the worker", f.PseudoValue("status")), true)
			return
		}
		if status < 200 { // informational: the real head follows
			return
		}
		h := st.header
		h.SetStatusCode(status)
		h.SetContentLength(-1) // fasthttp's "chunked": of unknown length
		for _, hf := range f.RegularFields() {
			if hf.Name == "content-length" {
				if n, err := strconv.Atoi(hf.Value); err == nil && n >= 0 {
					h.SetContentLength(n)
				}
				continue
			}
			h.Add(hf.Name, hf.Value)
		}
		st.head = true
		st.signal()
	}
	if f.StreamEnded() {
		st.eof = true
		c.forget(st)
		st.signal()
	}
}

func (c *h2cConn) onData(f *http2.DataFrame) error {
	size := f.Length
	if c.recvCredit += size; c.recvCredit >= h2cConnRefill {
		c.queue(h2cCtl{kind: ctlWindow, n: c.recvCredit})
		c.recvCredit = 0
	}
	st := c.streams[f.StreamID]
	if st == nil {
		return nil // reset by us: its frames in flight are dropped
	}
	data := f.Data()
	if !st.head || int64(st.used)+int64(size) > h2cStreamWindow {
		c.endStream(st, errors.New("the worker broke HTTP/2 flow control or sent data before its head"), true)
		return nil
	}
	st.used += int32(size)
	st.unacked += int32(size) - int32(len(data)) // padding: consumed at once
	if len(data) > 0 {
		if st.buf == nil {
			st.buf = h2cBuffers.Get().(*[]byte)
		}
		b := *st.buf
		if len(b)+len(data) > cap(b) && st.off > 0 {
			b = b[:copy(b, b[st.off:])]
			st.off = 0
		}
		*st.buf = append(b, data...)
	}
	if f.StreamEnded() {
		st.eof = true
		c.forget(st)
	}
	st.signal()
	return nil
}

// endStream (under mu) fails an open stream; reset says whether the worker
// must be told (RST_STREAM).
func (c *h2cConn) endStream(st *h2cStream, err error, reset bool) {
	if st.err == nil && !st.eof {
		st.err = err
	}
	c.forget(st)
	if reset {
		c.queue(h2cCtl{kind: ctlReset, id: st.id})
	}
	st.signal()
}

// streamFailed ends stream id after a malformed frame of it.
func (c *h2cConn) streamFailed(id uint32, err error, reset bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.streams[id]; st != nil {
		c.endStream(st, err, reset)
	} else if reset {
		c.queue(h2cCtl{kind: ctlReset, id: id})
	}
}

// read is Read for the stream's body: what has arrived, else a wait for
// more. The worker gets its window back as the relay reads.
func (st *h2cStream) read(p []byte) (int, error) {
	c := st.conn
	c.mu.Lock()
	defer c.mu.Unlock()
	st.waitLocked()
	if st.unread() > 0 {
		n := copy(p, (*st.buf)[st.off:])
		st.consumedLocked(n)
		return n, nil
	}
	if st.err != nil {
		return 0, st.err
	}
	return 0, io.EOF
}

// consumedLocked marks n arrived bytes read: the buffer goes back once
// drained, and the worker gets its window back (under mu).
func (st *h2cStream) consumedLocked(n int) {
	st.off += n
	if st.unread() == 0 {
		st.releaseBuffer()
	}
	st.unacked += int32(n)
	if st.open && st.unacked >= h2cStreamWindow/4 {
		st.conn.queue(h2cCtl{kind: ctlWindow, id: st.id, n: uint32(st.unacked)})
		st.used -= st.unacked
		st.unacked = 0
	}
}

// drainH2C reads an h2c reply to its end, showing see each piece where it
// arrived (under the connection's lock: see must not block): no buffer of
// its own, so a prefill leg waiting for its reply holds none (a 32 KiB
// copy buffer each, through the read, before).
func (r *upstreamResponse) drainH2C(see func([]byte)) error {
	if r.idleGone {
		r.failed = true
		return errStreamIdle
	}
	st := r.h2
	if r.idle > 0 && st.timer == nil {
		st.armIdle(r.idle)
	}
	c := st.conn
	for {
		c.mu.Lock()
		st.waitLocked()
		n := st.unread()
		if n > 0 {
			see((*st.buf)[st.off:])
			st.consumedLocked(n)
		}
		err := st.err
		c.mu.Unlock()
		switch {
		case n > 0:
			r.readH2CEnded(nil)
		case err != nil:
			return r.readH2CEnded(err)
		default:
			r.readH2CEnded(io.EOF)
			return nil
		}
	}
}

// awaitH2C is awaitBody for an h2c reply: it returns once the stream has
// body bytes unread, has ended or failed, holding no relay buffer. One
// frame, with no defer: a stream's goroutine parks here (streamconn.go).
func (r *upstreamResponse) awaitH2C() {
	st := r.h2
	if r.idle > 0 && st.timer == nil { // the idle timeout covers the wait for the first byte
		st.armIdle(r.idle)
	}
	c := st.conn
	c.mu.Lock()
	for !st.ready() {
		c.mu.Unlock()
		<-st.wake
		c.mu.Lock()
	}
	c.mu.Unlock()
}

// parkH2C is awaitH2C without the wait, for a PD stream that holds no
// goroutine while it waits (for its first token: firstwait.go; between
// events: resume): false when the stream is ready now, else resume runs on
// a goroutine of its own (signal) once it is.
func (r *upstreamResponse) parkH2C(resume func()) bool {
	st := r.h2
	if r.idle > 0 && st.timer == nil {
		st.armIdle(r.idle)
	}
	c := st.conn
	c.mu.Lock()
	defer c.mu.Unlock()
	if st.ready() {
		return false
	}
	st.waiter = resume
	return true
}

// waitsH2C reports whether a read of an h2c reply would wait now: no body
// bytes unread, and the stream neither ended nor failed.
func (r *upstreamResponse) waitsH2C() bool {
	st := r.h2
	st.conn.mu.Lock()
	defer st.conn.mu.Unlock()
	return !st.ready()
}

// waitLocked is awaitH2C's wait with the connection's lock held.
func (st *h2cStream) waitLocked() {
	c := st.conn
	for !st.ready() {
		c.mu.Unlock()
		<-st.wake
		c.mu.Lock()
	}
}

// ready reports whether a read of the stream would not wait (under mu).
func (st *h2cStream) ready() bool { return st.unread() > 0 || st.eof || st.err != nil }

// buffered reports whether the stream holds body bytes unread.
func (st *h2cStream) buffered() bool {
	st.conn.mu.Lock()
	defer st.conn.mu.Unlock()
	return st.unread() > 0
}

// unread is how many arrived bytes the relay has not read (under mu).
func (st *h2cStream) unread() int {
	if st.buf == nil {
		return 0
	}
	return len(*st.buf) - st.off
}

// releaseBuffer gives the stream's buffer back, unread bytes and all
// (under mu).
func (st *h2cStream) releaseBuffer() {
	if st.buf == nil {
		return
	}
	if cap(*st.buf) <= h2cPooledBuffer {
		*st.buf = (*st.buf)[:0]
		h2cBuffers.Put(st.buf)
	}
	st.buf, st.off = nil, 0
}

// readH2C is Read for an h2c reply.
func (r *upstreamResponse) readH2C(p []byte) (int, error) {
	st := r.h2
	if r.idle > 0 && st.timer == nil {
		st.armIdle(r.idle)
	}
	n, err := st.read(p)
	return n, r.readH2CEnded(err)
}

// readH2CEnded records a read of the reply that ended with err (io.EOF:
// the body's end) for the idle timer and the reply, and returns err as
// the reader sees it.
func (r *upstreamResponse) readH2CEnded(err error) error {
	st := r.h2
	if st.timer != nil {
		st.lastRead.Store(time.Now().UnixNano())
	}
	if err == io.EOF {
		r.eof = true
	} else if err != nil {
		r.failed = true
		if st.expired.Load() && r.scope.Cause() == nil {
			err = errStreamIdle
		}
	}
	return err
}

// armIdle starts the stream's idle timer: it fires idle after the last
// read, so a read costs one clock reading, not a timer reset.
func (st *h2cStream) armIdle(idle time.Duration) {
	st.idle = idle
	st.lastRead.Store(time.Now().UnixNano())
	// Armed once assigned: checkIdle reads st.timer.
	st.timer = time.AfterFunc(time.Hour, st.checkIdle)
	st.timer.Reset(idle)
}

func (st *h2cStream) checkIdle() {
	silent := time.Since(time.Unix(0, st.lastRead.Load()))
	if silent < st.idle {
		st.timer.Reset(st.idle - silent)
		return
	}
	st.expired.Store(true)
	st.conn.reset(st, errStreamIdle)
}

// closeH2C ends an h2c reply: a stream not read to its end is reset (the
// engine hears the cancellation), the connection stays up either way.
func (r *upstreamResponse) closeH2C() error {
	st := r.h2
	r.h2 = nil
	r.scope.unregister(st)
	if st.timer != nil {
		st.timer.Stop()
	}
	c := st.conn
	c.reset(st, errH2CClosed)
	c.mu.Lock()
	st.releaseBuffer()
	c.mu.Unlock()
	if st.header != nil {
		releaseH2CHeader(st.header)
	}
	return nil
}

// spentH2CHead is the head of every h2c reply whose own went back to the
// pool (releaseHead): empty, read only; an h2c body's length is its
// stream's end, whatever a head says.
var spentH2CHead fasthttp.ResponseHeader

// packHead keeps of an h2c reply's head the fields the client gets
// (copyHeaders), packed in fields, and gives the head back to the pool
// for the streams still arriving: a stream held it (~0.9 KB with the
// fields its reader filled it with) to its end, through the wait for its
// first token, 10,000 times at 10,000 streams. The reader writes the head
// only before the stream has one (onHeaders), and it has.
func (r *upstreamResponse) packHead() {
	var b []byte
	for k, v := range r.Header.All() {
		if !hopHeader(bstr(k)) {
			b = binary.AppendUvarint(b, uint64(len(k)))
			b = append(b, k...)
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	r.fields = b
	r.releaseHead()
}

// packedField is the first of packHead's fields' names and values in b,
// and the rest of b.
func packedField(b []byte) ([]byte, []byte) {
	n, w := binary.Uvarint(b)
	return b[w : w+int(n)], b[w+int(n):]
}

// releaseHead gives an h2c reply's head, read, back to the pool for the
// next reply (a prefill reply's, once its status is known): only the
// framing is read after, which for h2c is the stream's end.
func (r *upstreamResponse) releaseHead() {
	if r.h2 == nil {
		return
	}
	releaseH2CHeader(r.h2.header)
	r.h2.header = nil
	r.Header = &spentH2CHead
}

// h2cHeaders pools the h2c replies' heads. An open stream keeps its head,
// and a whole fasthttp.Response (body fields unused here: the body is
// read from the stream) is 576 bytes of heap where the header is 384.
var h2cHeaders = sync.Pool{New: func() any { return new(fasthttp.ResponseHeader) }}

func releaseH2CHeader(h *fasthttp.ResponseHeader) {
	h.Reset()
	h2cHeaders.Put(h)
}
