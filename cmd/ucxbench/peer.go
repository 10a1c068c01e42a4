package main

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"slices"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/pdrouter/pdrouter/cuda"
	"github.com/pdrouter/pdrouter/ucx"
)

// Sizes measured, as in the issue; cudaSizes with -mem cuda.
var (
	sizes     = []int{8, 4 << 10, 64 << 10, 1 << 20, 16 << 20}
	cudaSizes = []int{64 << 10, 1 << 20, 16 << 20, 256 << 20}
)

// maxLen bounds a message: the buffers are this large.
const maxLen = 256 << 20

const (
	// Active-message ids.
	amHello = 1 // address (8 bytes LE) + rkey
	amLat   = 2 // client → server: size, iters, first sequence number
	amQuit  = 3
)

// result is one client measurement, printed as a JSON line.
type result struct {
	Size  int     `json:"size"`
	MiBps float64 `json:"mibps"`
	LatUS float64 `json:"lat_us"` // median half round trip
}

// outstanding bounds puts in flight (also passed to ucx_perftest -O):
// unbounded 16 MiB puts collapse over tcp. GPU copies (cuda_ipc) keep at
// least 4 in flight so the copy engine never idles between puts.
func outstanding(size int, mem string) int {
	if mem == "cuda" {
		return min(64, max(4, 64<<20/size))
	}
	return min(64, max(1, 8<<20/size))
}

func bwIters(tls string, size int, mem string) int {
	if mem == "cuda" {
		return min(20000, max(200, 32<<30/size))
	}
	total := 512 << 20
	if tls != "tcp" {
		total = 4 << 30
	}
	return min(100000, max(20, total/size))
}

func latIters(tls string, size int) int {
	switch {
	case size >= 16<<20:
		return 50
	case size >= 1<<20:
		return 500
	case tls == "tcp":
		return 5000
	}
	return 20000
}

// side is one process's state: worker, target memory and the peer's view.
type side struct {
	mem  string       // "host" or "cuda"
	gpu  *cuda.Device // with mem "cuda"
	bufs []uint64     // device buffers to free
	ctx  *ucx.Context
	w    *ucx.Worker
	ep   *ucx.Endpoint // sockaddr connection: control messages
	dep  *ucx.Endpoint // by worker address: puts (sockaddr eps in UCX 1.13 never use shared memory)
	src  *ucx.Memory   // what we put from
	dst  *ucx.Memory   // what the peer puts into
	rk   *ucx.Rkey
	radr uint64
	msgs [][]byte
}

func newSide(mem string, bufLen int) (*side, error) {
	runtime.LockOSThread()
	s := &side{mem: mem}
	var err error
	if mem == "cuda" {
		// UCX's CUDA transports use this thread's context.
		if s.gpu, err = cuda.Open(0); err != nil {
			return nil, err
		}
		if err := s.gpu.MakeCurrent(); err != nil {
			return nil, err
		}
	}
	if s.ctx, err = ucx.NewContext(ucx.Config{NoPeerErrorHandling: true}); err != nil { // as ucx_perftest without -e
		return nil, err
	}
	if s.w, err = s.ctx.NewWorker(ucx.ThreadSingle); err != nil {
		return nil, err
	}
	if s.src, err = s.buffer(bufLen); err != nil {
		return nil, err
	}
	if s.dst, err = s.buffer(bufLen); err != nil {
		return nil, err
	}
	for _, id := range []uint16{amHello, amLat, amQuit} {
		id := id
		if err := s.w.SetAMHandler(id, func(h, d []byte) {
			s.msgs = append(s.msgs, append([]byte{byte(id)}, append(h, d...)...))
		}); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// buffer returns a registered buffer: UCX-allocated host memory, like
// ucx_perftest's, or device memory from cuMemAlloc (perftest's -m cuda
// uses cudaMalloc).
func (s *side) buffer(n int) (*ucx.Memory, error) {
	if s.gpu == nil {
		return s.ctx.Alloc(n)
	}
	p, err := s.gpu.Alloc(n)
	if err != nil {
		return nil, err
	}
	s.bufs = append(s.bufs, p)
	return s.ctx.MapAddr(uintptr(p), n, ucx.MemoryCUDA)
}

func (s *side) close() {
	s.w.Close()
	s.src.Close()
	s.dst.Close()
	s.ctx.Close()
	for _, p := range s.bufs {
		s.gpu.Free(p)
	}
	if s.gpu != nil {
		s.gpu.Close()
	}
}

// next progresses until an active message arrives.
func (s *side) next() ([]byte, error) {
	deadline := time.Now().Add(30 * time.Second)
	for len(s.msgs) == 0 {
		if !s.w.Progress() && time.Now().After(deadline) {
			return nil, fmt.Errorf("no message from peer within 30s")
		}
		if err := s.ep.Err(); err != nil {
			return nil, err
		}
	}
	m := s.msgs[0]
	s.msgs = s.msgs[1:]
	return m, nil
}

func (s *side) hello() error {
	packed, err := s.dst.PackRkey()
	if err != nil {
		return err
	}
	waddr, err := s.w.Address()
	if err != nil {
		return err
	}
	hdr := binary.LittleEndian.AppendUint64(nil, s.dst.Addr())
	hdr = binary.LittleEndian.AppendUint64(hdr, uint64(len(packed)))
	req, err := s.ep.SendAM(amHello, hdr, append(packed, waddr...))
	if err != nil {
		return err
	}
	if err := req.Wait(10 * time.Second); err != nil {
		return err
	}
	m, err := s.next()
	if err != nil {
		return err
	}
	if m[0] != amHello {
		return fmt.Errorf("expected hello, got message %d", m[0])
	}
	s.radr = binary.LittleEndian.Uint64(m[1:9])
	n := binary.LittleEndian.Uint64(m[9:17])
	if s.dep, err = s.w.ConnectAddress(m[17+n:]); err != nil {
		return err
	}
	s.rk, err = s.dep.UnpackRkey(m[17 : 17+n])
	return err
}

// word is the 8-byte sequence slot at the end of a size-byte message.
func word(m *ucx.Memory, size int) *uint64 {
	return (*uint64)(unsafe.Pointer(&m.Bytes()[size-8]))
}

// put sends the first size bytes of src to the peer's target.
func (s *side) put(size int) error {
	req, err := s.dep.Put(s.src, 0, s.rk, s.radr, uint64(size))
	req.Free() // the echo proves delivery; the source is reused only after it
	return err
}

// waitWord progresses until the peer's put of sequence number seq landed.
func (s *side) waitWord(size int, seq uint64) error {
	p := word(s.dst, size)
	for i := 0; atomic.LoadUint64(p) != seq; i++ {
		s.w.Progress()
		if i%4096 == 0 {
			if err := s.dep.Err(); err != nil {
				return err
			}
		}
	}
	return nil
}

func serve(mem string, bufLen int) error {
	s, err := newSide(mem, bufLen)
	if err != nil {
		return err
	}
	defer s.close()
	lis, err := s.w.Listen("127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Printf("ADDR %s\n", lis.Addr())
	if s.ep, err = lis.Accept(30 * time.Second); err != nil {
		return err
	}
	lis.Close()
	if err := s.hello(); err != nil {
		return err
	}
	for {
		m, err := s.next()
		if err != nil {
			return err
		}
		switch m[0] {
		case amQuit:
			return nil
		case amLat:
			size := int(binary.LittleEndian.Uint64(m[1:]))
			iters := binary.LittleEndian.Uint64(m[9:])
			seq := binary.LittleEndian.Uint64(m[17:])
			for i := range iters {
				if err := s.waitWord(size, seq+i); err != nil {
					return err
				}
				atomic.StoreUint64(word(s.src, size), seq+i)
				if err := s.put(size); err != nil {
					return err
				}
			}
		}
	}
}

// defaultSizes is what a run measures when no size is named.
func defaultSizes(mem string) []int {
	if mem == "cuda" {
		return cudaSizes
	}
	return sizes
}

// bufferLen is the buffers' size for a run of size (0: the default sizes).
func bufferLen(mem string, size int) int {
	if size == 0 {
		return slices.Max(defaultSizes(mem))
	}
	return size
}

func runClient(addr, mem string, only int) error {
	s, err := newSide(mem, bufferLen(mem, only))
	if err != nil {
		return err
	}
	defer s.close()
	if s.ep, err = s.w.Connect(addr, 10*time.Second); err != nil {
		return err
	}
	if err := s.hello(); err != nil {
		return err
	}
	tls := os.Getenv("UCX_TLS")
	enc := json.NewEncoder(os.Stdout)
	seq := uint64(1)
	list := defaultSizes(mem)
	if only != 0 {
		list = []int{only}
	}
	for _, size := range list {
		iters := bwIters(tls, size, mem)
		bw, err := s.bandwidth(size, iters/10) // warm-up
		if err == nil {
			bw, err = s.bandwidth(size, iters)
		}
		if err != nil {
			return fmt.Errorf("bandwidth %d B: %w", size, err)
		}
		var lat float64
		// The latency ping-pong polls the target memory from the CPU: host only.
		if mem == "host" {
			if lat, err = s.latency(size, latIters(tls, size), &seq); err != nil {
				return fmt.Errorf("latency %d B: %w", size, err)
			}
		}
		if err := enc.Encode(result{Size: size, MiBps: bw, LatUS: lat}); err != nil {
			return err
		}
	}
	req, err := s.ep.SendAM(amQuit, nil, nil)
	if err != nil {
		return err
	}
	return req.Wait(5 * time.Second)
}

// bandwidth puts size bytes iters times with a bounded number in flight,
// then flushes, and returns MiB/s.
func (s *side) bandwidth(size, iters int) (float64, error) {
	ring := make([]*ucx.Request, outstanding(size, s.mem))
	start := time.Now()
	for i := range iters {
		slot := &ring[i%len(ring)]
		if err := (*slot).Wait(-1); err != nil {
			return 0, err
		}
		req, err := s.dep.Put(s.src, 0, s.rk, s.radr, uint64(size))
		if err != nil {
			return 0, err
		}
		*slot = req
	}
	for _, r := range ring {
		if err := r.Wait(-1); err != nil {
			return 0, err
		}
	}
	f, err := s.dep.Flush()
	if err == nil {
		err = f.Wait(-1)
	}
	d := time.Since(start)
	return float64(size) * float64(iters) / d.Seconds() / (1 << 20), err
}

// latency ping-pongs size-byte puts and returns the median half round trip
// in µs, as ucx_perftest ucp_put_lat reports it.
func (s *side) latency(size, iters int, seq *uint64) (float64, error) {
	warm := iters / 10
	cmd := binary.LittleEndian.AppendUint64(nil, uint64(size))
	cmd = binary.LittleEndian.AppendUint64(cmd, uint64(warm+iters))
	cmd = binary.LittleEndian.AppendUint64(cmd, *seq)
	req, err := s.ep.SendAM(amLat, cmd, nil)
	if err != nil {
		return 0, err
	}
	if err := req.Wait(5 * time.Second); err != nil {
		return 0, err
	}
	samples := make([]time.Duration, 0, iters)
	for i := range warm + iters {
		start := time.Now()
		atomic.StoreUint64(word(s.src, size), *seq)
		if err := s.put(size); err != nil {
			return 0, err
		}
		if err := s.waitWord(size, *seq); err != nil {
			return 0, err
		}
		if i >= warm {
			samples = append(samples, time.Since(start))
		}
		*seq++
	}
	slices.Sort(samples)
	return float64(samples[len(samples)/2]) / 2 / 1e3, nil
}
