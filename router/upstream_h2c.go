package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/router/splice"
)

// h2c is the router's HTTP/2 cleartext client towards the workers that
// serve it (--upstream-http2 and the engine's /server_info saying
// enable_http2, as SGLang's --enable-http2 reports): every request to such
// a worker is a stream on one of a few connections, so an open stream holds
// no descriptor of its own. It is the standard library's HTTP/2 transport
// (net/http with only UnencryptedHTTP2 enabled: prior knowledge, no
// upgrade), the same code as golang.org/x/net/http2, so no new dependency;
// the goroutines it hands a request across cost more than our HTTP/1.1
// path, which stays the default.
//
// Flow control: each stream may hold h2cStreamWindow unread bytes, and the
// connection's window (the transport's default, 1 GiB) exceeds that times
// any server's stream limit, so a client that reads slowly stalls its own
// stream only: its engine waits for WINDOW_UPDATEs, the other streams on
// the connection flow on. Cancelling a request (its scope ends: client
// gone, timeout, the other leg failed, idle) resets its stream alone.
type h2c struct {
	t *http.Transport
}

// h2cStreamWindow is what one stream may hold unread: tokens pile up there
// while its client is slow, and past it the engine is flow-controlled.
const h2cStreamWindow = 1 << 20

func newH2C(u *upstream) *h2c {
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	t := &http.Transport{
		Protocols: &protocols,
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			return u.dial(ctx, addr, "")
		},
		IdleConnTimeout: u.idleTimeout,
		// For HTTP/2 this bounds dials in progress, not connections: a
		// burst of streams waits for the one dial instead of opening a
		// connection each, and a new one is dialed when those are full.
		MaxConnsPerHost:    1,
		DisableCompression: true, // bodies pass through as the engine sent them
		HTTP2: &http.HTTP2Config{
			MaxReceiveBufferPerStream: h2cStreamWindow,
			// A connection that answers nothing for this long (no frame,
			// no ping reply) is closed and its streams fail, rather than
			// hang on a worker that vanished without a FIN.
			SendPingTimeout: 30 * time.Second,
			PingTimeout:     15 * time.Second,
		},
	}
	return &h2c{t: t}
}

func (h *h2c) close() { h.t.CloseIdleConnections() }

// h2cStream is one request on an h2c connection: it is registered with the
// request's scope, whose end cancels the stream's own context (the
// transport then resets that stream), and it ends the stream itself when
// the reply has been silent for the idle timeout.
type h2cStream struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	body   io.ReadCloser

	// peeked is a byte awaitBody read ahead (hasPeek), given to the next Read.
	peeked  [1]byte
	hasPeek bool

	idle     time.Duration
	lastRead atomic.Int64 // unix nanoseconds of the last read's return
	timer    *time.Timer  // ends the stream once idle; nil until armed
	expired  atomic.Bool  // the timer did
}

func (s *h2cStream) cancelled(cause error) { s.cancel(cause) }

// postH2C is post for an h2c worker. The body is copied once under the
// guard: the transport writes it from another goroutine, possibly after
// the client's buffer is reused.
func (u *upstream) postH2C(sc *scope, baseURL, path string, body *splice.Body, extra []byte, guard *writeGuard) (*upstreamResponse, error) {
	addr, host, _, err := u.endpoint(baseURL)
	if err != nil {
		return nil, err
	}
	if !guard.begin() {
		sc.cancel(errBodyReleased)
		return nil, sc.Cause()
	}
	data := body.AppendTo(make([]byte, 0, body.Len()))
	guard.end()

	ctx, cancel := context.WithCancelCause(context.Background())
	st := &h2cStream{ctx: ctx, cancel: cancel}
	if !sc.register(st) {
		cancel(nil)
		return nil, sc.Cause()
	}
	fail := func(err error) (*upstreamResponse, error) {
		sc.unregister(st)
		cancel(err)
		if cause := sc.Cause(); cause != nil {
			return nil, cause
		}
		return nil, err
	}
	req := &http.Request{
		Method:        http.MethodPost,
		URL:           &url.URL{Scheme: "http", Host: addr, Path: path},
		Host:          host,
		Header:        parseHeaderLines(extra),
		Body:          io.NopCloser(bytes.NewReader(data)),
		GetBody:       func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
		ContentLength: int64(len(data)),
	}
	req.Header.Set("Content-Type", "application/json")
	req = req.WithContext(ctx)
	hr, err := u.h2c.t.RoundTrip(req)
	if err != nil {
		return fail(fmt.Errorf("%w: %w", errUpstreamClosed, err)) // outOfLocalResources reads the cause
	}
	st.body = hr.Body
	resp := fasthttp.AcquireResponse()
	resp.SetStatusCode(hr.StatusCode)
	for k, vs := range hr.Header {
		for _, v := range vs {
			resp.Header.Add(k, v)
		}
	}
	// fasthttp's -1 is "chunked": a body of unknown length, as here.
	resp.Header.SetContentLength(int(max(hr.ContentLength, -1)))
	return &upstreamResponse{StatusCode: hr.StatusCode, Header: &resp.Header, resp: resp, u: u, scope: sc, h2: st}, nil
}

// parseHeaderLines reads "Name: value\r\n" lines (forwardHeaders').
func parseHeaderLines(b []byte) http.Header {
	h := make(http.Header, 2)
	for len(b) > 0 {
		line, rest, _ := bytes.Cut(b, []byte("\r\n"))
		b = rest
		if k, v, ok := bytes.Cut(line, []byte(": ")); ok {
			h.Add(string(k), string(v))
		}
	}
	return h
}

// readH2C is Read for an h2c reply.
func (r *upstreamResponse) readH2C(p []byte) (int, error) {
	st := r.h2
	if r.idle > 0 && st.timer == nil {
		st.armIdle(r.idle)
	}
	n := 0
	if st.hasPeek && len(p) > 0 {
		p[0] = st.peeked[0]
		st.hasPeek = false
		n = 1
		p = p[1:]
	}
	var err error
	if len(p) > 0 {
		var m int
		m, err = st.body.Read(p)
		n += m
	}
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
	return n, err
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
	st.cancel(errStreamIdle)
}

// peek waits for the reply's first body byte without a relay buffer
// (awaitBody); the next Read returns it.
func (st *h2cStream) peek() {
	if st.hasPeek {
		return
	}
	if n, _ := io.ReadFull(st.body, st.peeked[:]); n == 1 {
		st.hasPeek = true
	}
}

// closeH2C ends an h2c reply: a body not read to its end has its stream
// reset (the engine hears the cancellation), one read to the end leaves
// the connection as it was.
func (r *upstreamResponse) closeH2C() error {
	st := r.h2
	r.h2 = nil
	r.scope.unregister(st)
	if st.timer != nil {
		st.timer.Stop()
	}
	st.cancel(errH2CClosed)
	_ = st.body.Close()
	fasthttp.ReleaseResponse(r.resp)
	return nil
}

var errH2CClosed = errors.New("h2c reply closed")
