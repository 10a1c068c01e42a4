package control

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// openFds counts this process's open descriptors.
func openFds(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(es)
}

// fakeRegistrar answers every request on its socket as a successful
// Register, passing a fresh descriptor each time.
func fakeRegistrar(t *testing.T) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fake.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	memfd, err := unix.MemfdCreate("seg", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		ln.Close()
		<-done
		unix.Close(memfd)
	})
	go func() {
		defer close(done)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		var pending []byte
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			pending = append(pending, buf[:n]...)
			for {
				body, rest, err := splitFrame(pending)
				if err != nil || body == nil {
					break
				}
				req, err := DecodeRequest(body)
				if err != nil {
					return
				}
				pending = append(pending[:0], rest...)
				if _, _, err := c.WriteMsgUnix(EncodeReply(&Reply{Op: OpRegister, ID: req.ID, Transport: "tcp"}), syscall.UnixRights(memfd), nil); err != nil {
					return
				}
			}
		}
	}()
	return sock
}

// A Register whose context ends just as its reply (and the segment's fd)
// arrives leaks no descriptor, whichever way the race goes.
func TestRegisterCancelledLeaksNoFd(t *testing.T) {
	sock := fakeRegistrar(t)
	cl, err := Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	l, _ := layout()
	// Warm up: the first calls start the runtime's own descriptors (epoll).
	if _, fd, err := cl.Register(context.Background(), l); err == nil {
		syscall.Close(fd)
	}
	before := openFds(t)
	for range 5000 {
		ctx, cancel := context.WithCancel(context.Background())
		go cancel()
		if _, fd, err := cl.Register(ctx, l); err == nil {
			syscall.Close(fd)
		}
	}
	// A reply to an abandoned call may still be on its way: one more call
	// behind it, answered in order, means all have been read.
	if _, fd, err := cl.Register(context.Background(), l); err == nil {
		syscall.Close(fd)
	}
	if after := openFds(t); after > before {
		t.Fatalf("%d descriptors leaked by cancelled Registers", after-before)
	}
	cl.Close()
}
