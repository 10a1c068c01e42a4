package wire

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"syscall"
	"time"
)

// Conn frames messages over a stream. Reads must come from one goroutine;
// writes may come from many (each frame is written whole under a lock).
type Conn struct {
	nc  net.Conn
	br  *bufio.Reader
	buf []byte // reused read buffer for control payloads

	wmu      sync.Mutex
	wbuf     []byte
	tbuf     []byte // the control frame after a batch's DATA frames
	iov      net.Buffers
	wTimeout time.Duration // per frame written; 0: none

	// posted are frames Post queued, written by the next holder of wmu
	// ahead of its own; only a holder of wmu takes them, so they keep
	// their place before any frame written after Post returned.
	pmu      sync.Mutex
	posted   []Msg
	flushing bool // a goroutine is on its way to write posted

	// raw writes Post's frames without waiting (nil: nc has no socket);
	// rest is what such a write left unsent, written first by the next
	// holder of wmu.
	raw  syscall.RawConn
	rest []byte

	pending uint32 // DATA bytes the caller still has to consume
}

// NewConn wraps nc.
func NewConn(nc net.Conn) *Conn {
	c := &Conn{nc: nc, br: bufio.NewReaderSize(nc, 64<<10)}
	if sc, ok := nc.(syscall.Conn); ok {
		c.raw, _ = sc.SyscallConn()
	}
	return c
}

// NetConn is the underlying connection (for deadlines and Close).
func (c *Conn) NetConn() net.Conn { return c.nc }

// Close closes the underlying connection.
func (c *Conn) Close() error { return c.nc.Close() }

// SetWriteTimeout bounds every later frame write (0: unbounded), so a peer
// that stopped reading fails the writer instead of blocking it.
func (c *Conn) SetWriteTimeout(d time.Duration) {
	c.wmu.Lock()
	c.wTimeout = d
	c.wmu.Unlock()
}

func (c *Conn) armWrite() {
	if c.wTimeout > 0 {
		_ = c.nc.SetWriteDeadline(time.Now().Add(c.wTimeout))
	}
}

// Write sends one control frame.
func (c *Conn) Write(m Msg) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.writePosted(); err != nil {
		return err
	}
	c.armWrite()
	c.wbuf = AppendFrame(c.wbuf[:0], m)
	_, err := c.nc.Write(c.wbuf)
	return err
}

// WriteData sends a DATA frame whose bytes are taken straight from data
// (one writev of header and payload, no copy of the payload).
func (c *Conn) WriteData(region uint32, offset uint64, data []byte) error {
	return c.WriteDataThen([]DataPiece{{Region: region, Offset: offset, Data: data}}, nil)
}

// DataPiece is one DATA frame: its destination and its bytes.
type DataPiece struct {
	Region uint32
	Offset uint64
	Data   []byte
}

// dataBatchBytes bounds the payload of one writev in WriteDataThen.
const dataBatchBytes = 16 << 20

// WriteDataThen sends the pieces as consecutive DATA frames, many per
// writev (headers and payloads gathered, payloads never copied), so a write
// of many small pages costs few system calls, then control frame then
// (nil: none) in the same last writev: a small write and its fence cross
// as one segment, so the peer wakes once for both.
func (c *Conn) WriteDataThen(pieces []DataPiece, then Msg) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.writePosted(); err != nil {
		return err
	}
	if len(pieces) == 0 && then != nil {
		c.armWrite()
		c.wbuf = AppendFrame(c.wbuf[:0], then)
		_, err := c.nc.Write(c.wbuf)
		return err
	}
	for len(pieces) > 0 {
		// Headers of this writev, in one buffer that is not grown while
		// iov points into it.
		n, size := 0, 0
		for n < len(pieces) && n < 512 && (n == 0 || size+len(pieces[n].Data) <= dataBatchBytes) {
			if len(pieces[n].Data) > MaxDataLen {
				return fmt.Errorf("DATA of %d bytes exceeds %d", len(pieces[n].Data), MaxDataLen)
			}
			size += len(pieces[n].Data)
			n++
		}
		if need := n * (HeaderLen + DataHeaderLen); cap(c.wbuf) < need {
			c.wbuf = make([]byte, 0, need)
		}
		c.wbuf, c.iov = c.wbuf[:0], c.iov[:0]
		for _, p := range pieces[:n] {
			start := len(c.wbuf)
			c.wbuf = AppendFrame(c.wbuf, &Data{Region: p.Region, Offset: p.Offset, N: uint32(len(p.Data))})
			c.iov = append(c.iov, c.wbuf[start:len(c.wbuf):len(c.wbuf)], p.Data)
		}
		if n == len(pieces) && then != nil {
			c.tbuf = AppendFrame(c.tbuf[:0], then)
			c.iov = append(c.iov, c.tbuf)
		}
		c.armWrite()
		if _, err := c.iov.WriteTo(c.nc); err != nil {
			return err
		}
		pieces = pieces[n:]
	}
	return nil
}

// Post queues control frame m and returns without waiting for the write
// lock. The reader of a connection answers its peer with Post: a reader
// waiting behind this side's bulk write, which only the peer's reader can
// drain, while the peer's reader waits the same way, would stall both
// until the write timeout. Posted frames go out in order, ahead of every
// frame written after Post returns. One that cannot be written closes the
// connection (the stream may hold part of a frame).
func (c *Conn) Post(m Msg) {
	c.pmu.Lock()
	c.posted = append(c.posted, m)
	start := !c.flushing
	c.flushing = true
	c.pmu.Unlock()
	if !start {
		return
	}
	// Written here when no writer holds the lock and the socket takes it
	// whole without waiting: a goroutine per answer costs more than the
	// answer, and this never blocks the reader.
	if c.wmu.TryLock() {
		sent := c.writeNow(nil)
		c.wmu.Unlock()
		if sent {
			return
		}
	}
	c.flushLater()
}

// flushLater writes what Post queued and writeNow left unsent from a
// goroutine of its own; a failure closes the connection.
func (c *Conn) flushLater() {
	go func() {
		c.wmu.Lock()
		defer c.wmu.Unlock()
		if err := c.writePosted(); err != nil {
			_ = c.nc.Close()
		}
	}()
}

// TryWriteDataThen is WriteDataThen for a caller that must not wait (a
// control read loop starting a small write). It sends nothing and reports
// false when another writer holds the connection or nc has no socket;
// else the frames, copied into one buffer (keep them small), go at once,
// and what the socket does not take a goroutine writes, ahead of any later
// frame (a failure there closes the connection, as Post's does).
func (c *Conn) TryWriteDataThen(pieces []DataPiece, then Msg) bool {
	for _, p := range pieces {
		if len(p.Data) > MaxDataLen {
			return false
		}
	}
	if c.raw == nil || !c.wmu.TryLock() {
		return false
	}
	defer c.wmu.Unlock()
	sent := c.writeNow(func(b []byte) []byte {
		for _, p := range pieces {
			b = append(AppendFrame(b, &Data{Region: p.Region, Offset: p.Offset, N: uint32(len(p.Data))}), p.Data...)
		}
		if then != nil {
			b = AppendFrame(b, then)
		}
		return b
	})
	if !sent {
		c.flushLater()
	}
	return true
}

// takePosted encodes what Post queued behind any unsent rest into wbuf;
// the caller holds wmu.
func (c *Conn) takePosted() {
	c.pmu.Lock()
	ms := c.posted
	c.posted, c.flushing = nil, false
	c.pmu.Unlock()
	c.wbuf = append(c.wbuf[:0], c.rest...)
	c.rest = c.rest[:0]
	for _, m := range ms {
		c.wbuf = AppendFrame(c.wbuf, m)
	}
}

// writePosted writes the frames Post queued; the caller holds wmu.
func (c *Conn) writePosted() error {
	c.takePosted()
	if len(c.wbuf) == 0 {
		return nil
	}
	c.armWrite()
	_, err := c.nc.Write(c.wbuf)
	return err
}

// writeNow writes the frames Post queued, then those frames appends (nil:
// none), with one write that never waits for room; what the socket does
// not take stays in rest for the next holder of wmu. It reports whether
// all went; the caller holds wmu.
func (c *Conn) writeNow(frames func([]byte) []byte) bool {
	if c.raw == nil {
		return false
	}
	c.takePosted()
	if frames != nil {
		c.wbuf = frames(c.wbuf)
	}
	n := 0
	if err := c.raw.Write(func(fd uintptr) bool {
		n, _ = syscall.Write(int(fd), c.wbuf)
		return true // never wait for room
	}); err != nil || n < 0 {
		n = 0 // a past write deadline, or the error: the blocking path meets it again
	}
	c.rest = append(c.rest, c.wbuf[n:]...)
	return len(c.rest) == 0
}

// SetReadTimeout arms the read deadline d from now (0 disables it).
func (c *Conn) SetReadTimeout(d time.Duration) error {
	if d == 0 {
		return c.nc.SetReadDeadline(time.Time{})
	}
	return c.nc.SetReadDeadline(time.Now().Add(d))
}

// Read returns the next frame. For a *Data the caller must then consume
// exactly N bytes with ReadData before calling Read again.
func (c *Conn) Read() (Msg, error) {
	if c.pending != 0 {
		return nil, fmt.Errorf("wire: %d DATA bytes not consumed", c.pending)
	}
	return ReadMsg(c.br, &c.buf, &c.pending)
}

// ReadMsg reads one frame from r; buf is reused for payloads. For DATA it
// reads only the fixed header and sets *pending to the bytes that follow.
// Exported for the fuzz target and tests.
func ReadMsg(r io.Reader, buf *[]byte, pending *uint32) (Msg, error) {
	var h [HeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	t, n, err := ParseHeader(h[:])
	if err != nil {
		return nil, err
	}
	if t == TData {
		var dh [DataHeaderLen]byte
		if _, err := io.ReadFull(r, dh[:]); err != nil {
			return nil, unexpected(err)
		}
		d := &Data{
			Region: binary.LittleEndian.Uint32(dh[:]),
			Offset: binary.LittleEndian.Uint64(dh[4:]),
			N:      n - DataHeaderLen,
		}
		*pending = d.N
		return d, nil
	}
	p, err := readPayload(r, buf, int(n))
	if err != nil {
		return nil, err
	}
	return Decode(t, p)
}

// readPayload reads n bytes into *buf, growing it only as they arrive (at
// most doubling what it holds), so a length declared by a frame that never
// comes costs about what did.
func readPayload(r io.Reader, buf *[]byte, n int) ([]byte, error) {
	p := (*buf)[:0]
	for len(p) < n {
		if len(p) == cap(p) {
			p = slices.Grow(p, min(n-len(p), max(len(p), 64<<10)))
		}
		k, err := io.ReadFull(r, p[len(p):min(n, cap(p))])
		p = p[:len(p)+k]
		if err != nil {
			*buf = p
			return nil, unexpected(err)
		}
	}
	*buf = p
	return p, nil
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// Buffered is how many bytes of the stream are read in and not yet consumed.
func (c *Conn) Buffered() int { return c.br.Buffered() }

// ReadData reads the pending DATA bytes into dst, which must be exactly
// that long: what the read buffer already holds is copied, the rest is read
// from the socket straight into dst (pages smaller than the buffer would
// otherwise pass through it).
func (c *Conn) ReadData(dst []byte) error {
	if uint32(len(dst)) != c.pending {
		return fmt.Errorf("wire: ReadData of %d bytes, %d pending", len(dst), c.pending)
	}
	c.pending = 0
	k := min(c.br.Buffered(), len(dst))
	if _, err := io.ReadFull(c.br, dst[:k]); err != nil {
		return unexpected(err)
	}
	_, err := io.ReadFull(c.nc, dst[k:])
	return unexpected(err)
}

// DiscardData skips the pending DATA bytes (their destination is gone).
func (c *Conn) DiscardData() error {
	n := c.pending
	c.pending = 0
	_, err := c.br.Discard(int(n))
	return unexpected(err)
}
