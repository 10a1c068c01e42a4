package control

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// Server serves one engine's control connections.
type Server struct {
	// Engine serves the pool API (nil: not offered).
	Engine *kvtransfer.Engine
	// Memory serves the engine-memory API (nil: not offered).
	Memory *kvtransfer.MemoryPlane
	Log    *zap.Logger
	// OnRegister runs after the pool is registered (the prefill kvproxy
	// then announces itself on its bootstrap server).
	OnRegister func(*kvtransfer.Pool)
	// MaxConns caps the connections served at once (0: 256); more are
	// closed as they arrive.
	MaxConns int
	// FrameTimeout bounds the read of a frame once its first bytes are in
	// (0: 10 s); an idle connection waits as long as it likes.
	FrameTimeout time.Duration

	mu     sync.Mutex
	seg    *shm.Segment
	layout Layout // seg's, for an engine that comes back
	owner  *conn  // the connection that registered or re-attached seg; nil once it closed
	wg     sync.WaitGroup
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

// Close unmaps the pool segment; call after the engine and its transport
// are closed.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seg == nil {
		return nil
	}
	err := s.seg.Close()
	s.seg = nil
	return err
}

type conn struct {
	s     *Server
	c     *net.UnixConn
	wmu   sync.Mutex
	rooms map[uint64]struct{} // rooms this client opened, aborted if it goes away
	rmu   sync.Mutex
	// mem holds what this client registered, dropped when it goes away;
	// only the read loop sets it.
	mem *kvtransfer.MemorySession
}

func (s *Server) serveConn(ctx context.Context, uc *net.UnixConn) {
	ctx, cancel := context.WithCancel(ctx)
	c := &conn{s: s, c: uc, rooms: map[uint64]struct{}{}}
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
		if c.mem != nil {
			if err := c.mem.Close(); err != nil {
				s.Log.Warn("control: dropping the engine's memory", zap.Error(err))
			}
		}
		// The engine went away: its unfinished rooms would only time out.
		c.rmu.Lock()
		for room := range c.rooms {
			if st, err := s.Engine.Poll(room); err == nil && !st.State.Terminal() {
				_ = s.Engine.Abort(room, "engine disconnected from kvproxy")
			}
		}
		c.rmu.Unlock()
		// Only now may a restarted engine re-attach: its fresh allocations
		// must not share pages with rooms still open.
		s.mu.Lock()
		if s.owner == c {
			s.owner = nil // the pool stays, for the engine to re-attach
		}
		s.mu.Unlock()
	}()
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	defer stop()
	// Reads land in pending's spare room, grown toward the frame being read
	// (see readRoom).
	pending := make([]byte, 0, readChunk)
	oob := make([]byte, syscall.CmsgSpace(4*4))
	frameTimeout := cmp.Or(s.FrameTimeout, defaultFrameTimeout)
	timed := false // a read deadline is armed for the frame in progress
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
			if isMemoryOp(req.Op) && s.Memory != nil && c.mem == nil {
				c.mem = s.Memory.NewSession()
			}
			// Waits and transfers run beside the loop, so one caller's wait
			// does not hold up another's request.
			if (req.Op == OpPoll && req.Wait) || req.Op == OpWrite || req.Op == OpWritePages || req.Op == OpProbe {
				wg.Add(1)
				go func() {
					defer wg.Done()
					c.reply(c.handle(ctx, req, -1))
				}()
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

// reply sends r; a successful Register reply carries the pool's fd.
func (c *conn) reply(r *Reply) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if r.Op == OpRegister && r.Err == "" {
		c.s.mu.Lock()
		rights := syscall.UnixRights(c.s.seg.Fd())
		c.s.mu.Unlock()
		_, _, _ = c.c.WriteMsgUnix(EncodeReply(r), rights, nil)
		return
	}
	_, _ = c.c.Write(EncodeReply(r))
}

func isMemoryOp(op Op) bool {
	return op >= OpHello && op <= OpWritePages
}

// Errors for an API this kvproxy does not serve.
var (
	errNoPoolAPI   = errors.New("this kvproxy serves no pool API (started for engine-owned memory)")
	errNoMemoryAPI = errors.New("this kvproxy serves no engine-memory API")
)

// handle answers req; fd is the memfd that came with a host
// RegisterMemory (-1: none), which handle takes.
func (c *conn) handle(ctx context.Context, req *Request, fd int) *Reply {
	if isMemoryOp(req.Op) {
		return c.handleMemory(ctx, req, fd)
	}
	e := c.s.Engine
	r := &Reply{Op: req.Op, ID: req.ID}
	if e == nil {
		r.Err = errNoPoolAPI.Error()
		return r
	}
	var err error
	switch req.Op {
	case OpRegister:
		r.Transport, err = c.register(req.Layout)
	case OpExpect:
		if err = e.Expect(req.Room, req.Bootstrap, req.Pages, req.Aux); err == nil {
			c.track(req.Room)
		}
	case OpSend:
		if err = e.Send(req.Room, req.Pages, req.Last, req.Aux); err == nil {
			c.track(req.Room)
		}
	case OpPoll:
		var st kvtransfer.Status
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
	r := &Reply{Op: req.Op, ID: req.ID}
	if c.mem == nil {
		if fd >= 0 {
			syscall.Close(fd)
		}
		r.Err = errNoMemoryAPI.Error()
		return r
	}
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
	}
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

// register has the transport allocate the shared segment for layout l and
// registers the pool it holds; the reply passes the segment's fd to the
// engine. The pool lives as long as kvproxy (peers hold its keys): an
// engine that restarts with the same layout gets the same segment back.
func (c *conn) register(l Layout) (string, error) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if c.s.seg != nil {
		switch {
		case c.s.owner != nil:
			return "", errors.New("register: a pool is already registered by a connected engine")
		case !sameLayout(l, c.s.layout):
			return "", errors.New("register: the pool registered earlier has another layout; restart kvproxy to change it")
		}
		c.s.owner = c
		c.s.Log.Info("pool re-attached", zap.Int("bytes", len(c.s.seg.Mem)))
		return c.s.Engine.TransportName(), nil
	}
	var size uint64
	for i, rs := range l.Regions {
		if rs.Len == 0 || rs.Offset+rs.Len < rs.Offset || rs.Offset+rs.Len > maxPool {
			return "", fmt.Errorf("register: region %d [%d,+%d) is empty or too large", i, rs.Offset, rs.Len)
		}
		size = max(size, rs.Offset+rs.Len)
	}
	seg, err := c.s.Engine.AllocPool(int(size))
	if err != nil {
		return "", fmt.Errorf("register: allocate %d bytes: %w", size, err)
	}
	p := &kvtransfer.Pool{PageSize: l.PageSize, Dtype: l.Dtype}
	for _, rs := range l.Regions {
		p.Regions = append(p.Regions, kvtransfer.Region{Kind: rs.Kind, ItemLen: rs.ItemLen, Mem: seg.Mem[rs.Offset : rs.Offset+rs.Len : rs.Offset+rs.Len]})
	}
	if err := c.s.Engine.RegisterPool(p); err != nil {
		seg.Close()
		return "", err
	}
	c.s.seg, c.s.layout, c.s.owner = seg, Layout{PageSize: l.PageSize, Dtype: l.Dtype, Regions: slices.Clone(l.Regions)}, c
	if c.s.OnRegister != nil {
		c.s.OnRegister(p)
	}
	c.s.Log.Info("pool registered", zap.Int("bytes", len(seg.Mem)), zap.Int("regions", len(p.Regions)), zap.Int("pages", p.Pages()))
	return c.s.Engine.TransportName(), nil
}

func sameLayout(a, b Layout) bool {
	return a.PageSize == b.PageSize && a.Dtype == b.Dtype && slices.Equal(a.Regions, b.Regions)
}

// maxPool bounds a pool's size (1 TiB), so a bad layout cannot overflow.
const maxPool = 1 << 40

// KindKV and KindAux re-export the region kinds for clients.
const (
	KindKV  = wire.KindKV
	KindAux = wire.KindAux
)
