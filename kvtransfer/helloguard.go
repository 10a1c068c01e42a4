package kvtransfer

import (
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Before its MEM_HELLO is in, a connection to the peer port is anyone's:
// its first frame must be a MEM_HELLO (or a write-only client's
// MEM_CLIENT: directwrite.go) of at most maxHelloLen (the largest
// region table is tens of KiB), arriving within the handshake deadline,
// and at most maxHandshakes connections are read at once (more wait in the
// backlog). A flood of silent, trickling or oversized connections so costs
// a few MiB at most.
const (
	maxHelloLen   = 256 << 10
	maxHandshakes = 64
)

// admitHello reads c's first frame header and refuses anything but a
// MEM_HELLO or MEM_CLIENT of at most maxHelloLen; it returns which, and c
// with the header put back for the handshake to read.
func admitHello(c net.Conn) (net.Conn, wire.Type, error) {
	var h [wire.HeaderLen]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return nil, 0, err
	}
	t, n, err := wire.ParseHeader(h[:])
	if err != nil {
		return nil, 0, err
	}
	if t != wire.TMemHello && t != wire.TMemClient || n > maxHelloLen {
		return nil, 0, fmt.Errorf("%w: first frame %s of %d bytes", wire.ErrMalformed, t, n)
	}
	return &prefixConn{Conn: c, prefix: h[:]}, t, nil
}

// prefixConn replays the bytes admitHello read before the rest.
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

// SyscallConn is the socket beneath, for wire.Conn's writes that must not
// wait (the prefix concerns reads only).
func (c *prefixConn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.New("no socket beneath")
	}
	return sc.SyscallConn()
}
