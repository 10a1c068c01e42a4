package router

import (
	"net"
	"sync"
	"syscall"
	"time"
)

// Once a PD stream is written, its client's keep-alive connection waits
// for the client's next request. fasthttp's ServeConn waited for it with a
// goroutine (serveConn's deep frame) and a RequestCtx of its own per
// connection: at the end of 10,000 streams, that was the router's peak
// (bench/RESULTS.md). The connection is parked in the shared epoll set
// instead (connwatch_linux.go), holding neither, and ServeConn starts only
// once the client's next bytes arrive. A client that hangs up is closed
// there; so is a connection idle past the server's idle timeout, and at
// shutdown every parked one. Without epoll, ServeConn waits as before.

// parkHost is what serves, or closes, a parked connection: the Server.
type parkHost interface {
	serveParked(net.Conn) // the client's next bytes have arrived
	closeParked(net.Conn) // it left, or stayed idle too long, or the server stops
}

// parkedConn is one connection waiting for its client's next request.
// Its fields below token are guarded by lot.mu.
type parkedConn struct {
	conn  net.Conn
	rc    syscall.RawConn
	host  parkHost
	lot   *parkingLot
	ep    *epoller
	token uint64 // its key in ep

	until      time.Time // closed when still idle then; zero: never
	prev, next *parkedConn
	parked     bool
}

// parkingLot holds one server's parked connections, oldest first: with one
// idle timeout for all, that is the order they time out in, and one timer,
// set for the oldest, closes them.
type parkingLot struct {
	mu         sync.Mutex
	head, tail *parkedConn
	count      int
	closed     bool // the server is stopping: nothing more is parked
	timer      *time.Timer
}

// park hands c to the lot until its client's next bytes arrive (host
// serves it then), it hangs up or it is idle for idle (host closes it); 0
// is no idle timeout. At shutdown c is closed at once. False when c
// cannot be parked (no epoll, not a socket): c is left to the caller.
func (w *watcher) park(c net.Conn, idle time.Duration, host parkHost) bool {
	rc := rawConn(c)
	if rc == nil {
		return false
	}
	l := &w.lot
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		host.closeParked(c)
		return true
	}
	ep := w.epoller()
	if ep == nil {
		l.mu.Unlock()
		return false
	}
	p := &parkedConn{conn: c, rc: rc, host: host, lot: l}
	if idle > 0 {
		p.until = time.Now().Add(idle)
	}
	// Registered under l.mu: an event for it waits until it is in the list.
	if ep.addParked(p) != nil {
		l.mu.Unlock()
		return false
	}
	p.ep = ep
	l.pushLocked(p)
	l.mu.Unlock()
	return true
}

// pushLocked puts p at the list's end, and sets the timer for it if it is
// the only one (under mu).
func (l *parkingLot) pushLocked(p *parkedConn) {
	p.parked = true
	p.prev = l.tail
	if l.tail != nil {
		l.tail.next = p
	} else {
		l.head = p
	}
	l.tail = p
	l.count++
	if l.head == p && !p.until.IsZero() {
		l.setTimerLocked(time.Until(p.until))
	}
}

func (l *parkingLot) setTimerLocked(d time.Duration) {
	if l.timer == nil {
		l.timer = time.AfterFunc(d, l.expire)
		return
	}
	l.timer.Reset(d)
}

// unparkLocked takes p out of the lot and the epoll set (under mu); false
// when it was no longer parked.
func (l *parkingLot) unparkLocked(p *parkedConn) bool {
	if !p.parked {
		return false
	}
	p.parked = false
	p.ep.removeParked(p)
	if p.prev != nil {
		p.prev.next = p.next
	} else {
		l.head = p.next
	}
	if p.next != nil {
		p.next.prev = p.prev
	} else {
		l.tail = p.prev
	}
	p.prev, p.next = nil, nil
	l.count--
	return true
}

// wake handles an event on p's socket: bytes are the client's next
// request, EOF or an error its hang-up, nothing a wake to wait on.
func (l *parkingLot) wake(p *parkedConn) {
	l.mu.Lock()
	if !p.parked {
		l.mu.Unlock()
		return
	}
	var gone, sent bool
	if p.rc.Control(func(fd uintptr) { gone, sent = peekPeer(fd) }) != nil {
		gone = true // closed under us: nothing left to serve
	}
	if !gone && !sent && p.ep.rearmParked(p) == nil {
		l.mu.Unlock()
		return
	}
	l.unparkLocked(p)
	l.mu.Unlock()
	if sent && !gone {
		p.host.serveParked(p.conn)
		return
	}
	p.host.closeParked(p.conn)
}

// expire closes the connections whose idle time is up, and sets the timer
// for the next.
func (l *parkingLot) expire() {
	now := time.Now()
	var expired []*parkedConn
	l.mu.Lock()
	for p := l.head; p != nil && !p.until.IsZero() && !now.Before(p.until); p = l.head {
		l.unparkLocked(p)
		expired = append(expired, p)
	}
	if p := l.head; p != nil && !p.until.IsZero() {
		l.setTimerLocked(p.until.Sub(now))
	}
	l.mu.Unlock()
	for _, p := range expired {
		p.host.closeParked(p.conn)
	}
}

// closeAll closes every parked connection and parks no more.
func (l *parkingLot) closeAll() {
	var all []*parkedConn
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	for p := l.head; p != nil; p = l.head {
		l.unparkLocked(p)
		all = append(all, p)
	}
	if l.timer != nil {
		l.timer.Stop()
	}
	l.mu.Unlock()
	for _, p := range all {
		p.host.closeParked(p.conn)
	}
}

// parked is how many connections wait in the lot.
func (l *parkingLot) parked() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.count
}
