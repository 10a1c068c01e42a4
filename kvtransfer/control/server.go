package control

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Server serves one engine's control connections.
type Server struct {
	// Memory serves the engine-memory API.
	Memory *kvtransfer.MemoryPlane
	// Rooms serves the room API on top (nil: not offered).
	Rooms *rooms.Rooms
	Log   *zap.Logger
	// OnLayout runs after an engine registered its room layout (the
	// prefill kvproxy then announces itself on its bootstrap server).
	OnLayout func(rooms.Layout)
	// MaxConns caps the connections served at once (0: 256); more are
	// closed as they arrive.
	MaxConns int
	// FrameTimeout bounds the read of a frame once its first bytes are in
	// (0: 10 s); an idle connection waits as long as it likes.
	FrameTimeout time.Duration

	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[*conn]struct{}
}

// Engines counts the engine connections open now.
func (s *Server) Engines() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// Serve accepts connections until ln is closed, then waits for every
// connection handler to finish.
func (s *Server) Serve(ctx context.Context, ln *net.UnixListener) error {
	if s.Log == nil {
		s.Log = zap.NewNop()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer func() {
		cancel()
		s.wg.Wait()
	}()
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	slots := make(chan struct{}, cmp.Or(s.MaxConns, defaultMaxConns))
	var backoff netutil.Backoff
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			if !netutil.Temporary(err) {
				return err
			}
			// Out of fds (EMFILE): pause and retry, as net/http does.
			pause := backoff.Next()
			s.Log.Warn("control socket accept failed; retrying", zap.Error(err), zap.Duration("pause", pause))
			select {
			case <-time.After(pause):
			case <-ctx.Done():
				return nil
			}
			continue
		}
		backoff.Reset()
		select {
		case slots <- struct{}{}:
		default:
			// Refused at once rather than left in the backlog: the engine
			// sees the failure instead of hanging on a connect.
			s.Log.Warn("control socket: connection cap reached; refusing a connection", zap.Int("max", cap(slots)))
			c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer func() {
				<-slots
				s.wg.Done()
			}()
			s.serveConn(ctx, c)
		}()
	}
}

type conn struct {
	s     *Server
	c     *net.UnixConn
	wmu   sync.Mutex
	rooms map[uint64]struct{} // rooms this client opened, aborted if it goes away
	rmu   sync.Mutex
	// mem holds what this client registered, dropped when it goes away
	// (nil: the server has no memory plane).
	mem *kvtransfer.MemorySession
}

func (s *Server) serveConn(ctx context.Context, uc *net.UnixConn) {
	ctx, cancel := context.WithCancel(ctx)
	c := &conn{s: s, c: uc, rooms: map[uint64]struct{}{}}
	if s.Memory != nil {
		c.mem = s.Memory.NewSession()
	}
	s.mu.Lock()
	if s.conns == nil {
		s.conns = map[*conn]struct{}{}
	}
	s.conns[c] = struct{}{}
	s.mu.Unlock()
	var wg sync.WaitGroup
	// fds received and not yet claimed: each host RegisterMemory frame
	// claims the oldest (its memfd arrives with the frame's first bytes).
	var fds []int
	defer func() {
		cancel()
		uc.Close()
		wg.Wait()
		for _, fd := range fds {
			syscall.Close(fd)
		}
		// The engine went away: its unfinished rooms would only time out,
		// and their pages are its memory, about to be dropped.
		c.rmu.Lock()
		for room := range c.rooms {
			if st, err := s.Rooms.Poll(room); err == nil && !st.State.Terminal() {
				_ = s.Rooms.Abort(room, "engine disconnected from kvproxy")
			}
		}
		c.rmu.Unlock()
		if c.mem != nil {
			if err := c.mem.Close(); err != nil {
				s.Log.Warn("control: dropping the engine's memory", zap.Error(err))
			}
		}
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
	}()
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	defer stop()
	// Reads land in pending's spare room, grown toward the frame being read
	// (see readRoom).
	pending := make([]byte, 0, readChunk)
	oob := make([]byte, syscall.CmsgSpace(4*4))
	frameTimeout := cmp.Or(s.FrameTimeout, defaultFrameTimeout)
	timed := false              // a read deadline is armed for the frame in progress
	work := make(chan *Request) // to an idle worker (c.work)
	for {
		pending = slices.Grow(pending, readRoom(pending))
		n, oobn, _, _, err := uc.ReadMsgUnix(pending[len(pending):cap(pending)], oob)
		if oobn > 0 {
			fds = append(fds, parseFds(oob[:oobn])...)
		}
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				s.Log.Warn("control: a frame stalled midway, closing", zap.Duration("timeout", frameTimeout), zap.Int("have", len(pending)))
			}
			return
		}
		pending = pending[:len(pending)+n]
		framed := false
		for {
			body, rest, err := splitFrame(pending)
			if err != nil {
				s.Log.Warn("control: bad frame, closing", zap.Error(err))
				return
			}
			if body == nil {
				break
			}
			req, err := DecodeRequest(body)
			if err != nil {
				s.Log.Warn("control: bad request, closing", zap.Error(err))
				return
			}
			pending = append(pending[:0], rest...)
			framed = true
			fd := -1
			if req.Op == OpRegisterMemory && req.Kind == wire.MemHost && len(fds) > 0 {
				fd, fds = fds[0], fds[1:]
			}
			// Waits and transfers run beside the loop, so one caller's wait
			// does not hold up another's request; a small write is started
			// here and answered by whoever completes it (a hand-off to a
			// worker, and from the link's reader back to it, cost more than
			// the write).
			if req.Op == OpWrite && c.mem != nil && c.mem.Start(req.Peer, req.Triples, func(err error) { c.replyNow(memReply(req, err)) }) {
				continue
			}
			if (req.Op == OpPoll && req.Wait) || req.Op == OpWrite || req.Op == OpWritePages || req.Op == OpProbe || req.Op == OpDirectRoute {
				select {
				case work <- req:
				default:
					wg.Add(1)
					go func() {
						defer wg.Done()
						c.work(ctx, req, work)
					}()
				}
				continue
			}
			c.reply(c.handle(ctx, req, fd))
		}
		// A frame begun must arrive within frameTimeout (a truncated one
		// would hold the connection forever); between frames the engine
		// may idle as long as it likes.
		switch {
		case len(pending) > 0 && (framed || !timed):
			_ = uc.SetReadDeadline(time.Now().Add(frameTimeout))
			timed = true
		case len(pending) == 0 && timed:
			_ = uc.SetReadDeadline(time.Time{})
			timed = false
		}
		if len(pending) == 0 && cap(pending) > 4<<20 {
			pending = make([]byte, 0, readChunk) // room for SGLang-sized writes stays; the biggest frames' does not
		}
	}
}

const (
	defaultMaxConns     = 256
	defaultFrameTimeout = 10 * time.Second
	readChunk           = 64 << 10
)

// readRoom is the free space the next read gets. A frame's declared
// length is trusted only as far as its bytes have come: the room at most
// doubles what the frame already holds, so a 16 MiB Write lands in a few
// reads (amortised one extra copy) and a truncated one costs about what
// it sent, not what it declared.
func readRoom(pending []byte) int {
	if len(pending) < 4 {
		return readChunk
	}
	left := min(int(binary.LittleEndian.Uint32(pending))+4, maxFrame+4) - len(pending)
	return max(readChunk, min(left, len(pending)))
}

// parseFds returns the descriptors an SCM_RIGHTS message carried.
func parseFds(oob []byte) []int {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var all []int
	for _, m := range msgs {
		if fds, err := syscall.ParseUnixRights(&m); err == nil {
			all = append(all, fds...)
		}
	}
	return all
}

// work answers req, then every request handed to it on more, until the
// connection ends. Workers stay for the connection's life (as many as its
// most requests in flight at once): a goroutine per request would cost its
// start, a stack grown anew and its exit on every call.
func (c *conn) work(ctx context.Context, req *Request, more <-chan *Request) {
	for {
		c.reply(c.handle(ctx, req, -1))
		select {
		case req = <-more:
		case <-ctx.Done():
			return
		}
	}
}

// reply sends r.
func (c *conn) reply(r *Reply) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_, _ = c.c.Write(EncodeReply(r))
}

// replyNow sends r without blocking its caller (a link's reader completing
// a started write): what the socket does not take at once, or all of it
// while another reply is being written, a goroutine sends.
func (c *conn) replyNow(r *Reply) {
	if !c.wmu.TryLock() {
		go c.reply(r)
		return
	}
	b := EncodeReply(r)
	n := 0
	rc, err := c.c.SyscallConn()
	if err == nil {
		err = rc.Write(func(fd uintptr) bool {
			n, _ = syscall.Write(int(fd), b)
			return true // never wait for room
		})
	}
	if n = max(n, 0); n == len(b) || err != nil { // sent, or the connection is gone
		c.wmu.Unlock()
		return
	}
	go func() { // the lock passes to it, keeping the rest together
		defer c.wmu.Unlock()
		_, _ = c.c.Write(b[n:])
	}()
}

func isRoomOp(op Op) bool {
	switch op {
	case OpRoomLayout, OpExpect, OpSend, OpPoll, OpAbort:
		return true
	}
	return false
}

// Errors for an API this kvproxy does not serve.
var (
	errNoRoomAPI   = errors.New("this kvproxy serves no room API")
	errNoMemoryAPI = errors.New("this kvproxy serves no engine-memory API")
)

// handle answers req; fd is the memfd that came with a host
// RegisterMemory (-1: none), which handle takes.
func (c *conn) handle(ctx context.Context, req *Request, fd int) *Reply {
	if !isRoomOp(req.Op) {
		return c.handleMemory(ctx, req, fd)
	}
	e := c.s.Rooms
	r := &Reply{Op: req.Op, ID: req.ID}
	if e == nil || c.mem == nil {
		r.Err = errNoRoomAPI.Error()
		return r
	}
	var err error
	switch req.Op {
	case OpRoomLayout:
		if err = e.SetLayout(c.mem, req.Layout); err == nil && c.s.OnLayout != nil {
			c.s.OnLayout(req.Layout)
		}
	case OpExpect:
		if err = e.Expect(req.Room, req.Bootstrap, req.Pages, req.Aux); err == nil {
			c.track(req.Room)
		}
	case OpSend:
		if err = e.Send(req.Room, req.Pages, req.Last, req.Aux); err == nil {
			c.track(req.Room)
		}
	case OpPoll:
		var st rooms.Status
		if req.Wait {
			st, err = e.Wait(ctx, req.Room)
		} else {
			st, err = e.Poll(req.Room)
		}
		r.State, r.Reason = uint8(st.State), st.Reason
		r.Pages, r.Bytes = st.Pages, st.Bytes
		r.TransferNs, r.WallNs = uint64(st.Transfer), uint64(st.Wall)
		if st.State.Terminal() {
			c.untrack(req.Room)
		}
	case OpAbort:
		err = e.Abort(req.Room, req.Reason)
		c.untrack(req.Room) // over (or unknown) either way
	}
	if err != nil {
		r.Err = err.Error()
	}
	return r
}

func (c *conn) handleMemory(ctx context.Context, req *Request, fd int) *Reply {
	if c.mem == nil {
		if fd >= 0 {
			syscall.Close(fd)
		}
		return memReply(req, errNoMemoryAPI)
	}
	r := &Reply{Op: req.Op, ID: req.ID}
	var err error
	switch req.Op {
	case OpHello:
		r.PeerAddr, r.Transport, r.Features = c.s.Memory.PeerAddr(), c.s.Memory.TransportName(), features
	case OpRegisterMemory:
		if req.Kind == wire.MemCUDA {
			err = c.mem.RegisterCUDA(req.Addr, req.Len, req.Handle, req.HandleOffset)
		} else {
			err = c.mem.Register(req.Kind, req.Addr, req.Len, fd)
		}
	case OpUnregisterMemory:
		err = c.mem.Unregister(req.Addr)
	case OpWrite:
		err = c.mem.Write(ctx, req.Peer, req.Triples)
	case OpWritePages:
		err = c.mem.WritePages(ctx, req.Peer, &req.PageWrite)
	case OpProbe:
		err = c.mem.Probe(ctx, req.Peer)
	case OpDirectRoute:
		var timeout time.Duration
		r.Direct, r.Reason, timeout, err = c.mem.DirectRoute(ctx, req.Peer)
		r.WriteTimeoutNs = uint64(timeout)
	}
	if err != nil {
		r.Err = err.Error()
	}
	return r
}

// memReply answers req with err's text (nil: ok).
func memReply(req *Request, err error) *Reply {
	r := &Reply{Op: req.Op, ID: req.ID}
	if err != nil {
		r.Err = err.Error()
	}
	return r
}

func (c *conn) track(room uint64) {
	c.rmu.Lock()
	c.rooms[room] = struct{}{}
	c.rmu.Unlock()
}

func (c *conn) untrack(room uint64) {
	c.rmu.Lock()
	delete(c.rooms, room)
	c.rmu.Unlock()
}

// KindKV and KindAux re-export the region kinds for clients.
const (
	KindKV  = wire.KindKV
	KindAux = wire.KindAux
)
