//go:build cgo

package ucx

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// The two-process tests re-execute the test binary as the peer: peerEnv
// holds its UCX_TLS and peerMemEnv how it gets its target memory.
const (
	peerEnv    = "UCX_TEST_PEER_TLS"
	peerMemEnv = "UCX_TEST_PEER_MEM" // "alloc" (UCX-allocated) or "map" (mmap + register)
	peerMemLen = 32 << 20
	peerSeed   = 9
)

// Active-message ids of the peer protocol.
const (
	amHello = 1 // peer → test: header = region address (8 bytes LE), data = rkey
	amCheck = 2 // test → peer: header = offset, length (8 bytes LE each)
	amSum   = 3 // peer → test: header = CRC-32 of the asked range
)

// peerConfig is shared by both processes: short keepalive so a dead peer
// over shared memory is noticed within the test's bound.
func peerConfig(tls string) Config {
	return Config{Options: map[string]string{"TLS": tls, "KEEPALIVE_INTERVAL": "200ms"}}
}

// runPeer serves one connection: it sends its region's address and rkey,
// answers checksum requests and exits when stdin closes or the test's
// endpoint goes away.
func runPeer() int {
	if err := servePeer(os.Getenv(peerEnv), os.Getenv(peerMemEnv)); err != nil {
		fmt.Fprintln(os.Stderr, "peer:", err)
		return 1
	}
	return 0
}

func servePeer(tls, memKind string) error {
	ctx, err := NewContext(peerConfig(tls))
	if err != nil {
		return err
	}
	defer ctx.Close()
	var mem *Memory
	if memKind == "map" {
		// The process exits right after, so the mapping is never unmapped.
		b, err := mmapAnon(peerMemLen)
		if err != nil {
			return err
		}
		mem, err = ctx.Map(b)
		if err != nil {
			return err
		}
	} else if mem, err = ctx.Alloc(peerMemLen); err != nil {
		return err
	}
	defer mem.Close()
	fill(mem.Bytes(), peerSeed)
	packed, err := mem.PackRkey()
	if err != nil {
		return err
	}

	var mu sync.Mutex
	var checks [][2]uint64
	var ep *Endpoint
	gone := make(chan struct{}, 1)
	loop, err := NewLoop(ctx, LoopConfig{Poll: func(w *Worker) bool {
		if ep == nil {
			return false
		}
		if ep.Err() != nil {
			select {
			case gone <- struct{}{}:
			default:
			}
			return false
		}
		mu.Lock()
		todo := checks
		checks = nil
		mu.Unlock()
		for _, c := range todo {
			sum := binary.LittleEndian.AppendUint32(nil, crc32.ChecksumIEEE(mem.Bytes()[c[0]:c[0]+c[1]]))
			if req, err := ep.SendAM(amSum, sum, nil); err == nil {
				req.Free()
			}
		}
		return len(todo) > 0
	}})
	if err != nil {
		return err
	}
	defer loop.Close()
	err = loop.Do(func(w *Worker) error {
		if err := w.SetAMHandler(amCheck, func(h, _ []byte) {
			mu.Lock()
			checks = append(checks, [2]uint64{binary.LittleEndian.Uint64(h), binary.LittleEndian.Uint64(h[8:])})
			mu.Unlock()
		}); err != nil {
			return err
		}
		lis, err := w.Listen("127.0.0.1:0")
		if err != nil {
			return err
		}
		defer lis.Close()
		fmt.Printf("ADDR %s\n", lis.Addr())
		e, err := lis.Accept(20 * time.Second)
		if err != nil {
			return err
		}
		req, err := e.SendAM(amHello, binary.LittleEndian.AppendUint64(nil, mem.Addr()), packed)
		if err != nil {
			return err
		}
		req.Free()
		ep = e
		return nil
	})
	if err != nil {
		return err
	}
	stdinClosed := make(chan struct{})
	go func() {
		io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	select {
	case <-stdinClosed:
	case <-gone:
	}
	return nil
}

// peerProc is a running peer as seen from the test.
type peerProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	addr  string
}

func startPeer(t *testing.T, tls, memKind string) *peerProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), peerEnv+"="+tls, peerMemEnv+"="+memKind)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	must(t, err)
	out, err := cmd.StdoutPipe()
	must(t, err)
	must(t, cmd.Start())
	p := &peerProc{cmd: cmd, stdin: stdin}
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Error("peer did not exit after stdin closed")
		}
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ADDR ") {
		t.Fatalf("peer handshake: %q, %v", line, err)
	}
	p.addr = strings.TrimSpace(strings.TrimPrefix(line, "ADDR "))
	return p
}

// peerSession is the test side of a connection to a peer.
type peerSession struct {
	ctx   *Context
	loop  *Loop
	ep    *Endpoint
	rk    *Rkey
	raddr uint64
	sums  chan amMsg
}

func connectPeer(t *testing.T, tls string, peer *peerProc) *peerSession {
	t.Helper()
	s := &peerSession{ctx: func() *Context {
		ctx, err := NewContext(peerConfig(tls))
		must(t, err)
		return ctx
	}(), sums: make(chan amMsg, 8)}
	var err error
	s.loop, err = NewLoop(s.ctx, LoopConfig{})
	must(t, err)
	t.Cleanup(func() {
		s.loop.Close() // may report the dead peer; Live below is what matters
		if err := s.ctx.Close(); err != nil {
			t.Errorf("context close: %v", err)
		}
		if l := LiveObjects(); l != (Live{}) {
			t.Errorf("UCX objects left: %+v", l)
		}
	})
	hello := make(chan amMsg, 1)
	must(t, s.loop.Do(func(w *Worker) (err error) {
		if err := w.SetAMHandler(amHello, amCollector(hello)); err != nil {
			return err
		}
		if err := w.SetAMHandler(amSum, amCollector(s.sums)); err != nil {
			return err
		}
		s.ep, err = w.Connect(peer.addr, 10*time.Second)
		return err
	}))
	h := recvAM(t, hello)
	s.raddr = binary.LittleEndian.Uint64(h.header)
	must(t, s.loop.Do(func(w *Worker) (err error) {
		s.rk, err = s.ep.UnpackRkey(h.data)
		return err
	}))
	return s
}

// flushed runs post then flushes the endpoint, all on the loop.
func (s *peerSession) flushed(timeout time.Duration, post func() (*Request, error)) error {
	return s.loop.Do(func(w *Worker) error {
		req, err := post()
		if err != nil {
			return err
		}
		req.Free()
		f, err := s.ep.Flush()
		if err != nil {
			return err
		}
		if err := f.Wait(timeout); err != nil {
			f.Free()
			return err
		}
		return nil
	})
}

func (s *peerSession) remoteSum(t *testing.T, off, n uint64) uint32 {
	t.Helper()
	h := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, off), n)
	sendAM(t, s.loop, s.ep, amCheck, h, nil)
	return binary.LittleEndian.Uint32(recvAM(t, s.sums).header)
}

func TestTwoProcesses(t *testing.T) {
	for _, tls := range transports {
		t.Run(tls, func(t *testing.T) {
			s := connectPeer(t, tls, startPeer(t, tls, "alloc"))
			src, err := s.ctx.Alloc(8 << 20)
			must(t, err)
			defer src.Close()
			fill(src.Bytes(), 42)

			// One large unaligned put, checked by the peer's checksum.
			const off, n = 5, 4<<20 + 3
			must(t, s.flushed(10*time.Second, func() (*Request, error) {
				return s.ep.Put(src, 1, s.rk, s.raddr+off, n)
			}))
			if got, want := s.remoteSum(t, off, n), crc32.ChecksumIEEE(src.Bytes()[1:1+n]); got != want {
				t.Fatalf("peer checksum %08x after put, want %08x", got, want)
			}

			// A batch of 1000 ops into a fresh range.
			ops := make([]Op, 1000)
			for i := range ops {
				ops[i] = Op{LocalOff: uint64(i * 64), RemoteOff: uint64(8<<20 + i*64), Len: 64}
			}
			must(t, s.flushed(10*time.Second, func() (*Request, error) {
				return s.ep.PutBatch(src, s.rk, s.raddr, ops)
			}))
			if got, want := s.remoteSum(t, 8<<20, 64000), crc32.ChecksumIEEE(src.Bytes()[:64000]); got != want {
				t.Fatalf("peer checksum %08x after batch, want %08x", got, want)
			}

			// Get a range the peer filled itself.
			dst, err := s.ctx.Alloc(1 << 20)
			must(t, err)
			defer dst.Close()
			must(t, s.loop.Do(func(w *Worker) error {
				req, err := s.ep.Get(dst, 0, s.rk, s.raddr+16<<20+11, 1<<20)
				if err != nil {
					return err
				}
				return req.Wait(10 * time.Second)
			}))
			want := make([]byte, 16<<20+11+1<<20)
			fill(want, peerSeed)
			if !bytes.Equal(dst.Bytes(), want[16<<20+11:]) {
				t.Fatal("get from peer returned wrong bytes")
			}
		})
	}
}

// TestPeerKilled kills the peer in the middle of a stream of puts and
// requires an error, not a hang, within a bound.
func TestPeerKilled(t *testing.T) {
	const bound = 10 * time.Second
	for _, tls := range transports {
		for _, mem := range []string{"alloc", "map"} {
			t.Run(tls+"/"+mem, func(t *testing.T) {
				peer := startPeer(t, tls, mem)
				s := connectPeer(t, tls, peer)
				src, err := s.ctx.Alloc(1 << 20)
				must(t, err)
				defer src.Close()
				ops := make([]Op, 16)
				for i := range ops {
					ops[i] = Op{RemoteOff: uint64(i << 20), Len: 1 << 20}
				}
				put := func() (*Request, error) { return s.ep.PutBatch(src, s.rk, s.raddr, ops) }
				for range 3 {
					must(t, s.flushed(bound, put))
				}
				must(t, peer.cmd.Process.Kill())
				killed := time.Now()
				for time.Since(killed) < bound {
					err = s.flushed(time.Second, put)
					if err != nil && err != ErrTimeout {
						break
					}
				}
				if err == nil || err == ErrTimeout {
					t.Fatalf("no error %v after the peer was killed (last: %v)", bound, err)
				}
				t.Logf("error %v after kill: %v", time.Since(killed).Round(time.Millisecond), err)
			})
		}
	}
}
