package router

import (
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// headConnPair is a headConn accepted from a loopback listener, and the
// client's end of it.
func headConnPair(t *testing.T) (*headConn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	c, err := headListener{Listener: ln, firstByteWait: true}.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*headConn), client
}

// readSyscalls is the process's count of read system calls (Linux).
func readSyscalls(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		t.Skip("no /proc/self/io:", err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "syscr: "); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	t.Skip("no syscr in /proc/self/io")
	return 0
}

// A request that arrives whole is read with one system call, fasthttp's
// wait for its first byte included (before: one for that byte, one for
// the rest), and its bytes come back as before: the head in a read of its
// own, then the body.
func TestHeadConnReadsARequestInOneSystemCall(t *testing.T) {
	c, client := headConnPair(t)
	body := `{"text":"hi"}`
	req := "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	fewest := 1 << 30
	for range 5 { // other goroutines' reads count too: the fewest is this one's
		if _, err := client.Write([]byte(req)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // the whole request is in the socket
		own := readSyscalls(t)            // reading the count takes reads of its own
		before := readSyscalls(t)
		own = before - own
		var got []byte
		var reads []int
		first := make([]byte, 1) // fasthttp's first-byte read
		buf := make([]byte, 64<<10)
		for p := first; len(got) < len(req); p = buf {
			n, err := c.Read(p)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, p[:n]...)
			reads = append(reads, len(got))
		}
		fewest = min(fewest, readSyscalls(t)-before-own)
		if string(got) != req {
			t.Fatalf("read %q, want %q", got, req)
		}
		if head := len(req) - len(body); len(reads) < 2 || reads[0] != 1 || reads[1] != head {
			t.Fatalf("reads ended at %v, want 1, then the head's end %d", reads, head)
		}
		c.bodyDone(nil)
	}
	if fewest != 1 {
		t.Fatalf("a request read with %d read system calls, want 1", fewest)
	}
}

// The wait for a request's first byte keeps fasthttp's read deadline and
// ends at the client's close.
func TestHeadConnFirstByteWait(t *testing.T) {
	c, client := headConnPair(t)
	c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the deadline: %v, want %v", err, os.ErrDeadlineExceeded)
	}
	if c.rest != nil {
		t.Fatal("a buffer held after a read that got nothing")
	}
	c.SetReadDeadline(time.Time{})
	client.Close()
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("read after the client closed: %v, want EOF", err)
	}
}
