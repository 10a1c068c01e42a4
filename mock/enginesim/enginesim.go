// Package enginesim is the KV side of the mock engine: a KV pool laid out
// like SGLang's (K of every layer, then V of every layer, one page = page
// size tokens of one buffer, plus an aux buffer) in memory the engine
// allocates and registers with its kvproxy, as SGLang's Mooncake backend
// registers its buffers (a memfd, or GPU memory by IPC handle: memory.go),
// and mockworker's KVTransfer seam implemented as a client of the kvproxy
// control socket's room API.
//
// Prefill fills the prompt's pages with bytes derived from (prompt, room,
// buffer, page) and sends them in chunks; decode allocates pages (waiting in
// a FIFO queue when the pool is full, then 503), expects the room, waits for
// Success and regenerates every page to verify it before any token goes out.
package enginesim

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/pdrouter/pdrouter/kvtransfer/control"
	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// auxItem is one aux slot: room, pages, and a digest of the prompt.
const auxItem = 64

// quarantine keeps a failed room's pages out of the free list for a while:
// after an abort, a chunk already in flight may still land in them.
const quarantine = 5 * time.Second

// Options are the KV pool's layout and behaviour (flags --kvproxy, --kv-*).
type Options struct {
	Control       string        // kvproxy control socket; "" disables KV transfer
	Layers        int           // default 32 (Llama-3.1-8B)
	BuffersPerLay int           // K and V: 2
	BytesPerToken int           // per token per buffer: 2048 (8 KV heads × 128 × bf16)
	PageSize      int           // tokens per page: 16
	PoolTokens    int           // pool capacity in tokens
	ChunkTokens   int           // prefill sends this many tokens per chunk
	AuxSlots      int           // concurrent requests the aux buffer holds
	QueueTimeout  time.Duration // wait this long for free pages, then 503
	Memory        string        // where the KV buffers live: host or cuda:N

	openGPU func(ordinal int) (gpu, error) // nil: the CUDA driver
}

// RegisterFlags adds the --kvproxy and --kv-* flags to fs.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Control, "kvproxy", "", "kvproxy control socket; enables real KV transfer in PD roles")
	fs.IntVar(&o.Layers, "kv-layers", 32, "KV layers")
	fs.IntVar(&o.BuffersPerLay, "kv-buffers-per-layer", 2, "KV buffers per layer (K and V)")
	fs.IntVar(&o.BytesPerToken, "kv-bytes-per-token", 2048, "bytes per token per buffer")
	fs.IntVar(&o.PageSize, "kv-page-size", 16, "tokens per page")
	fs.IntVar(&o.PoolTokens, "kv-pool-tokens", 16384, "KV pool capacity in tokens")
	fs.IntVar(&o.ChunkTokens, "kv-chunk-tokens", 8192, "prefill chunk size in tokens")
	fs.IntVar(&o.AuxSlots, "kv-aux-slots", 1024, "aux slots (concurrent requests)")
	fs.DurationVar(&o.QueueTimeout, "kv-queue-timeout", 30*time.Second, "wait for free KV pages this long, then answer 503")
	fs.StringVar(&o.Memory, "kv-memory", "host", "where the KV buffers live: host (a memfd) or cuda:N (GPU N's memory, registered by IPC handle)")
}

// SplitArgs separates --kvproxy / --kv-* flags (which all take a value)
// from the others, so the mockworker's own parser never sees them.
func SplitArgs(args []string) (kv, rest []string) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		name := strings.TrimLeft(a, "-")
		if !strings.HasPrefix(a, "-") || !(strings.HasPrefix(name, "kv-") || strings.HasPrefix(name, "kvproxy")) {
			rest = append(rest, a)
			continue
		}
		kv = append(kv, a)
		if !strings.Contains(a, "=") && i+1 < len(args) {
			i++
			kv = append(kv, args[i])
		}
	}
	return kv, rest
}

// ErrPoolExhausted is returned when no pages freed up within QueueTimeout.
// It carries HTTPStatus 503 for the mockworker to answer with.
var ErrPoolExhausted error = statusError{http.StatusServiceUnavailable, "KV pool exhausted"}

type statusError struct {
	status int
	msg    string
}

func (e statusError) Error() string   { return e.msg }
func (e statusError) HTTPStatus() int { return e.status }

// Sim implements mockworker.KVTransfer. When its kvproxy restarts, the
// next request connects again and registers the pool anew (see link).
type Sim struct {
	o      Options
	layout control.RoomLayout
	item   int // bytes per page per buffer
	pages  int // pages per buffer
	nbuf   int
	size   int          // bytes of seg: KV buffers (host memory), then aux
	seg    *shm.Segment // the memfd: the pool in host memory, else the aux buffer
	kv     kvBuffers
	aux    []byte
	linkState

	mu      sync.Mutex
	free    []uint32 // free pages
	freeAux []int32
	waiters []*waiter
	wg      sync.WaitGroup
	closing chan struct{}
}

type waiter struct{ ready chan struct{} }

var _ mockworker.KVTransfer = (*Sim)(nil)

// New allocates the pool, connects to the kvproxy and registers the pool
// and its layout there; it fails if the kvproxy is not there.
func New(ctx context.Context, o Options) (*Sim, error) {
	if o.Layers <= 0 || o.BuffersPerLay <= 0 || o.BytesPerToken <= 0 || o.PageSize <= 0 || o.PoolTokens < o.PageSize || o.ChunkTokens < o.PageSize || o.AuxSlots <= 0 {
		return nil, fmt.Errorf("bad KV layout %+v", o)
	}
	if o.BytesPerToken%8 != 0 {
		return nil, fmt.Errorf("--kv-bytes-per-token %d must be a multiple of 8", o.BytesPerToken)
	}
	s := &Sim{o: o, item: o.BytesPerToken * o.PageSize, closing: make(chan struct{})}
	mem, err := parseMemory(o.Memory)
	if err != nil {
		return nil, err
	}
	s.pages = o.PoolTokens / o.PageSize
	s.nbuf = o.Layers * o.BuffersPerLay
	span := s.pages * s.item
	kvHost := 0 // KV bytes in the memfd
	if mem.device < 0 {
		kvHost = s.nbuf * span
	}
	s.size = kvHost + o.AuxSlots*auxItem
	seg, err := shm.Create("kvpool", s.size)
	if err != nil {
		return nil, fmt.Errorf("allocate the KV pool: %w", err)
	}
	s.seg = seg
	base := addrOf(seg.Mem)
	kvBase := base
	if mem.device < 0 {
		h := &hostBuffers{item: s.item}
		for b := 0; b < s.nbuf; b++ {
			h.bufs = append(h.bufs, seg.Mem[b*span:(b+1)*span])
		}
		s.kv = h
	} else {
		open := o.openGPU
		if open == nil {
			open = openCUDA
		}
		dev, err := open(mem.device)
		if err != nil {
			return nil, errors.Join(fmt.Errorf("--kv-memory %s: %w", o.Memory, err), seg.Close())
		}
		d, err := newDeviceBuffers(dev, s.nbuf, span, s.item)
		if err != nil {
			return nil, errors.Join(err, seg.Close())
		}
		s.kv, kvBase = d, d.base
	}
	s.layout = control.RoomLayout{PageSize: uint32(o.PageSize), Dtype: "bf16"}
	for b := 0; b < s.nbuf; b++ {
		s.layout.Bufs = append(s.layout.Bufs, wire.RoomBuf{Kind: wire.KindKV, Addr: kvBase + uint64(b*span), ItemLen: uint32(s.item), Items: uint32(s.pages)})
	}
	s.aux = seg.Mem[kvHost:s.size]
	s.layout.Bufs = append(s.layout.Bufs, wire.RoomBuf{Kind: wire.KindAux, Addr: base + uint64(kvHost), ItemLen: auxItem, Items: uint32(o.AuxSlots)})
	for p := s.pages - 1; p >= 0; p-- {
		s.free = append(s.free, uint32(p))
	}
	for a := o.AuxSlots - 1; a >= 0; a-- {
		s.freeAux = append(s.freeAux, int32(a))
	}
	l, err := s.dial(ctx)
	if err != nil {
		return nil, errors.Join(err, s.kv.close(), seg.Close())
	}
	s.cur, s.links = l, 1
	return s, nil
}

// Close disconnects from the kvproxy (which aborts open rooms and drops
// the pool's registration) and unmaps the pool; requests must have ended.
// Quarantined pages are released first.
func (s *Sim) Close() error {
	close(s.closing)
	s.lmu.Lock()
	l := s.cur
	s.cur, s.linkClosed = nil, true
	idle := l != nil && l.users == 0 // else the last put closes it
	s.lmu.Unlock()
	s.wg.Wait()
	var err error
	if idle {
		err = l.close()
	}
	return errors.Join(err, s.kv.close(), s.seg.Close())
}

// FreePages reports free pages (for tests: every request must give its pages back).
func (s *Sim) FreePages() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.free)
}

// alloc takes n pages and an aux slot, waiting in FIFO order.
func (s *Sim) alloc(ctx context.Context, n int) ([]uint32, int32, error) {
	if n > s.o.PoolTokens/s.o.PageSize {
		return nil, 0, fmt.Errorf("%w: %d pages needed, pool has %d", ErrPoolExhausted, n, s.o.PoolTokens/s.o.PageSize)
	}
	timer := time.NewTimer(s.o.QueueTimeout)
	defer timer.Stop()
	var w *waiter
	s.mu.Lock()
	for {
		head := len(s.waiters) == 0 || s.waiters[0] == w
		if head && len(s.free) >= n && len(s.freeAux) > 0 {
			if w != nil {
				s.waiters = s.waiters[1:]
			}
			pages := append([]uint32(nil), s.free[len(s.free)-n:]...)
			s.free = s.free[:len(s.free)-n]
			aux := s.freeAux[len(s.freeAux)-1]
			s.freeAux = s.freeAux[:len(s.freeAux)-1]
			s.wakeLocked() // the next in line may fit too
			s.mu.Unlock()
			// Freed pages come back in any order; sorted, they merge into runs.
			slices.Sort(pages)
			return pages, aux, nil
		}
		if w == nil {
			w = &waiter{ready: make(chan struct{}, 1)}
			s.waiters = append(s.waiters, w)
		}
		s.mu.Unlock()
		select {
		case <-w.ready:
		case <-timer.C:
			s.dropWaiter(w)
			return nil, 0, fmt.Errorf("%w: no %d free pages within %v", ErrPoolExhausted, n, s.o.QueueTimeout)
		case <-ctx.Done():
			s.dropWaiter(w)
			return nil, 0, ctx.Err()
		}
		s.mu.Lock()
	}
}

func (s *Sim) dropWaiter(w *waiter) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, x := range s.waiters {
		if x == w {
			s.waiters = append(s.waiters[:i], s.waiters[i+1:]...)
			break
		}
	}
	s.wakeLocked()
}

// wakeLocked wakes the head of the queue.
func (s *Sim) wakeLocked() {
	if len(s.waiters) > 0 {
		select {
		case s.waiters[0].ready <- struct{}{}:
		default:
		}
	}
}

func (s *Sim) release(pages []uint32, aux int32, failed bool) {
	put := func() {
		s.mu.Lock()
		s.free = append(s.free, pages...)
		s.freeAux = append(s.freeAux, aux)
		s.wakeLocked()
		s.mu.Unlock()
	}
	if !failed {
		put()
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		t := time.NewTimer(quarantine)
		defer t.Stop()
		select {
		case <-t.C:
		case <-s.closing:
		}
		put()
	}()
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func (s *Sim) pagesFor(tokens int) int { return (tokens + s.o.PageSize - 1) / s.o.PageSize }

func bootstrapAddr(r mockworker.KVRequest) string {
	return net.JoinHostPort(r.BootstrapHost, strconv.Itoa(r.BootstrapPort))
}

func seedOf(r mockworker.KVRequest) uint64 {
	h := fnv.New64a()
	h.Write(r.Prompt)
	return h.Sum64() ^ r.Room*0x9E3779B97F4A7C15
}

// pageSeed makes every (prompt, room, buffer, page) distinct, so a page that
// lands in the wrong place fails the check.
func (s *Sim) pageSeed(seed uint64, b, i int) uint64 {
	return mockworker.Mix(seed ^ uint64(b)<<40 ^ uint64(i))
}

// fill writes pages[i], page first+i of the prompt, of every buffer; check
// compares instead.
func (s *Sim) fill(seed uint64, first int, pages []uint32) error {
	for b := 0; b < s.nbuf; b++ {
		err := s.kv.write(b, pages, func(i int, dst []byte) {
			x := s.pageSeed(seed, b, first+i)
			for k := 0; k < len(dst); k += 8 {
				binary.LittleEndian.PutUint64(dst[k:], x+uint64(k)*0x9E3779B97F4A7C15)
			}
		})
		if err != nil {
			return fmt.Errorf("fill the KV pages: %w", err)
		}
	}
	return nil
}

// check reports the first buffer and page of the prompt that does not
// hold what fill wrote (-1, -1: none).
func (s *Sim) check(seed uint64, pages []uint32) (buf, page int, err error) {
	for b := 0; b < s.nbuf; b++ {
		bad := -1
		ok, err := s.kv.read(b, pages, func(i int, src []byte) bool {
			x := s.pageSeed(seed, b, i)
			for k := 0; k < len(src); k += 8 {
				if binary.LittleEndian.Uint64(src[k:]) != x+uint64(k)*0x9E3779B97F4A7C15 {
					bad = i
					return false
				}
			}
			return true
		})
		if err != nil {
			return 0, 0, fmt.Errorf("read the KV pages: %w", err)
		}
		if !ok {
			return b, bad, nil
		}
	}
	return -1, -1, nil
}

func (s *Sim) auxSlot(a int32) []byte { return s.aux[int(a)*auxItem:][:auxItem] }

func result(l *link, st rooms.Status) *mockworker.KVResult {
	return &mockworker.KVResult{Bytes: int64(st.Bytes), Pages: int64(st.Pages), Transport: l.transport,
		ChecksumOK: true, TransferMS: float64(st.Transfer.Microseconds()) / 1000}
}

// Prefill fills the prompt's pages and sends them chunk by chunk, then waits
// for the transfer to end.
func (s *Sim) Prefill(ctx context.Context, r mockworker.KVRequest) (*mockworker.KVResult, error) {
	n := s.pagesFor(r.PromptTokens)
	pages, aux, err := s.alloc(ctx, n)
	if err != nil {
		return nil, err
	}
	for try := 0; ; try++ {
		l, err := s.acquire()
		if err != nil {
			s.release(pages, aux, false)
			return nil, err
		}
		st, first, err := s.prefill(ctx, l, r, pages, aux)
		// A link that broke on the room's first call (the kvproxy went
		// away before the room existed there) is replaced, once.
		if s.put(l, err) && first && try == 0 && ctx.Err() == nil {
			continue
		}
		s.release(pages, aux, err != nil)
		if err != nil {
			return nil, err
		}
		return result(l, st), nil
	}
}

// prefill fills and sends the room's pages on l; first reports an error
// from the room's first call.
func (s *Sim) prefill(ctx context.Context, l *link, r mockworker.KVRequest, pages []uint32, aux int32) (st rooms.Status, first bool, err error) {
	seed := seedOf(r)
	a := s.auxSlot(aux)
	binary.LittleEndian.PutUint64(a, r.Room)
	binary.LittleEndian.PutUint64(a[8:], uint64(len(pages)))
	binary.LittleEndian.PutUint64(a[16:], seed)
	chunk := s.o.ChunkTokens / s.o.PageSize
	for start := 0; start < len(pages) || start == 0; start += chunk {
		end := min(start+chunk, len(pages))
		if err := s.fill(seed, start, pages[start:end]); err != nil {
			abort(l, r.Room, "fill failed")
			return st, start == 0, err
		}
		if err := l.cl.Send(ctx, r.Room, pages[start:end], end == len(pages), aux); err != nil {
			abort(l, r.Room, "send failed")
			return st, start == 0, fmt.Errorf("kvproxy send: %w", err)
		}
		if end == len(pages) {
			break
		}
	}
	st, err = wait(ctx, l, r.Room)
	return st, false, err
}

// wait waits for the room's end; if ctx ends first (the client went away),
// the room is aborted on both sides.
func wait(ctx context.Context, l *link, room uint64) (rooms.Status, error) {
	st, err := l.cl.Wait(ctx, room)
	if err != nil {
		if ctx.Err() != nil {
			abort(l, room, "client disconnected")
		}
		return st, err
	}
	if st.State != rooms.Success {
		return st, fmt.Errorf("KV transfer %v: %s", st.State, st.Reason)
	}
	return st, nil
}

func abort(l *link, room uint64, reason string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = l.cl.Abort(ctx, room, reason)
}

// expect announces the room on a live link and returns it (to give back
// with put); on failure it releases the pages. A link that broke on this
// first call (the kvproxy went away before the room existed there) is
// replaced, once.
func (s *Sim) expect(ctx context.Context, r mockworker.KVRequest, pages []uint32, aux int32) (*link, error) {
	for try := 0; ; try++ {
		l, err := s.acquire()
		if err != nil {
			s.release(pages, aux, false)
			return nil, err
		}
		clear(s.auxSlot(aux))
		err = l.cl.Expect(ctx, r.Room, bootstrapAddr(r), pages, aux)
		if err == nil {
			return l, nil
		}
		// The client left while Expect was in flight: the room may exist
		// already, and data may land in its pages.
		gone := ctx.Err() != nil
		if gone {
			abort(l, r.Room, "client disconnected")
		}
		if s.put(l, err) && !gone && try == 0 {
			continue
		}
		s.release(pages, aux, gone)
		return nil, fmt.Errorf("kvproxy expect: %w", err)
	}
}

// Decode allocates the prompt's pages, expects the room, waits for it and
// verifies every page before returning.
func (s *Sim) Decode(ctx context.Context, r mockworker.KVRequest) (*mockworker.KVResult, error) {
	n := s.pagesFor(r.PromptTokens)
	pages, aux, err := s.alloc(ctx, n)
	if err != nil {
		return nil, err
	}
	l, err := s.expect(ctx, r, pages, aux)
	if err != nil {
		return nil, err
	}
	st, err := wait(ctx, l, r.Room)
	if err != nil {
		s.put(l, err)
		s.release(pages, aux, true)
		return nil, err
	}
	defer s.put(l, nil)
	defer s.release(pages, aux, false)
	a := s.auxSlot(aux)
	seed := seedOf(r)
	if binary.LittleEndian.Uint64(a) != r.Room || binary.LittleEndian.Uint64(a[8:]) != uint64(n) || binary.LittleEndian.Uint64(a[16:]) != seed {
		return nil, fmt.Errorf("KV checksum mismatch: aux slot does not match room %d", r.Room)
	}
	b, i, err := s.check(seed, pages)
	if err != nil {
		return nil, err
	}
	if b >= 0 {
		return nil, fmt.Errorf("KV checksum mismatch: room %d buffer %d page %d", r.Room, b, i)
	}
	return result(l, st), nil
}
