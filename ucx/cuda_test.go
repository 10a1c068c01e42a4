//go:build cgo

package ucx

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/internal/cuda"
)

// The GPU test plays kvproxy's part: two processes (the "kvproxies") open
// GPU allocations of a third (the "engine", the test itself) by CUDA IPC
// handle, register them with UCX as CUDA memory and move bytes between
// them with puts. cudaRoleEnv names the child's role.
const (
	cudaRoleEnv   = "UCX_TEST_CUDA_ROLE" // "target" or "source"
	cudaHandleEnv = "UCX_TEST_CUDA_HANDLE"
	cudaPeerEnv   = "UCX_TEST_CUDA_PEER" // source: the target's line
	cudaLen       = 32 << 20
	cudaPage      = 32 << 10
)

func init() {
	switch os.Getenv(cudaRoleEnv) {
	case "target", "source":
		if err := cudaChild(os.Getenv(cudaRoleEnv)); err != nil {
			fmt.Fprintln(os.Stderr, "cuda child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
}

// cudaOps is what the source puts: the first half contiguous in one op,
// then every other page of the second half.
func cudaOps() []Op {
	ops := []Op{{0, 0, cudaLen / 2}}
	for off := uint64(cudaLen / 2); off < cudaLen; off += 2 * cudaPage {
		ops = append(ops, Op{off, off, cudaPage})
	}
	return ops
}

func TestCUDAMemoryAcrossProcesses(t *testing.T) {
	if err := cuda.Load(); err != nil {
		// CI has no GPU; the cuda package's tests cover the no-driver path.
		t.Skipf("GPU-only: %v", err)
	}
	d, err := cuda.Open(0)
	must(t, err)
	defer d.Close()
	src, err := d.Alloc(cudaLen)
	must(t, err)
	defer d.Free(src)
	dst, err := d.Alloc(cudaLen)
	must(t, err)
	defer d.Free(dst)
	want := make([]byte, cudaLen)
	fill(want, 5)
	must(t, d.CopyFromHost(src, want))
	must(t, d.Memset(dst, 0, cudaLen))
	hs, err := d.IPCHandle(src)
	must(t, err)
	hd, err := d.IPCHandle(dst)
	must(t, err)

	target := exec.Command(os.Args[0])
	target.Env = append(os.Environ(), cudaRoleEnv+"=target", cudaHandleEnv+"="+hex.EncodeToString(hd[:]))
	target.Stderr = os.Stderr
	stdin, err := target.StdinPipe()
	must(t, err)
	out, err := target.StdoutPipe()
	must(t, err)
	must(t, target.Start())
	defer target.Wait()
	defer stdin.Close()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "TARGET ") {
		target.Process.Kill()
		t.Fatalf("target said %q: %v", line, err)
	}
	source := exec.Command(os.Args[0])
	source.Env = append(os.Environ(), cudaRoleEnv+"=source", cudaHandleEnv+"="+hex.EncodeToString(hs[:]),
		cudaPeerEnv+"="+strings.TrimSpace(line))
	b, err := source.CombinedOutput()
	if err != nil {
		t.Fatalf("source: %v: %s", err, b)
	}
	t.Logf("source: %s", b)
	stdin.Close()
	must(t, target.Wait())

	got := make([]byte, cudaLen)
	must(t, d.CopyToHost(got, dst))
	exp := make([]byte, cudaLen)
	for _, o := range cudaOps() {
		copy(exp[o.RemoteOff:o.RemoteOff+o.Len], want[o.LocalOff:o.LocalOff+o.Len])
	}
	if !bytes.Equal(got, exp) {
		i := 0
		for i < len(got) && got[i] == exp[i] {
			i++
		}
		t.Fatalf("target memory differs from the expected image at byte %d", i)
	}
}

func cudaChild(role string) error {
	runtime.LockOSThread()
	var h cuda.Handle
	if b, err := hex.DecodeString(os.Getenv(cudaHandleEnv)); err != nil || len(b) != cuda.HandleSize {
		return fmt.Errorf("bad handle")
	} else {
		copy(h[:], b)
	}
	d, err := cuda.Open(0)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.MakeCurrent(); err != nil {
		return err
	}
	ptr, err := d.OpenIPC(h)
	if err != nil {
		return err
	}
	defer d.CloseIPC(ptr)
	ctx, err := NewContext(Config{})
	if err != nil {
		return err
	}
	defer ctx.Close()
	mem, err := ctx.MapAddr(uintptr(ptr), cudaLen, MemoryCUDA)
	if err != nil {
		return err
	}
	defer mem.Close()
	w, err := ctx.NewWorker(ThreadSingle)
	if err != nil {
		return err
	}
	defer w.Close()
	if role == "target" {
		rkey, err := mem.PackRkey()
		if err != nil {
			return err
		}
		addr, err := w.Address()
		if err != nil {
			return err
		}
		fmt.Printf("TARGET %x %x %x\n", mem.Addr(), rkey, addr)
		eof := make(chan struct{})
		go func() { io.Copy(io.Discard, os.Stdin); close(eof) }()
		for {
			select {
			case <-eof:
				return nil
			default:
				w.Progress()
			}
		}
	}
	f := strings.Fields(os.Getenv(cudaPeerEnv))
	if len(f) != 4 {
		return fmt.Errorf("bad peer line %q", os.Getenv(cudaPeerEnv))
	}
	raddr, err := strconv.ParseUint(f[1], 16, 64)
	if err != nil {
		return err
	}
	rkey, err1 := hex.DecodeString(f[2])
	waddr, err2 := hex.DecodeString(f[3])
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	ep, err := w.ConnectAddress(waddr)
	if err != nil {
		return err
	}
	defer ep.Close()
	rk, err := ep.UnpackRkey(rkey)
	if err != nil {
		return err
	}
	defer rk.Close()
	start := time.Now()
	req, err := ep.PutBatch(mem, rk, raddr, cudaOps())
	if err != nil {
		return err
	}
	req.Free()
	fl, err := ep.Flush()
	if err != nil {
		return err
	}
	if err := fl.Wait(20 * time.Second); err != nil {
		return err
	}
	info, _ := ep.Info()
	fmt.Printf("put %d ops in %v\n%s\n", len(cudaOps()), time.Since(start), info)
	return nil
}
