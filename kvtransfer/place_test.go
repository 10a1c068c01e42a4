package kvtransfer

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestChoosePath(t *testing.T) {
	gpu := func(dev int, host string) Place { return Place{Kind: wire.MemCUDA, Device: dev, Host: host} }
	peers := func(a, b int) bool { return a/4 == b/4 } // two NUMA halves of 8 GPUs
	for _, tc := range []struct {
		transport string
		src, dst  Place
		want      Path
		err       string
	}{
		{"tcp", HostPlace("a"), HostPlace("b"), PathTCP, ""},
		{"ucx", HostPlace("a"), HostPlace("a"), PathUCX, ""},
		{"shm", HostPlace("a"), HostPlace("a"), PathSHM, ""},
		{"shm", HostPlace("a"), HostPlace("b"), "", "shm moves memory between engines of one host only"},
		{"rdma", HostPlace("a"), HostPlace("a"), "", "unknown transport"},
		{"tcp", gpu(0, "a"), gpu(0, "a"), PathSameGPU, ""},
		{"shm", gpu(1, "a"), gpu(2, "a"), PathP2P, ""},
		{"tcp", gpu(1, "a"), gpu(5, "a"), PathStagedLocal, ""},
		{"ucx", gpu(1, "a"), gpu(5, "a"), PathStagedLocal, ""},
		{"ucx", gpu(0, "a"), gpu(0, "b"), PathStagedUCX, ""},
		{"ucx", HostPlace("a"), gpu(0, "b"), PathStagedUCX, ""},
		{"tcp", gpu(0, "a"), gpu(0, "b"), PathStagedTCP, ""},
		{"ucx", gpu(0, "a"), HostPlace("b"), PathStagedUCX, ""},
		{"shm", HostPlace("a"), gpu(3, "a"), PathStagedTCP, ""},
		// An unknown host is never the same host.
		{"tcp", gpu(0, ""), gpu(0, ""), PathStagedTCP, ""},
	} {
		got, err := choosePath(tc.transport, tc.src, tc.dst, peers)
		if got != tc.want || (err == nil) != (tc.err == "") || err != nil && !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%s %s→%s: %q %v, want %q %q", tc.transport, tc.src, tc.dst, got, err, tc.want, tc.err)
		}
		var np *NoPathError
		if err != nil && (!errors.As(err, &np) || np.Src != tc.src || np.Dst != tc.dst) {
			t.Errorf("%s %s→%s: error %v does not name the pair", tc.transport, tc.src, tc.dst, err)
		}
	}
	// Without peer access information two devices never go direct.
	if got, _ := choosePath("tcp", gpu(0, "a"), gpu(1, "a"), nil); got != PathStagedLocal {
		t.Errorf("nil access: %q", got)
	}
}

// gpuSide is a memory plane whose GPUs are host memory (hostGPUs).
func gpuSide(t *testing.T, gpus *hostGPUs, transport, host string, timeout time.Duration) *memSide {
	return newMemSide(t, transport, timeout, func(c *MemoryConfig) { c.GPUs, c.HostID = gpus, host })
}

// registerGPU registers a's memory from engine address addr.
func (m *memSide) registerGPU(t testing.TB, addr uint64, a *hostAlloc) {
	t.Helper()
	if err := m.s.RegisterCUDA(addr, uint64(len(a.mem)), a.handle[:], 0); err != nil {
		t.Fatal(err)
	}
}

// The same-host GPU path runs on CPU behind the Device seam: the same
// code that drives the CUDA copier moves the bytes.
func TestGPUWriteSameHostOnStandIn(t *testing.T) {
	gpus := newHostGPUs(t)
	a := gpuSide(t, gpus, "tcp", "h1", 2*time.Second)
	b := gpuSide(t, gpus, "tcp", "h1", 2*time.Second)
	src, dst := gpus.alloc(0, 1<<20), gpus.alloc(0, 1<<20)
	fill(src.mem, 3)
	a.registerGPU(t, 0x10000000, src)
	b.registerGPU(t, 0x20000000, dst)
	ts := []Triple{{Src: 0x10000000, Dst: 0x20000000 + 8192, Len: 4096}, {Src: 0x10000000 + 4096, Dst: 0x20000000, Len: 8192}}
	if err := a.s.Write(context.Background(), b.p.PeerAddr(), ts); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.mem[8192:12288], src.mem[:4096]) || !bytes.Equal(dst.mem[:8192], src.mem[4096:12288]) {
		t.Fatal("bytes did not land")
	}
	if d, _, _ := gpus.open(); d != 2 {
		t.Fatalf("%d devices open, want one per plane", d)
	}
}

// Each link names its path per pair of places, in Paths (kvproxy's
// /status) and in kvproxy_link_path.
func TestLinkPathsNameEachPair(t *testing.T) {
	for _, tc := range []struct {
		name         string
		hostB        string
		noPeer       bool
		devB         int
		want, wantHH Path
	}{
		{"other host", "h2", false, 0, PathStagedTCP, PathTCP},
		{"same gpu", "h1", false, 0, PathSameGPU, PathTCP},
		{"peer access", "h1", false, 1, PathP2P, PathTCP},
		{"no peer access", "h1", true, 1, PathStagedLocal, PathTCP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := newHostGPUs(t)
			gpus.noPeer = tc.noPeer
			a := gpuSide(t, gpus, "tcp", "h1", 2*time.Second)
			b := gpuSide(t, gpus, "tcp", tc.hostB, 2*time.Second)
			src, dst := gpus.alloc(0, 1<<20), gpus.alloc(tc.devB, 1<<20)
			fill(src.mem, 1)
			a.registerGPU(t, 0x10000000, src)
			b.registerGPU(t, 0x20000000, dst)
			if err := a.s.Write(context.Background(), b.p.PeerAddr(), []Triple{{Src: 0x10000000, Dst: 0x20000000, Len: 8192}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst.mem[:8192], src.mem[:8192]) {
				t.Fatal("bytes did not land")
			}
			st := a.p.Paths()
			if len(st.Links) != 1 || st.Links[0].PeerHost != tc.hostB {
				t.Fatalf("links %+v", st.Links)
			}
			got := map[string]Path{}
			for _, pp := range st.Links[0].Paths {
				got[pp.Src+" "+pp.Dst] = pp.Path
			}
			gpuPair := "cuda:0@h1 cuda:" + string(rune('0'+tc.devB)) + "@" + tc.hostB
			if got[gpuPair] != tc.want || got["host@h1 "+gpuPair[10:]] != PathStagedTCP {
				t.Fatalf("paths %v, want %s for %s", got, tc.want, gpuPair)
			}
			mfs, err := a.reg.Gather()
			n := 0
			for _, mf := range mfs {
				if mf.GetName() == "kvproxy_link_path" {
					n = len(mf.GetMetric())
				}
			}
			if err != nil || n != len(st.Links[0].Paths) {
				t.Fatalf("kvproxy_link_path series %d (%v), want %d", n, err, len(st.Links[0].Paths))
			}
		})
	}
}

// One kvproxy per node: two engines on two GPUs register with the same
// plane, and one writes into the other through the plane's own peer
// address, directly with peer access and staged without.
func TestOneKVProxyPerNode(t *testing.T) {
	for _, noPeer := range []bool{false, true} {
		t.Run(map[bool]string{false: "p2p", true: "staged"}[noPeer], func(t *testing.T) {
			gpus := newHostGPUs(t)
			gpus.noPeer = noPeer
			node := gpuSide(t, gpus, "tcp", "h1", 2*time.Second)
			prefill, decode := node.s, node.p.NewSession()
			t.Cleanup(func() { _ = decode.Close() })
			src, dst := gpus.alloc(0, 1<<20), gpus.alloc(1, 1<<20)
			fill(src.mem, 7)
			if err := prefill.RegisterCUDA(0x10000000, 1<<20, src.handle[:], 0); err != nil {
				t.Fatal(err)
			}
			if err := decode.RegisterCUDA(0x20000000, 1<<20, dst.handle[:], 0); err != nil {
				t.Fatal(err)
			}
			if err := prefill.Write(context.Background(), node.p.PeerAddr(), []Triple{{Src: 0x10000000, Dst: 0x20000000, Len: 256 << 10}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst.mem[:256<<10], src.mem[:256<<10]) {
				t.Fatal("bytes did not land")
			}
			if staged := gpus.gathers > 0; staged != noPeer {
				t.Fatalf("staged %t (%d gathers), want %t", staged, gpus.gathers, noPeer)
			}
			// Staged locally: only the writer's device lent staging
			// buffers; none went to a link reader landing DATA frames.
			if _, landed := node.p.gpu.pools[1]; landed {
				t.Fatal("bytes for GPU 1 were staged by a link reader, not copied locally")
			}
			want := map[bool]Path{false: PathP2P, true: PathStagedLocal}[noPeer]
			found := false
			for _, l := range node.p.Paths().Links {
				for _, pp := range l.Paths {
					found = found || pp.Src == "cuda:0@h1" && pp.Dst == "cuda:1@h1" && pp.Path == want
				}
			}
			if !found {
				t.Fatalf("no link names %s for cuda:0 -> cuda:1: %+v", want, node.p.Paths())
			}
		})
	}
}
