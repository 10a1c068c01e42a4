package router

import (
	"errors"
	"os"
	"sync"
	"syscall"
)

// epoller is one epoll set holding the watched sockets, waited on by one
// goroutine. The epoll descriptor itself sits in Go's netpoller (an epoll
// set is readable while it has events), so that goroutine parks like any
// reader rather than holding a thread in epoll_wait.
//
// A socket is registered for the peer's hang-up only (EPOLLRDHUP, plus the
// errors epoll always reports), one-shot, with the watch's token as its
// data. Starting a watch re-arms the socket's registration (EPOLL_CTL_MOD,
// one system call; the first watch on a connection adds it), and stopping
// one only forgets the token: a later event for it is ignored, and the
// kernel drops the registration when the socket closes. Pipelined requests
// wake nobody, since bytes are not watched for; a parked connection
// (parkconn.go) is registered for them too (parkEvents).
//
// The epoll_ctl and the peek run inside the connection's RawConn.Control,
// which keeps its descriptor open meanwhile, and the kernel keys
// registrations by open file, not by number: a closed and reused
// descriptor number is never re-armed or peeked at in another
// connection's name (its MOD fails with ENOENT and it is added afresh).
type epoller struct {
	file *os.File
	rc   syscall.RawConn
	epfd int
	life sync.RWMutex // read-held around epoll_ctl; close takes it to close epfd

	mu      sync.Mutex // held while an event is handled, so that stop waits for onGone
	watches map[uint64]*connWatch
	parked  map[uint64]*parkedConn // idle client connections (parkconn.go)
	next    uint64
	done    chan struct{}
	closed  bool // under life
}

const watchEvents = syscall.EPOLLRDHUP | syscall.EPOLLONESHOT

// parkEvents wake a parked connection for its next bytes too.
const parkEvents = syscall.EPOLLIN | syscall.EPOLLRDHUP | syscall.EPOLLONESHOT

func newEpoller() (*epoller, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "connwatch")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	e := &epoller{file: f, rc: rc, epfd: fd, watches: map[uint64]*connWatch{}, parked: map[uint64]*parkedConn{}, done: make(chan struct{})}
	go e.run()
	return e, nil
}

var errWatcherClosed = errors.New("connwatch: closed")

// arm (re-)registers a socket for events under token.
func (e *epoller) arm(rc syscall.RawConn, token uint64, events uint32) error {
	e.life.RLock()
	defer e.life.RUnlock()
	if e.closed {
		return errWatcherClosed
	}
	var opErr error
	err := rc.Control(func(fd uintptr) {
		ev := syscall.EpollEvent{Events: events, Fd: int32(token), Pad: int32(token >> 32)}
		opErr = syscall.EpollCtl(e.epfd, syscall.EPOLL_CTL_MOD, int(fd), &ev)
		if opErr == syscall.ENOENT {
			opErr = syscall.EpollCtl(e.epfd, syscall.EPOLL_CTL_ADD, int(fd), &ev)
		}
	})
	if err != nil {
		return err
	}
	return opErr
}

func (e *epoller) add(cw *connWatch) error {
	e.mu.Lock()
	e.next++
	cw.ep, cw.token = e, e.next
	e.watches[cw.token] = cw
	e.mu.Unlock()
	if err := e.arm(cw.rc, cw.token, watchEvents); err != nil {
		e.remove(cw)
		return err
	}
	return nil
}

// remove forgets cw's watch; an event being handled for it finishes first.
func (e *epoller) remove(cw *connWatch) {
	e.mu.Lock()
	delete(e.watches, cw.token)
	e.mu.Unlock()
}

func (e *epoller) run() {
	defer close(e.done)
	events := make([]syscall.EpollEvent, 128)
	for {
		var n int
		var waitErr error
		err := e.rc.Read(func(epfd uintptr) bool {
			for {
				n, waitErr = syscall.EpollWait(int(epfd), events, 0)
				if waitErr != syscall.EINTR {
					return n != 0 || waitErr != nil // nothing yet: park
				}
			}
		})
		if err != nil || waitErr != nil {
			return // closed
		}
		for _, ev := range events[:n] {
			e.fire(uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32)
		}
	}
}

// fire handles an event for the watch or the parked connection
// registered under token.
func (e *epoller) fire(token uint64) {
	e.mu.Lock()
	cw := e.watches[token]
	if cw == nil {
		p := e.parked[token]
		e.mu.Unlock()
		if p != nil {
			p.lot.wake(p)
		}
		return // or stopped: the peer left after its request was answered
	}
	defer e.mu.Unlock()
	var gone, sent bool
	if cw.rc.Control(func(fd uintptr) { gone, sent = peekPeer(fd) }) != nil {
		return // closed: its watch is being stopped
	}
	switch {
	case gone:
		delete(e.watches, token)
		cw.onGone()
	case sent: // a pipelined request before a half-close: as with bytes alone, the watch is over
		delete(e.watches, token)
	default: // woken for nothing: arm it again
		_ = e.arm(cw.rc, cw.token, watchEvents)
	}
}

// addParked registers p's socket for its next bytes or its hang-up.
func (e *epoller) addParked(p *parkedConn) error {
	e.mu.Lock()
	e.next++
	p.token = e.next
	e.parked[p.token] = p
	e.mu.Unlock()
	if err := e.arm(p.rc, p.token, parkEvents); err != nil {
		e.removeParked(p)
		return err
	}
	return nil
}

// rearmParked waits for p's socket again after a wake for nothing.
func (e *epoller) rearmParked(p *parkedConn) error { return e.arm(p.rc, p.token, parkEvents) }

// removeParked forgets p: a later event for it is ignored.
func (e *epoller) removeParked(p *parkedConn) {
	e.mu.Lock()
	delete(e.parked, p.token)
	e.mu.Unlock()
}

// close stops the goroutine and closes the set, which drops every
// registration in it.
func (e *epoller) close() {
	e.life.Lock()
	e.closed = true
	_ = e.file.Close() // wakes the parked read
	e.life.Unlock()
	<-e.done
}
