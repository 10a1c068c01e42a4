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

	"github.com/pdrouter/pdrouter/cuda"
)

// The GPU test moves CUDA memory between two processes with UCX (cuda_ipc):
// each child allocates its buffer with cuMemAlloc and registers it as CUDA
// memory; the source puts into the target, which checks the bytes. (An
// engine's memory that a kvproxy opened by IPC handle cannot be registered
// so: the driver refuses to export an imported mapping again, which UCX's
// cuda_ipc keys need; kvtransfer copies such memory itself.)
const (
	cudaRoleEnv = "UCX_TEST_CUDA_ROLE" // "target" or "source"
	cudaPeerEnv = "UCX_TEST_CUDA_PEER" // source: the target's line
	cudaLen     = 32 << 20
	cudaPage    = 32 << 10
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

// cudaImage is what the target must hold afterwards.
func cudaImage() []byte {
	want := make([]byte, cudaLen)
	fill(want, 5)
	exp := make([]byte, cudaLen)
	for _, o := range cudaOps() {
		copy(exp[o.RemoteOff:o.RemoteOff+o.Len], want[o.LocalOff:o.LocalOff+o.Len])
	}
	return exp
}

func TestCUDAMemoryAcrossProcesses(t *testing.T) {
	if err := cuda.Load(); err != nil {
		// CI has no GPU; the cuda package's tests cover the no-driver path.
		t.Skipf("GPU-only: %v", err)
	}
	target := exec.Command(os.Args[0])
	target.Env = append(os.Environ(), cudaRoleEnv+"=target", "UCX_LOG_LEVEL=error")
	var tout bytes.Buffer
	target.Stderr = &tout
	stdin, err := target.StdinPipe()
	must(t, err)
	out, err := target.StdoutPipe()
	must(t, err)
	must(t, target.Start())
	defer stdin.Close()
	var line string
	r := bufio.NewReader(out)
	for !strings.HasPrefix(line, "TARGET ") { // UCX may log to stdout first
		if line, err = r.ReadString('\n'); err != nil {
			target.Process.Kill()
			target.Wait()
			t.Fatalf("target: %v: %s", err, tout.String())
		}
	}
	source := exec.Command(os.Args[0])
	source.Env = append(os.Environ(), cudaRoleEnv+"=source", cudaPeerEnv+"="+strings.TrimSpace(line))
	b, err := source.CombinedOutput()
	if err != nil {
		target.Process.Kill()
		target.Wait()
		t.Fatalf("source: %v: %s", err, b)
	}
	t.Logf("source: %s", b)
	stdin.Close()
	if err := target.Wait(); err != nil {
		t.Fatalf("target: %v: %s", err, tout.String())
	}
}

func cudaChild(role string) error {
	runtime.LockOSThread()
	d, err := cuda.Open(0)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.MakeCurrent(); err != nil {
		return err
	}
	ptr, err := d.Alloc(cudaLen)
	if err != nil {
		return err
	}
	defer d.Free(ptr)
	img := make([]byte, cudaLen)
	if role == "source" {
		fill(img, 5)
	}
	if err := d.CopyFromHost(ptr, img); err != nil {
		return err
	}
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
		for done := false; !done; {
			select {
			case <-eof:
				done = true
			default:
				w.Progress()
			}
		}
		if err := d.CopyToHost(img, ptr); err != nil {
			return err
		}
		if !bytes.Equal(img, cudaImage()) {
			return fmt.Errorf("target GPU memory differs from the expected image")
		}
		return nil
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
