//go:build linux

// Command evproxy is a baseline for make bench: the least an HTTP/1.1
// keep-alive reverse proxy written in Go costs per request when it is built
// the way nginx is rather than the way Go servers are. --loops event loops
// (GOMAXPROCS by default), each a goroutine locked to its OS thread with its
// own listening socket (SO_REUSEPORT) and its own epoll set, blocking in
// epoll_wait; non-blocking, edge-triggered client and backend sockets; a
// keep-alive pool of backend connections per loop; no goroutine and no bufio
// per connection, only an 8 KiB read buffer per socket, and one write per
// message wherever the message fits in it. Measured in the same run as
// nginx, fastproxy and pdrouter, it shows how close any Go design can come
// to nginx on the machine.
//
// It parses only what framing needs: the head up to its blank line,
// Content-Length, Transfer-Encoding and Connection, which it strips (the
// one header fastproxy strips; Connection: close still ends the exchange).
// It is a baseline, not a proxy to deploy: requests must be HTTP/1.1 or 1.0
// (which ends the connection after its reply) with a Content-Length body or
// none (chunked requests get 411, other versions 505, heads over 8 KiB 431); replies may be length-framed, chunked or
// close-delimited; upgrades (101) and retries are not supported, and a
// backend that fails before its reply begins gets the client a 502, after
// which the client's connection is closed.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"net"
	"os"
	"runtime"

	"golang.org/x/sys/unix"

	chunkedbody "github.com/pdrouter/pdrouter/internal/chunked"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to serve on")
	backend := flag.String("backend", "", "host:port of the one backend")
	loops := flag.Int("loops", runtime.GOMAXPROCS(0), "event loops, each on its own OS thread")
	flag.Parse()
	if *backend == "" || *loops < 1 {
		fmt.Fprintln(os.Stderr, "evproxy: --backend is required and --loops must be at least 1")
		os.Exit(2)
	}
	p, err := start(*listen, *backend, *loops)
	if err == nil {
		err = <-p.done // a loop ends only on an error
	}
	fmt.Fprintln(os.Stderr, "evproxy:", err)
	os.Exit(1)
}

const bufSize = 8 << 10

// A socket's role in its current exchange.
const (
	head    = iota // reading a message head (client: a request; backend: a reply)
	body           // forwarding the rest of the message
	waiting        // client: request sent, its reply not yet complete
	idle           // backend: in the pool
)

// How a message's body ends.
const (
	byLength = iota // after left bytes (0: no body)
	chunked         // at the terminating chunk and trailers
	byClose         // when the backend closes
)

var crlf, crlfcrlf, comma = []byte("\r\n"), []byte("\r\n\r\n"), []byte(",")

// A sock is a client or backend socket. Its read buffer holds
// buf[off:end], bytes of the current message the peer has yet to take,
// then buf[end:n], bytes read but not yet framed.
type sock struct {
	fd, id             int
	backend            bool
	buf                []byte
	off, end, n        int
	state, framing     int
	left               int64 // byLength: body bytes not yet framed
	chunks             chunkedbody.Scanner
	peer               *sock
	readable, writable bool // false only once the kernel has said so (edge-triggered)
	hup                bool // the peer shut down or failed
	connecting         bool
	closeAfter         bool // client: Connection: close; backend: not reusable
	headReq            bool // client: the request is HEAD (its reply has no body)
	replied            bool // backend: reply bytes have reached the client
}

type loop struct {
	ep, ln  int
	backend unix.Sockaddr
	socks   []*sock // by descriptor
	pool    []*sock // idle keep-alive backend connections
	lastID  int
	events  [256]unix.EpollEvent
}

type proxy struct {
	addr  string
	loops []*loop
	done  chan error // each loop's end
}

// start listens on listen with n loops forwarding to backend.
func start(listen, backend string, n int) (*proxy, error) {
	la, err := net.ResolveTCPAddr("tcp", listen)
	if err != nil {
		return nil, err
	}
	ba, err := net.ResolveTCPAddr("tcp", backend)
	if err != nil {
		return nil, err
	}
	p := &proxy{done: make(chan error, n)}
	for range n {
		l := &loop{ep: -1, ln: -1, backend: sockaddr(ba)}
		p.loops = append(p.loops, l)
		if l.ln, la.Port, err = listenReusePort(la); err != nil {
			break
		}
		if l.ep, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
			break
		}
		err = unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, l.ln, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(l.ln)})
		if err != nil {
			break
		}
	}
	if err != nil {
		for _, l := range p.loops {
			l.closeAll()
		}
		return nil, err
	}
	p.addr = la.String()
	for _, l := range p.loops {
		go func() { p.done <- l.run() }()
	}
	return p, nil
}

// close stops every loop and closes all their sockets.
func (p *proxy) close() {
	for _, l := range p.loops {
		// Shutting a listener down wakes its loop's epoll_wait and makes accept fail with EINVAL.
		_ = unix.Shutdown(l.ln, unix.SHUT_RD)
	}
	for range p.loops {
		<-p.done
	}
}

func sockaddr(a *net.TCPAddr) unix.Sockaddr {
	if ip4 := a.IP.To4(); ip4 != nil || a.IP == nil {
		sa := &unix.SockaddrInet4{Port: a.Port}
		copy(sa.Addr[:], ip4)
		return sa
	}
	sa := &unix.SockaddrInet6{Port: a.Port}
	copy(sa.Addr[:], a.IP)
	return sa
}

func family(sa unix.Sockaddr) int {
	if _, ok := sa.(*unix.SockaddrInet4); ok {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// listenReusePort opens one of the loops' listening sockets on a, which
// share its port; the kernel spreads connections over them.
func listenReusePort(a *net.TCPAddr) (fd, port int, err error) {
	sa := sockaddr(a)
	if fd, err = unix.Socket(family(sa), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0); err != nil {
		return -1, 0, err
	}
	if err = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err == nil {
		if err = unix.Bind(fd, sa); err == nil {
			err = unix.Listen(fd, 4096)
		}
	}
	var got unix.Sockaddr
	if err == nil {
		got, err = unix.Getsockname(fd)
	}
	if err != nil {
		unix.Close(fd)
		return -1, 0, fmt.Errorf("listen on %v: %w", a, err)
	}
	switch got := got.(type) {
	case *unix.SockaddrInet4:
		port = got.Port
	case *unix.SockaddrInet6:
		port = got.Port
	}
	return fd, port, nil
}

func (l *loop) run() error {
	runtime.LockOSThread()
	defer l.closeAll()
	for {
		n, err := unix.EpollWait(l.ep, l.events[:], -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("epoll_wait: %w", err)
		}
		for _, ev := range l.events[:n] {
			if int(ev.Fd) == l.ln {
				if stop, err := l.accept(); stop {
					return err
				}
				continue
			}
			// A socket closed earlier in this batch may have had its descriptor reused.
			if s := l.socks[ev.Fd]; s != nil && int32(s.id) == ev.Pad {
				l.handle(s, ev.Events)
			}
		}
	}
}

func (l *loop) closeAll() {
	for _, s := range l.socks {
		if s != nil {
			unix.Close(s.fd)
		}
	}
	for _, fd := range []int{l.ln, l.ep} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

func (l *loop) accept() (stop bool, err error) {
	for {
		fd, _, err := unix.Accept4(l.ln, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		switch {
		case err == unix.EAGAIN:
			return false, nil
		case err == unix.EINVAL: // proxy.close
			return true, nil
		case err == unix.ECONNABORTED || err == unix.EINTR:
			continue
		case err != nil:
			return true, fmt.Errorf("accept: %w", err)
		}
		if _, err := l.add(fd, false); err != nil {
			return true, err
		}
	}
}

// add registers fd for every event, edge-triggered, once for its lifetime.
func (l *loop) add(fd int, backend bool) (*sock, error) {
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	l.lastID++
	s := &sock{fd: fd, id: l.lastID, backend: backend, buf: make([]byte, bufSize), writable: true}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd), Pad: int32(s.id)}
	if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("epoll_ctl: %w", err)
	}
	if fd >= len(l.socks) {
		l.socks = append(l.socks, make([]*sock, fd+1-len(l.socks))...)
	}
	l.socks[fd] = s
	return s, nil
}

func (l *loop) close(s *sock) {
	if s == nil || s.fd < 0 {
		return
	}
	if s.state == idle {
		for i, p := range l.pool {
			if p == s {
				l.pool[i] = l.pool[len(l.pool)-1]
				l.pool = l.pool[:len(l.pool)-1]
				break
			}
		}
	}
	if s.peer != nil {
		s.peer.peer, s.peer = nil, nil
	}
	l.socks[s.fd] = nil
	unix.Close(s.fd)
	s.fd = -1
}

func (l *loop) handle(s *sock, ev uint32) {
	if ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		s.hup = true
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		s.readable = true
	}
	switch {
	case s.connecting:
		if ev&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			l.connected(s)
		}
		return
	case s.state == idle:
		// The backend closed a pooled connection or sent bytes nobody asked for; or
		// this is a stale edge from the reply the connection just finished.
		if s.readable {
			if _, err := unix.Read(s.fd, s.buf); err != unix.EAGAIN {
				l.close(s)
			}
		}
		return
	case s.state == waiting && s.hup: // the client left before its reply, as nginx sees it
		l.abort(s)
		return
	}
	if ev&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 && !s.writable {
		s.writable = true
		if s.peer != nil {
			l.pump(s.peer)
		}
	}
	l.pump(s)
}

// pump moves s's current message on to its peer as far as both sockets allow.
func (l *loop) pump(s *sock) {
	for s.fd >= 0 && (s.state == head || s.state == body) {
		switch {
		case s.state == body && s.end < s.n && !s.complete():
			l.frame(s)
		case s.off < s.end:
			if !l.send(s) {
				return
			}
		case s.state == body && s.complete():
			l.finish(s)
			return
		case s.state == head && l.startMessage(s):
		default:
			if !l.fill(s) {
				return
			}
		}
	}
}

func (s *sock) complete() bool {
	return s.framing == byLength && s.left == 0 || s.framing == chunked && s.chunks.Done()
}

// fill reads more of s once everything framed has been sent; false when
// nothing more can be read now (or s was closed).
func (l *loop) fill(s *sock) bool {
	if s.off > 0 {
		s.n = copy(s.buf, s.buf[s.off:s.n])
		s.end -= s.off
		s.off = 0
	}
	if s.n == len(s.buf) { // only a head can fill the buffer
		if s.backend {
			l.abort(s)
		} else {
			l.reply(s, "431 Request Header Fields Too Large")
		}
		return false
	}
	if !s.readable {
		return false
	}
	m, err := unix.Read(s.fd, s.buf[s.n:])
	if err == unix.EAGAIN {
		s.readable = false
		return false
	}
	if err != nil || m == 0 {
		l.abort(s)
		return false
	}
	// A short read drained the socket: the next arrival raises a new edge, so
	// waiting for it saves the read that would return EAGAIN.
	if m < len(s.buf)-s.n && !s.hup {
		s.readable = false
	}
	s.n += m
	return true
}

// send writes s's framed bytes to its peer; false when the peer cannot take more now.
func (l *loop) send(s *sock) bool {
	d := s.peer
	if !d.writable {
		return false
	}
	m, err := unix.Write(d.fd, s.buf[s.off:s.end])
	if err == unix.EAGAIN {
		d.writable = false
		return false
	}
	if err != nil {
		l.abort(d)
		return false
	}
	if m < s.end-s.off {
		d.writable = false
	}
	s.off += m
	s.replied = s.replied || s.backend
	return true
}

// frame marks how many of the unframed bytes belong to the current message.
func (l *loop) frame(s *sock) {
	k := s.n - s.end
	switch s.framing {
	case byLength:
		k = int(min(int64(k), s.left))
		s.left -= int64(k)
	case chunked:
		var err error
		if k, err = s.chunks.Scan(s.buf[s.end:s.n]); err != nil {
			l.abort(s)
			return
		}
	}
	s.end += k
}

// finish ends an exchange once s's whole message has been sent.
func (l *loop) finish(s *sock) {
	if !s.backend {
		s.state = waiting
		if s.hup {
			l.abort(s)
		}
		return
	}
	c := s.peer
	s.peer, c.peer = nil, nil
	early := c.state != waiting // the backend answered before the request's end
	if s.closeAfter || early || s.off < s.n {
		l.close(s)
	} else {
		s.state, s.off, s.end, s.n, s.replied = idle, 0, 0, 0, false
		l.pool = append(l.pool, s)
	}
	if c.closeAfter || early {
		l.close(c)
		return
	}
	c.state = head
	l.pump(c) // a pipelined request may be buffered already
}

// startMessage parses a whole head in s's buffer, strips its Connection
// headers and frames it; false when the head is not all there yet.
func (l *loop) startMessage(s *sock) bool {
	i := bytes.Index(s.buf[s.off:s.n], crlfcrlf)
	if i < 0 {
		return false
	}
	end := s.off + i + 4
	line := s.off + bytes.Index(s.buf[s.off:end], crlf) + 2
	first := s.buf[s.off : line-2]
	length, te, closeConn := int64(-1), []byte(nil), false
	for line < end-2 {
		next := line + bytes.Index(s.buf[line:end], crlf) + 2
		name, value, _ := bytes.Cut(s.buf[line:next-2], []byte(":"))
		value = bytes.TrimSpace(value)
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			if n := parseLength(value); length == -1 || n == length {
				length = n
			} else {
				length = -2 // two different lengths: unframeable
			}
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			te = value
		case bytes.EqualFold(name, []byte("Connection")):
			for v := value; len(v) > 0; {
				var token []byte
				token, v, _ = bytes.Cut(v, comma)
				closeConn = closeConn || bytes.EqualFold(bytes.TrimSpace(token), []byte("close"))
			}
			copy(s.buf[line:], s.buf[next:s.n])
			s.n -= next - line
			end -= next - line
			continue
		}
		line = next
	}
	s.closeAfter = s.closeAfter || closeConn
	s.framing, s.left, s.end = byLength, 0, end
	if s.backend {
		return l.startReply(s, first, length, te)
	}
	http10 := bytes.HasSuffix(first, []byte(" HTTP/1.0"))
	s.closeAfter = s.closeAfter || http10 // and the backend will close its side
	switch {
	case !http10 && !bytes.HasSuffix(first, []byte(" HTTP/1.1")):
		l.reply(s, "505 HTTP Version Not Supported")
		return true
	case te != nil:
		l.reply(s, "411 Length Required")
		return true
	case length == -2:
		l.reply(s, "400 Bad Request")
		return true
	}
	s.state, s.left, s.headReq = body, max(length, 0), bytes.HasPrefix(first, []byte("HEAD "))
	u, err := l.upstream()
	if err != nil {
		l.reply(s, "502 Bad Gateway")
		return true
	}
	s.peer, u.peer = u, s
	return true
}

func (l *loop) startReply(s *sock, first []byte, length int64, te []byte) bool {
	status := 0
	if len(first) >= 12 && bytes.HasPrefix(first, []byte("HTTP/1.")) {
		status = int(parseLength(first[9:12]))
	}
	s.closeAfter = s.closeAfter || !bytes.HasPrefix(first, []byte("HTTP/1.1 "))
	switch {
	case status < 100 || status == 101 || length == -2:
		l.abort(s)
	case status < 200: // interim: relay it and read the next head
	case s.peer.headReq || status == 204 || status == 304:
		s.state = body
	case len(te) >= 7 && bytes.EqualFold(te[len(te)-7:], []byte("chunked")):
		s.state, s.framing, s.chunks = body, chunked, chunkedbody.Scanner{}
	case length >= 0:
		s.state, s.left = body, length
	default:
		s.state, s.framing, s.closeAfter = body, byClose, true
	}
	return true
}

// parseLength parses a Content-Length value: -2 if it is not one.
func parseLength(v []byte) int64 {
	if len(v) == 0 || len(v) > 18 {
		return -2
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return -2
		}
		n = n*10 + int64(c-'0')
	}
	return n
}

// upstream takes a pooled backend connection or opens one.
func (l *loop) upstream() (*sock, error) {
	if n := len(l.pool); n > 0 {
		u := l.pool[n-1]
		l.pool = l.pool[:n-1]
		u.state = head
		return u, nil
	}
	fd, err := unix.Socket(family(l.backend), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	err = unix.Connect(fd, l.backend)
	if err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		return nil, err
	}
	u, addErr := l.add(fd, true)
	if addErr != nil {
		return nil, addErr
	}
	u.connecting = err != nil
	u.writable = !u.connecting
	return u, nil
}

func (l *loop) connected(u *sock) {
	if v, err := unix.GetsockoptInt(u.fd, unix.SOL_SOCKET, unix.SO_ERROR); err != nil || v != 0 {
		l.abort(u)
		return
	}
	u.connecting, u.writable = false, true
	l.pump(u.peer)
}

// abort ends s's exchange after a failure on s: the client gets a 502 if
// the backend failed before its reply began; both sockets are closed.
func (l *loop) abort(s *sock) {
	c, u := s, s.peer
	if s.backend {
		c, u = s.peer, s
	}
	l.close(u)
	if s.backend && c != nil && !s.replied {
		l.reply(c, "502 Bad Gateway")
	}
	l.close(c)
}

// reply answers the client itself and closes it. One write is enough: the
// client's send buffer holds nothing of ours at this point.
func (l *loop) reply(c *sock, status string) {
	_, _ = unix.Write(c.fd, []byte("HTTP/1.1 "+status+"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"))
	l.close(c)
}
