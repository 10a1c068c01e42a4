package kvtransfer

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// SplitPeerListener shares one peer port between the room engine and the
// memory plane: the dialer speaks first in both protocols, so the type of a
// connection's first frame (HELLO or MEM_HELLO) says whose it is. The port
// is closed once both returned listeners are.
func SplitPeerListener(ln net.Listener) (rooms, memory net.Listener) {
	m := &peerMux{ln: ln, classifying: map[net.Conn]struct{}{}}
	for i := range m.subs {
		m.subs[i] = &subListener{m: m, ch: make(chan net.Conn), done: make(chan struct{})}
	}
	m.wg.Add(1)
	go m.acceptLoop()
	return m.subs[0], m.subs[1]
}

// classifyTimeout bounds the wait for a new connection's first header.
const classifyTimeout = 10 * time.Second

type peerMux struct {
	ln   net.Listener
	subs [2]*subListener // rooms, memory
	wg   sync.WaitGroup

	mu          sync.Mutex
	closedSubs  int
	classifying map[net.Conn]struct{}
	stopped     bool
}

type subListener struct {
	m    *peerMux
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

func (m *peerMux) acceptLoop() {
	defer m.wg.Done()
	for {
		c, err := m.ln.Accept()
		if err != nil {
			return
		}
		m.mu.Lock()
		if m.stopped {
			m.mu.Unlock()
			_ = c.Close()
			return
		}
		m.classifying[c] = struct{}{}
		m.wg.Add(1)
		m.mu.Unlock()
		go m.classify(c)
	}
}

// classify reads the first frame header and hands the connection, header
// included, to the listener it belongs to; anything else is closed.
func (m *peerMux) classify(c net.Conn) {
	defer m.wg.Done()
	var h [wire.HeaderLen]byte
	_ = c.SetReadDeadline(time.Now().Add(classifyTimeout))
	_, err := io.ReadFull(c, h[:])
	_ = c.SetReadDeadline(time.Time{})
	m.mu.Lock()
	delete(m.classifying, c)
	m.mu.Unlock()
	var sub *subListener
	if err == nil {
		switch t, _, perr := wire.ParseHeader(h[:]); {
		case perr != nil:
		case t == wire.THello:
			sub = m.subs[0]
		case t == wire.TMemHello:
			sub = m.subs[1]
		}
	}
	if sub == nil {
		_ = c.Close()
		return
	}
	select {
	case sub.ch <- &prefixConn{Conn: c, prefix: h[:]}:
	case <-sub.done:
		_ = c.Close()
	}
}

func (s *subListener) Accept() (net.Conn, error) {
	select {
	case c := <-s.ch:
		return c, nil
	case <-s.done:
		return nil, net.ErrClosed
	}
}

// Close closes this side; the last one closes the port and waits for the
// connections still being classified.
func (s *subListener) Close() error {
	var err error
	s.once.Do(func() {
		close(s.done)
		m := s.m
		m.mu.Lock()
		m.closedSubs++
		last := m.closedSubs == len(m.subs)
		if last {
			m.stopped = true
			for c := range m.classifying {
				_ = c.Close()
			}
		}
		m.mu.Unlock()
		if last {
			err = m.ln.Close()
			m.wg.Wait()
		}
	})
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

func (s *subListener) Addr() net.Addr { return s.m.ln.Addr() }

// prefixConn replays the bytes classify read before the rest.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(b []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(b, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(b)
}
