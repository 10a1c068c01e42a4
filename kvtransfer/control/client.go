package control

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// ErrClientClosed is returned for calls on a closed or broken connection.
var ErrClientClosed = errors.New("kvproxy control connection closed")

// Client is an engine's connection to its kvproxy. Safe for concurrent use;
// calls are multiplexed on one socket.
type Client struct {
	c    *net.UnixConn
	wmu  sync.Mutex
	mu   sync.Mutex
	next uint64
	wait map[uint64]chan *Reply
	err  error
	done chan struct{}
}

// Dial connects to the kvproxy's control socket.
func Dial(path string) (*Client, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("dial kvproxy %s: %w", path, err)
	}
	cl := &Client{c: c, wait: map[uint64]chan *Reply{}, done: make(chan struct{})}
	go cl.readLoop()
	return cl, nil
}

// Done is closed once the connection is broken or closed; calls then fail
// with ErrClientClosed and the caller must dial again.
func (c *Client) Done() <-chan struct{} { return c.done }

// Close closes the connection; the kvproxy aborts rooms still open on it.
func (c *Client) Close() error {
	err := c.c.Close()
	<-c.done
	return err
}

func (c *Client) readLoop() {
	defer close(c.done)
	var pending []byte
	buf := make([]byte, 64<<10)
	fail := func(err error) {
		c.mu.Lock()
		c.err = err
		for id, ch := range c.wait {
			close(ch)
			delete(c.wait, id)
		}
		c.mu.Unlock()
	}
	for {
		n, err := c.c.Read(buf)
		if err != nil {
			fail(fmt.Errorf("%w: %v", ErrClientClosed, err))
			return
		}
		pending = append(pending, buf[:n]...)
		for {
			body, rest, err := splitFrame(pending)
			if err != nil {
				fail(err)
				c.c.Close()
				return
			}
			if body == nil {
				break
			}
			r, err := DecodeReply(body)
			if err != nil {
				fail(err)
				c.c.Close()
				return
			}
			pending = append(pending[:0], rest...)
			c.mu.Lock()
			ch := c.wait[r.ID]
			delete(c.wait, r.ID)
			c.mu.Unlock()
			if ch != nil {
				ch <- r
			}
		}
	}
}

// call sends req and waits for the reply.
func (c *Client) call(ctx context.Context, req *Request) (*Reply, error) {
	return c.callWith(ctx, req, nil)
}

// callWith sends req with the ancillary data oob (SCM_RIGHTS) and waits for
// the reply.
func (c *Client) callWith(ctx context.Context, req *Request, oob []byte) (*Reply, error) {
	ch := make(chan *Reply, 1)
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return nil, c.err
	}
	c.next++
	req.ID = c.next
	c.wait[req.ID] = ch
	c.mu.Unlock()
	frame := EncodeRequest(req)
	c.wmu.Lock()
	var err error
	if oob == nil {
		_, err = c.c.Write(frame)
	} else {
		_, _, err = c.c.WriteMsgUnix(frame, oob, nil)
	}
	c.wmu.Unlock()
	if err != nil {
		c.forget(req.ID)
		return nil, fmt.Errorf("%w: %v", ErrClientClosed, err)
	}
	select {
	case r, ok := <-ch:
		if !ok {
			return nil, ErrClientClosed
		}
		if r.Err != "" {
			return r, errors.New(r.Err)
		}
		return r, nil
	case <-ctx.Done():
		c.forget(req.ID)
		return nil, ctx.Err()
	}
}

func (c *Client) forget(id uint64) {
	c.mu.Lock()
	delete(c.wait, id)
	c.mu.Unlock()
}

// RoomLayout tells the kvproxy where the engine's KV buffers lie, in
// memory this connection registered; rooms need it.
func (c *Client) RoomLayout(ctx context.Context, l RoomLayout) error {
	_, err := c.call(ctx, &Request{Op: OpRoomLayout, Layout: l})
	return err
}

// Expect (decode) announces a room and where its pages must land.
func (c *Client) Expect(ctx context.Context, room uint64, bootstrapAddr string, pages []uint32, aux int32) error {
	_, err := c.call(ctx, &Request{Op: OpExpect, Room: room, Bootstrap: bootstrapAddr, Pages: pages, Aux: aux})
	return err
}

// Send (prefill) queues a chunk of the room's pages.
func (c *Client) Send(ctx context.Context, room uint64, pages []uint32, last bool, aux int32) error {
	_, err := c.call(ctx, &Request{Op: OpSend, Room: room, Pages: pages, Last: last, Aux: aux})
	return err
}

// Poll returns the room's status now.
func (c *Client) Poll(ctx context.Context, room uint64) (rooms.Status, error) {
	return c.poll(ctx, room, false)
}

// Wait blocks until the room ends (or ctx does) and returns its status.
func (c *Client) Wait(ctx context.Context, room uint64) (rooms.Status, error) {
	return c.poll(ctx, room, true)
}

func (c *Client) poll(ctx context.Context, room uint64, wait bool) (rooms.Status, error) {
	r, err := c.call(ctx, &Request{Op: OpPoll, Room: room, Wait: wait})
	if err != nil {
		return rooms.Status{}, err
	}
	return rooms.Status{
		State: rooms.State(r.State), Reason: r.Reason, Pages: r.Pages, Bytes: r.Bytes,
		Transfer: time.Duration(r.TransferNs), Wall: time.Duration(r.WallNs),
	}, nil
}

// Abort fails the room on both sides.
func (c *Client) Abort(ctx context.Context, room uint64, reason string) error {
	_, err := c.call(ctx, &Request{Op: OpAbort, Room: room, Reason: reason})
	return err
}

// Hello returns the kvproxy's peer address (what other engines name it by:
// Mooncake's session id) and its transport.
func (c *Client) Hello(ctx context.Context) (peerAddr, transport string, err error) {
	r, err := c.call(ctx, &Request{Op: OpHello})
	if err != nil {
		return "", "", err
	}
	return r.PeerAddr, r.Transport, nil
}

// RegisterMemory registers host memory [addr, addr+length) of this
// process, whose pages are the memfd fd from offset 0 (the caller keeps fd).
func (c *Client) RegisterMemory(ctx context.Context, addr, length uint64, fd int) error {
	_, err := c.callWith(ctx, &Request{Op: OpRegisterMemory, Kind: wire.MemHost, Addr: addr, Len: length}, syscall.UnixRights(fd))
	return err
}

// RegisterCUDA registers device memory by its IPC handle (issue 16's seam).
func (c *Client) RegisterCUDA(ctx context.Context, addr, length uint64, handle []byte, handleOffset uint64) error {
	_, err := c.call(ctx, &Request{Op: OpRegisterMemory, Kind: wire.MemCUDA, Addr: addr, Len: length, Handle: handle, HandleOffset: handleOffset})
	return err
}

// UnregisterMemory drops the region holding addr.
func (c *Client) UnregisterMemory(ctx context.Context, addr uint64) error {
	_, err := c.call(ctx, &Request{Op: OpUnregisterMemory, Addr: addr})
	return err
}

// Write copies the triples into the engine behind peer; it returns once the
// bytes are complete there.
func (c *Client) Write(ctx context.Context, peer string, triples []Triple) error {
	_, err := c.call(ctx, &Request{Op: OpWrite, Peer: peer, Triples: triples})
	return err
}

// WritePages moves a page write into the engine behind peer (see
// kvtransfer.PageWrite); it returns once the bytes are complete there.
func (c *Client) WritePages(ctx context.Context, peer string, w kvtransfer.PageWrite) error {
	_, err := c.call(ctx, &Request{Op: OpWritePages, Peer: peer, PageWrite: w})
	return err
}

// Probe checks that peer can be reached.
func (c *Client) Probe(ctx context.Context, peer string) error {
	_, err := c.call(ctx, &Request{Op: OpProbe, Peer: peer})
	return err
}
