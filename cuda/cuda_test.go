//go:build cgo

package cuda

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"unsafe"
)

const childEnv = "PDROUTER_CUDA_TEST_CHILD" // hex IPC handle the child opens

func TestMain(m *testing.M) {
	if h := os.Getenv(childEnv); h != "" {
		if err := child(h); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestLoadMissingLibraryIsNoDriver(t *testing.T) {
	err := loadFrom("libpdrouter-no-such-cuda.so.1")
	if !errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "libpdrouter-no-such-cuda.so.1") {
		t.Fatalf("loadFrom(missing): %v, want ErrNoDriver naming the library", err)
	}
}

func TestLoadLibraryWithoutDriverAPIIsNoDriver(t *testing.T) {
	err := loadFrom("libm.so.6")
	if !errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "has no cuInit") {
		t.Fatalf("loadFrom(libm): %v, want ErrNoDriver: has no cuInit", err)
	}
}

// Without a driver (CI) every entry point reports ErrNoDriver; with one (the
// GPU machine) device memory round-trips and crosses processes by IPC handle.
func TestDevice(t *testing.T) {
	if err := Load(); err != nil {
		if !errors.Is(err, ErrNoDriver) {
			t.Fatalf("Load: %v, want ErrNoDriver", err)
		}
		if _, err := Open(0); !errors.Is(err, ErrNoDriver) {
			t.Fatalf("Open without driver: %v", err)
		}
		if _, _, err := Kind(0x1000); !errors.Is(err, ErrNoDriver) {
			t.Fatalf("Kind without driver: %v", err)
		}
		if _, err := DeviceCount(); !errors.Is(err, ErrNoDriver) {
			t.Fatalf("DeviceCount without driver: %v", err)
		}
		return
	}
	testDevice(t)
}

func testDevice(t *testing.T) {
	d, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	const n = 8<<20 + 3
	ptr, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(ptr)
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i*13 + 1)
	}
	if err := d.CopyFromHost(ptr, want); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, n)
	if err := d.CopyToHost(got, ptr); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("device round trip differs")
	}
	if base, size, err := d.AddressRange(ptr + 4096); err != nil || base != ptr || size < n {
		t.Fatalf("AddressRange(inside) = %#x, %d, %v; want %#x, >= %d", base, size, err, ptr, n)
	}
	if k, o, err := Kind(ptr + 100); err != nil || k != PointerDevice || o != 0 {
		t.Fatalf("Kind(device) = %v, %d, %v", k, o, err)
	}
	if k, _, err := Kind(uint64(uintptr(unsafe.Pointer(&got[0])))); err != nil || k != PointerHost {
		t.Fatalf("Kind(host) = %v, %v", k, err)
	}
	if _, err := d.OpenIPC(Handle{}); err == nil {
		t.Fatal("OpenIPC of a zero handle succeeded")
	}
	testCopier(t, d, ptr, want)
	h, err := d.IPCHandle(ptr)
	if err != nil {
		t.Fatal(err)
	}
	// The child opens our allocation, checks it and overwrites it.
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+hex.EncodeToString(h[:]))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("child: %v: %s", err, out)
	} else {
		t.Logf("child: %s", out)
	}
	if err := d.CopyToHost(got, ptr); err != nil {
		t.Fatal(err)
	}
	for i := range got {
		if got[i] != byte(i*13+1)^0xff {
			t.Fatalf("byte %d after the child's write: %#x", i, got[i])
		}
	}
}

func child(hexHandle string) error {
	var h Handle
	if b, err := hex.DecodeString(hexHandle); err != nil || len(b) != HandleSize {
		return fmt.Errorf("bad handle %q", hexHandle)
	} else {
		copy(h[:], b)
	}
	d, err := Open(0)
	if err != nil {
		return err
	}
	defer d.Close()
	ptr, err := d.OpenIPC(h)
	if err != nil {
		return err
	}
	const n = 8<<20 + 3
	b := make([]byte, n)
	if err := d.CopyToHost(b, ptr); err != nil {
		return err
	}
	for i := range b {
		if b[i] != byte(i*13+1) {
			return fmt.Errorf("imported byte %d = %#x", i, b[i])
		}
		b[i] ^= 0xff
	}
	if err := d.CopyFromHost(ptr, b); err != nil {
		return err
	}
	if base, size, err := d.AddressRange(ptr + 64); err != nil || base != ptr || size < n {
		fmt.Printf("address range of imported memory: %#x %d %v (mapped at %#x)\n", base, size, err, ptr)
	} else {
		fmt.Println("address range of imported memory: ok")
	}
	// Whether an imported mapping can be exported again (UCX's cuda_ipc
	// packs rkeys of registered memory that way): report, do not fail.
	if _, err := d.IPCHandle(ptr); err != nil {
		fmt.Println("re-export of imported memory:", err)
	} else {
		fmt.Println("re-export of imported memory: ok")
	}
	return d.CloseIPC(ptr)
}

// testCopier copies scattered runs of the first half of the buffer into the
// second half in both modes, aligned and not, and checks every byte.
func testCopier(t *testing.T, d *Device, ptr uint64, want []byte) {
	c, err := d.NewCopier()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	half := uint64(len(want) / 2)
	const batched = CopyMode(-1) // Begin, two Adds, Wait
	for _, mode := range []CopyMode{CopyKernel, CopyMemcpy, CopyAuto, batched} {
		for _, shift := range []uint64{0, 3} {
			if err := d.Memset(ptr+half, 0, int(half)); err != nil {
				t.Fatal(err)
			}
			var runs []Run
			for off := uint64(0); off+200<<10 < half; off += 300 << 10 { // 200 KiB runs, 100 KiB gaps
				runs = append(runs, Run{Src: ptr + off + shift, Dst: ptr + half + off, Len: 200<<10 - shift})
			}
			used := mode
			if mode == batched {
				max := 0
				for _, r := range runs {
					max += Pieces(r.Len)
				}
				b, err := c.Begin(max)
				if err != nil {
					t.Fatal(err)
				}
				err = errors.Join(b.Add(runs[:len(runs)/2]), b.Add(runs[len(runs)/2:]), b.Add(runs[:1]), b.Wait())
				// The third Add exceeds what Begin reserved: refused, the rest done.
				if err == nil || !strings.Contains(err.Error(), "more runs than Begin reserved") {
					t.Fatalf("batch: %v", err)
				}
			} else if used, err = c.Copy(runs, mode); err != nil {
				t.Fatalf("%v copy: %v", mode, err)
			}
			got := make([]byte, half)
			if err := d.CopyToHost(got, ptr+half); err != nil {
				t.Fatal(err)
			}
			exp := make([]byte, half)
			for _, r := range runs {
				o := r.Src - ptr
				copy(exp[r.Dst-ptr-half:], want[o:o+r.Len])
			}
			if !bytes.Equal(got, exp) {
				t.Fatalf("%v (used %v) shift %d: copied bytes differ", mode, used, shift)
			}
		}
	}
	// Restore the pattern the IPC part expects.
	if err := d.CopyFromHost(ptr, want); err != nil {
		t.Fatal(err)
	}
}

// The staged path's copies: device runs gathered into pinned host memory and
// scattered back, by per-run copies and by the kernel. Without a driver the
// entry points report ErrNoDriver.
func TestCopyHost(t *testing.T) {
	if err := Load(); err != nil {
		if _, err := CanAccessPeer(0, 1); !errors.Is(err, ErrNoDriver) {
			t.Fatalf("CanAccessPeer without driver: %v", err)
		}
		return
	}
	d, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	cp, err := d.NewCopier()
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Close()
	const n, page = 1 << 20, 4096
	src, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(src)
	dst, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(dst)
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i*13 + 1)
	}
	if err := d.CopyFromHost(src, want); err != nil {
		t.Fatal(err)
	}
	stage, err := d.AllocHost(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.FreeHost(stage)
	base := uint64(uintptr(unsafe.Pointer(&stage[0])))
	for _, mode := range []CopyMode{CopyMemcpy, CopyKernel} {
		clear(stage)
		if err := d.Memset(dst, 0, n); err != nil {
			t.Fatal(err)
		}
		// Every other page into the stage back to back, then back out
		// into the same pages of dst.
		var gather, scatter []Run
		for i := uint64(0); i < n/page/2; i++ {
			gather = append(gather, Run{Src: src + 2*i*page, Dst: base + i*page, Len: page})
			scatter = append(scatter, Run{Src: base + i*page, Dst: dst + 2*i*page, Len: page})
		}
		if _, err := cp.CopyHost(gather, mode); err != nil {
			t.Fatalf("%s gather: %v", mode, err)
		}
		if !bytes.Equal(stage[:page], want[:page]) || !bytes.Equal(stage[page:2*page], want[2*page:3*page]) {
			t.Fatalf("%s gather: wrong bytes in the stage", mode)
		}
		if _, err := cp.CopyHost(scatter, mode); err != nil {
			t.Fatalf("%s scatter: %v", mode, err)
		}
		got := make([]byte, n)
		if err := d.CopyToHost(got, dst); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < n/page; i++ {
			w := want[i*page : (i+1)*page]
			if i%2 == 1 {
				w = make([]byte, page)
			}
			if !bytes.Equal(got[i*page:(i+1)*page], w) {
				t.Fatalf("%s scatter: page %d wrong", mode, i)
			}
		}
	}
	if ok, err := CanAccessPeer(0, 0); !ok || err != nil {
		t.Fatalf("a device reaches itself: %v %v", ok, err)
	}
}
