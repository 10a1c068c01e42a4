package kvtransfer

import (
	"bytes"
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
	return splitPeerListener(ln, classifyTimeout)
}

func splitPeerListener(ln net.Listener, helloTimeout time.Duration) (rooms, memory net.Listener) {
	m := &peerMux{ln: ln, helloTimeout: helloTimeout, classifying: map[net.Conn]struct{}{}, slots: make(chan struct{}, maxClassifying)}
	for i := range m.subs {
		m.subs[i] = &subListener{m: m, ch: make(chan net.Conn), done: make(chan struct{})}
	}
	m.wg.Add(1)
	go m.acceptLoop()
	return m.subs[0], m.subs[1]
}

// Before its HELLO is in, a connection is anyone's: it gets classifyTimeout
// to send the whole first frame, which may be at most maxHelloLen (the
// largest region table is tens of KiB), held as it arrives, and at most
// maxClassifying connections are read at once (more wait in the backlog).
// A flood of silent or trickling connections so costs a few MiB at most.
const (
	classifyTimeout = 10 * time.Second
	maxHelloLen     = 256 << 10
	maxClassifying  = 64
)

type peerMux struct {
	ln           net.Listener
	helloTimeout time.Duration
	subs         [2]*subListener // rooms, memory
	wg           sync.WaitGroup

	mu          sync.Mutex
	closedSubs  int
	classifying map[net.Conn]struct{}
	stopped     bool
	slots       chan struct{} // one per connection being classified
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
		m.slots <- struct{}{}
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

// classify reads the first frame, which must be a HELLO or MEM_HELLO of at
// most maxHelloLen, and hands the connection, that frame included, to the
// listener it belongs to; anything else is closed.
func (m *peerMux) classify(c net.Conn) {
	defer func() {
		<-m.slots
		m.wg.Done()
	}()
	_ = c.SetReadDeadline(time.Now().Add(m.helloTimeout))
	sub, hello := m.readHello(c)
	_ = c.SetReadDeadline(time.Time{})
	m.mu.Lock()
	delete(m.classifying, c)
	m.mu.Unlock()
	if sub == nil {
		_ = c.Close()
		return
	}
	select {
	case sub.ch <- &prefixConn{Conn: c, prefix: hello}:
	case <-sub.done:
		_ = c.Close()
	}
}

// readHello returns the listener c's first frame is for, and the frame.
func (m *peerMux) readHello(c net.Conn) (*subListener, []byte) {
	var h [wire.HeaderLen]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return nil, nil
	}
	t, n, err := wire.ParseHeader(h[:])
	if err != nil || n > maxHelloLen {
		return nil, nil
	}
	var sub *subListener
	switch t {
	case wire.THello:
		sub = m.subs[0]
	case wire.TMemHello:
		sub = m.subs[1]
	default:
		return nil, nil
	}
	// Grown as bytes arrive: a length alone reserves nothing.
	frame := bytes.NewBuffer(h[:])
	if _, err := io.CopyN(frame, c, int64(n)); err != nil {
		return nil, nil
	}
	return sub, frame.Bytes()
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
