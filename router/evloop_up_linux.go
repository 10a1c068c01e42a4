//go:build linux

package router

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/valyala/fasthttp"
	"golang.org/x/sys/unix"

	"github.com/pdrouter/pdrouter/internal/chunked"
)

// evUp is a loop's connection to a worker: idle in the loop's pool, or
// carrying one request (req) and collecting its reply in in[:n].
type evUp struct {
	fd         int
	token      uint32
	addr, host string
	connecting bool
	reused     bool // from the pool: a failure before any reply byte may be its staleness
	out        []byte
	off        int
	in         []byte
	n          int
	req        *evRequest
	since      time.Time // idle since
	frame      replyFrame
}

// replyFrame is how far a reply in in[:n] has been framed.
type replyFrame struct {
	start      int // where its head begins, after any interim ones
	head       int // where its body begins; 0 until its head is whole
	framing    int
	left       int64 // byLength: body bytes still to come
	scanned    int   // chunked: bytes the chunk scanner has seen
	chunks     chunked.Scanner
	closeAfter bool // the connection cannot carry another request
}

// How a reply's body ends.
const (
	byLength = iota
	byChunks
	byClose
)

const upBuf = 16 << 10

// upstream is a pooled connection to addr or, fresh or none pooled, a new
// one, its connect begun.
func (l *evLoop) upstream(addr string, fresh bool) (*evUp, error) {
	if idle := l.pool[addr]; !fresh && len(idle) > 0 {
		u := idle[len(idle)-1]
		l.pool[addr] = idle[:len(idle)-1]
		u.reused = true
		return u, nil
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, dialError{err}
	}
	var sa unix.Sockaddr
	family := unix.AF_INET
	if ap.Addr().Is4() || ap.Addr().Is4In6() {
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().Unmap().As4()}
	} else {
		family = unix.AF_INET6
		sa = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, dialFailed(addr, "socket", err)
	}
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	err = unix.Connect(fd, sa)
	if err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		return nil, dialFailed(addr, "connect", err)
	}
	u := &evUp{fd: fd, token: l.nextToken(true), addr: addr, connecting: err != nil, in: make([]byte, upBuf)}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(u.token)}
	if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(fd)
		return nil, dialFailed(addr, "epoll_ctl", err)
	}
	l.ups[u.token] = u
	return u, nil
}

// dialFailed is a failed connect to addr as net.Dialer words it, so that
// the client's 502 reads as on fasthttp's path.
func dialFailed(addr, call string, errno error) error {
	var a net.Addr
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		a = net.TCPAddrFromAddrPort(ap)
	}
	return dialError{&net.OpError{Op: "dial", Net: "tcp", Addr: a, Err: os.NewSyscallError(call, errno)}}
}

// closeUp closes u, wherever it is.
func (l *evLoop) closeUp(u *evUp) {
	if _, ok := l.ups[u.token]; !ok {
		return
	}
	delete(l.ups, u.token)
	if u.req == nil {
		idle := l.pool[u.addr]
		for i, p := range idle {
			if p == u {
				l.pool[u.addr] = append(idle[:i], idle[i+1:]...)
				break
			}
		}
	} else {
		u.req.up, u.req = nil, nil
	}
	unix.Close(u.fd) // leaves the epoll set with it
}

func (l *evLoop) upEvent(u *evUp, ev uint32) {
	switch {
	case u.req == nil: // pooled: the worker closed it, or sent what nobody asked for
		var b [1]byte
		if _, err := unix.Read(u.fd, b[:]); err != unix.EAGAIN {
			l.closeUp(u)
		}
		return
	case u.connecting:
		if ev&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) == 0 {
			return
		}
		if v, err := unix.GetsockoptInt(u.fd, unix.SOL_SOCKET, unix.SO_ERROR); err != nil || v != 0 {
			if err == nil {
				err = unix.Errno(v)
			}
			l.upFailed(u, dialFailed(u.addr, "connect", err))
			return
		}
		u.connecting = false
	}
	if u.off < len(u.out) && !l.upWrite(u) {
		return
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		l.upRead(u, ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0)
	}
}

// upWrite sends u's request; false while some is left (or u failed).
func (l *evLoop) upWrite(u *evUp) bool {
	for u.off < len(u.out) {
		m, err := unix.Write(u.fd, u.out[u.off:])
		if err == unix.EAGAIN {
			return false
		}
		if err != nil {
			l.upFailed(u, errUpstreamClosed)
			return false
		}
		u.off += m
	}
	if cap(u.out) > upBuf {
		u.out = nil
	}
	return true
}

// upRead reads u's reply until it is whole, or the socket is drained;
// hup: the worker shut its side, so read to the end.
func (l *evLoop) upRead(u *evUp, hup bool) {
	for u.req != nil {
		if u.n == len(u.in) {
			u.in = append(u.in, make([]byte, len(u.in))...)
		}
		space := len(u.in) - u.n
		m, err := unix.Read(u.fd, u.in[u.n:])
		if err == unix.EAGAIN {
			return
		}
		if err != nil || m == 0 {
			if u.frame.head > 0 && u.frame.framing == byClose {
				l.upDone(u)
				return
			}
			l.upFailed(u, errUpstreamClosed)
			return
		}
		u.n += m
		switch whole, err := u.frame.scan(u.in[:u.n]); {
		case err != nil:
			l.upFailed(u, err)
			return
		case whole:
			l.upDone(u)
			return
		case m < space && !hup: // drained: the rest raises a new edge
			return
		}
	}
}

// upFailed ends u's request on a failure before its reply was whole: once
// more on a new connection if u came from the pool and nothing of the
// reply arrived (the worker may have closed it idle), else the worker's
// failure.
func (l *evLoop) upFailed(u *evUp, err error) {
	q := u.req
	retry := u.reused && u.n == 0
	head, status := u.frame.head > 0, 0
	if head {
		status = replyStatus(u.in[u.frame.start:])
	}
	l.closeUp(u)
	if retry {
		if err = l.send(q, u.host, true); err == nil {
			return
		}
	}
	switch {
	case head:
		l.bodyFailed(q, status, io.ErrUnexpectedEOF)
	default:
		l.sendFailed(q, err)
	}
}

// upDone parses u's whole reply, pools u if it may carry another request,
// and answers the client.
func (l *evLoop) upDone(u *evUp) {
	q := u.req
	resp := &l.scratch.resp
	body, err := l.parseReply(u, resp)
	reusable := err == nil && !u.frame.closeAfter && u.frame.framing != byClose && !resp.ConnectionClose()
	u.req, q.up = nil, nil
	u.n, u.frame, u.reused = 0, replyFrame{}, false
	if cap(u.in) > upBuf {
		u.in = make([]byte, upBuf) // body keeps the old one
	}
	if reusable {
		u.since = l.now
		l.pool[u.addr] = append(l.pool[u.addr], u)
	} else {
		u.req = nil
		l.closeUp(u)
	}
	if err != nil || resp.StatusCode() < 200 {
		l.sendFailed(q, fmt.Errorf("%w: %v", errUpstreamClosed, errBadReply))
		return
	}
	l.replied(q, resp, body)
}

// parseReply parses u's whole reply into resp's head and returns its body.
// A reply framed by its length, the common one, has only its head parsed:
// the body is the bytes after it in u.in, not read through resp and copied
// again. Any other goes through fasthttp's Response.Read whole.
func (l *evLoop) parseReply(u *evUp, resp *fasthttp.Response) ([]byte, error) {
	resp.Reset()
	f := &u.frame
	if f.framing == byLength && int64(u.n-f.head) == f.left {
		l.scratch.rd.Reset(u.in[f.start:f.head]) // Response.Read too skips interim heads
		l.scratch.br.Reset(&l.scratch.rd)
		err := resp.Header.Read(l.scratch.br)
		l.scratch.br.Reset(nil)
		status := resp.StatusCode()
		if err != nil || (status >= 200 && status != fasthttp.StatusNoContent && status != fasthttp.StatusNotModified &&
			int64(resp.Header.ContentLength()) == f.left) {
			return u.in[f.head:u.n], err
		}
		resp.Reset() // an interim or bodiless status: Response.Read's rules
	}
	l.scratch.rd.Reset(u.in[:u.n])
	l.scratch.br.Reset(&l.scratch.rd)
	err := resp.Read(l.scratch.br)
	l.scratch.br.Reset(nil)
	if err == nil && l.scratch.rd.Len() > 0 {
		f.closeAfter = true // bytes past the reply: the connection is out of step
	}
	return resp.Body(), err
}

var errBadReply = errors.New("event loop: malformed worker reply")

// scan frames the reply in b (all of it read so far): whole once its body
// has ended.
func (f *replyFrame) scan(b []byte) (bool, error) {
	for f.head == 0 {
		end := bytes.Index(b[f.start:], []byte("\r\n\r\n"))
		if end < 0 {
			return false, nil
		}
		end += f.start
		if status := replyStatus(b[f.start:]); status >= 100 && status < 200 && status != 101 {
			f.start = end + 4 // an interim head: the reply's own follows
			continue
		}
		if err := f.parseHead(b[f.start : end+2]); err != nil {
			return false, err
		}
		f.head = end + 4
		f.scanned = f.head
	}
	switch f.framing {
	case byLength:
		return int64(len(b)-f.head) >= f.left, nil
	case byChunks:
		k, err := f.chunks.Scan(b[f.scanned:])
		f.scanned += k
		return f.chunks.Done(), err
	}
	return false, nil
}

// parseHead reads what framing needs from a reply's head (its lines, each
// ending in CRLF).
func (f *replyFrame) parseHead(h []byte) error {
	line, rest, _ := bytes.Cut(h, []byte("\r\n"))
	if !bytes.HasPrefix(line, []byte("HTTP/1.1 ")) {
		f.closeAfter = true
	}
	length, chunked := int64(-1), false
	for len(rest) > 0 {
		line, rest, _ = bytes.Cut(rest, []byte("\r\n"))
		name, value, _ := bytes.Cut(line, []byte(":"))
		value = bytes.TrimSpace(value)
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			n := parseLength(value)
			if n < 0 || (length >= 0 && n != length) {
				return errBadReply
			}
			length = n
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			chunked = len(value) >= 7 && bytes.EqualFold(value[len(value)-7:], []byte("chunked"))
			if !chunked {
				return errBadReply
			}
		case bytes.EqualFold(name, []byte("Connection")):
			f.closeAfter = f.closeAfter || bytes.Contains(bytes.ToLower(value), []byte("close"))
		}
	}
	switch status := replyStatus(h); {
	case status < 200 || status == 204 || status == 304: // no body, whatever the head says
		f.framing, f.left = byLength, 0
		f.closeAfter = f.closeAfter || status == 101
	case chunked:
		f.framing = byChunks
	case length >= 0:
		f.framing, f.left = byLength, length
	default:
		f.framing, f.closeAfter = byClose, true
	}
	return nil
}

// replyStatus is the status code of the reply head h begins: -1 if none.
func replyStatus(h []byte) int {
	if len(h) < 12 {
		return -1
	}
	return int(parseLength(h[9:12]))
}

// parseLength parses a Content-Length value: -1 if it is not one.
func parseLength(v []byte) int64 {
	if len(v) == 0 || len(v) > 18 {
		return -1
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return -1
		}
		n = n*10 + int64(c-'0')
	}
	return n
}
