package e2e

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/control"
	"github.com/pdrouter/pdrouter/testkit/kvtest"
)

// memEngine is an engine owning its memory (a memfd mapping in the test
// process), connected to a kvproxy process.
type memEngine struct {
	cl  *control.Client
	mem []byte
}

// proxyProc is a kvproxy process as its ready line describes it.
type proxyProc struct {
	peer, metrics, control string
}

// startMemProxy runs a kvproxy for engine-owned memory and parses its
// ready line.
func startMemProxy(t *testing.T, role, transport, tls string) (*proxyProc, func(syscall.Signal)) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), role+".sock")
	var env []string
	if tls != "" {
		env = []string{"UCX_TLS=" + tls, "UCX_NET_DEVICES=lo"}
	}
	args := []string{"--role", role, "--transport", transport, "--control", sock, "--host", "127.0.0.1",
		"--metrics-port", "0", "--write-timeout", "2s", "--log-level", "warn"}
	if role == "prefill" {
		args = append(args, "--bootstrap-port", "-1")
	}
	p := start(t, env, "kvproxy ready", "kvproxy", args...)
	fields := map[string]string{}
	for _, kv := range strings.Fields(p.Line)[2:] {
		k, v, _ := strings.Cut(kv, "=")
		fields[k] = v
	}
	pp := &proxyProc{peer: fields["peer"], metrics: "http://" + fields["metrics"] + "/metrics", control: sock}
	return pp, func(sig syscall.Signal) { _ = p.Signal(sig); p.Wait(5 * time.Second) }
}

func newMemEngine(t *testing.T, proxy *proxyProc, size int) *memEngine {
	t.Helper()
	seg := kvtest.EngineMemory(t, size)
	mem, fd := seg.Mem, seg.Fd()
	cl, err := control.Dial(proxy.control)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	if err := cl.RegisterMemory(context.Background(), vaddr(mem), uint64(size), fd); err != nil {
		t.Fatal(err)
	}
	return &memEngine{cl: cl, mem: mem}
}

var vaddr = kvtest.Addr

// TestEngineMemoryAcrossProcesses: two kvproxy processes move an engine's
// memory into another's, SGLang-shaped (per-page triples, merged where
// contiguous), over every transport; killing the decode kvproxy fails the
// next write within the write timeout and killing the prefill kvproxy fails
// its engine's calls at once.
func TestEngineMemoryAcrossProcesses(t *testing.T) {
	const size, item = 32 << 20, 32 << 10
	for _, tc := range []struct{ transport, tls string }{{"tcp", ""}, {"shm", ""}, {"ucx", "tcp"}, {"ucx", "posix,cma,tcp"}} {
		t.Run(tc.transport+"/"+tc.tls, func(t *testing.T) {
			pp, killP := startMemProxy(t, "prefill", tc.transport, tc.tls)
			dp, killD := startMemProxy(t, "decode", tc.transport, tc.tls)
			pe, de := newMemEngine(t, pp, size), newMemEngine(t, dp, 2*size)
			for i := range pe.mem {
				pe.mem[i] = byte(i*7 + i>>12)
			}
			ctx := context.Background()
			peer, _, err := de.cl.Hello(ctx)
			if err != nil || peer != dp.peer {
				t.Fatalf("decode hello: %q %v (ready line peer=%s)", peer, err, dp.peer)
			}
			var ts []control.Triple // every other destination page: 1024 runs
			for i := 0; i < size/item; i++ {
				ts = append(ts, control.Triple{Src: vaddr(pe.mem) + uint64(i*item), Dst: vaddr(de.mem) + uint64(2*i*item), Len: item})
			}
			if err := pe.cl.Write(ctx, peer, ts); err != nil {
				t.Fatal(err)
			}
			t0 := time.Now()
			const rounds = 4
			for range rounds {
				if err := pe.cl.Write(ctx, peer, ts); err != nil {
					t.Fatal(err)
				}
			}
			dt := time.Since(t0) / rounds
			for i := 0; i < size/item; i++ {
				if !bytes.Equal(de.mem[2*i*item:][:item], pe.mem[i*item:][:item]) {
					t.Fatalf("page %d did not land", i)
				}
			}
			t.Logf("%s %s: %d MiB in %d triples: %v a write (%.2f GB/s)", tc.transport, tc.tls, size>>20, len(ts), dt, float64(size)/dt.Seconds()/1e9)
			if n := metric(t, dp.metrics, "kvproxy_registered_regions"); n != 1 {
				t.Fatalf("decode kvproxy_registered_regions %v", n)
			}
			for i := range item { // new bytes, so that a write reported done must have moved them
				pe.mem[i] ^= 0xFF
			}
			killD(syscall.SIGKILL)
			t0 = time.Now()
			for {
				err := pe.cl.Write(ctx, peer, ts[:1])
				if err != nil && time.Since(t0) <= 5*time.Second {
					break
				}
				// shm copies straight into the decode engine's memory, which
				// outlives its kvproxy: a write racing the link's end lands.
				// So does ucx's, which copies as shm to a peer on its host.
				if err != nil || tc.transport == "tcp" || time.Since(t0) > 5*time.Second {
					t.Fatalf("write to a killed decode kvproxy: %v after %v", err, time.Since(t0))
				}
				if !bytes.Equal(de.mem[:item], pe.mem[:item]) {
					t.Fatal("a write reported done before its bytes landed")
				}
				time.Sleep(time.Millisecond)
			}
			killP(syscall.SIGKILL)
			t0 = time.Now()
			if err := pe.cl.Write(ctx, peer, ts[:1]); err == nil || time.Since(t0) > time.Second {
				t.Fatalf("write through a killed prefill kvproxy: %v after %v", err, time.Since(t0))
			}
		})
	}
}
