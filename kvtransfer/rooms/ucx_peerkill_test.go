//go:build cgo

package rooms

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/ucx"
)

// roomChildEnv carries the prefill's (relayed) address to the decode child.
const roomChildEnv = "KVTRANSFER_ROOM_CHILD_BOOT"

// TestUCXRoomPeerKilled: the decode kvproxy is killed (SIGKILL, its own
// process) while a room's chunk is in flight to it. Its peer link stays up
// for a while, as behind a NAT or a half-open connection, so the write is
// posted to a dead worker; with error handling mode NONE (posix in UCX_TLS)
// nothing ever fails its flush. Once the link times out the room must fail,
// and the write must not leave its flush for the loop to poll forever.
func TestUCXRoomPeerKilled(t *testing.T) {
	for _, tls := range []string{"tcp", "posix,cma,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			// Registered first, so it runs after every other cleanup.
			t.Cleanup(func(ignore goleak.Option) func() {
				return func() { goleak.VerifyNone(t, ignore) }
			}(goleak.IgnoreCurrent()))
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ps := newSide(t, "P", "ucx", ln, 1, Config{Heartbeat: 250 * time.Millisecond})
			p, tr := ps.R, ps.T
			relay := newHalfOpenRelay(t, ln.Addr().String())
			child := startRoomChild(t, relay.addr())

			all := make([]uint32, testPages)
			for i := range all {
				all[i] = uint32(i)
			}
			// transfer has the child expect room, waits for its XFER_REQ,
			// then runs beforeSend and sends the whole pool in 8 chunks.
			transfer := func(room uint64, beforeSend func()) error {
				child.expect(t, room)
				eventually(t, "XFER_REQ of the child", func() bool {
					st, err := p.Poll(room)
					return err == nil && st.State == WaitingForInput
				})
				beforeSend()
				for c := 0; c < 8; c++ {
					if err := p.Send(room, all[c*8:(c+1)*8], c == 7, -1); err != nil {
						return fmt.Errorf("room %d chunk %d: %w", room, c, err)
					}
				}
				return nil
			}
			if err := transfer(1, func() {}); err != nil {
				t.Fatal(err)
			}
			wait(t, p, 1, Success) // the endpoint is wired up

			// A chunk that fails fast (mode PEER) ends the room before the
			// later ones are sent.
			if err := transfer(2, child.kill); err != nil && !errors.Is(err, ErrRoomDone) {
				t.Fatal(err)
			}
			t0 := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			st, err := p.Wait(ctx, 2)
			cancel()
			if err != nil || st.State != Failed {
				t.Fatalf("room to the killed peer: %+v %v after %v", st, err, time.Since(t0))
			}
			eventually(t, "rooms freed", func() bool { return p.ActiveRooms() == 0 && p.Peers() == 0 })
			// The transport lives on; nothing of the dead peer may remain
			// in it, the write's flush included.
			left := ucx.LiveObjects()
			for end := time.Now().Add(5 * time.Second); (left.Requests != 0 || left.Endpoints != 0) && time.Now().Before(end); left = ucx.LiveObjects() {
				time.Sleep(5 * time.Millisecond)
			}
			if left.Requests != 0 || left.Endpoints != 0 {
				t.Fatalf("the dead peer's endpoint or flush outlived its link: %+v", left)
			}
			select {
			case <-tr.Done():
				t.Fatalf("transport stopped: %v", tr.Err())
			default:
			}
			if err := ps.close(); err != nil {
				t.Fatal(err)
			}
			if l := ucx.LiveObjects(); l != (ucx.Live{}) {
				t.Fatalf("kvtransfer.UCX objects leaked: %+v", l)
			}
		})
	}
}

// TestUCXRoomChild is the decode kvproxy of TestUCXRoomPeerKilled, run in
// its own process: it expects the rooms named on stdin, answering each
// line once Expect returned.
func TestUCXRoomChild(t *testing.T) {
	boot := os.Getenv(roomChildEnv)
	if boot == "" {
		t.Skip("runs as TestUCXRoomPeerKilled's child")
	}
	ds := newSide(t, "D", "ucx", nil, 0, Config{Heartbeat: 250 * time.Millisecond,
		Resolve: func(context.Context, string) (string, error) { return boot, nil }})
	d := ds.R
	all := make([]uint32, testPages)
	for i := range all {
		all[i] = uint32(i)
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		room, err := strconv.ParseUint(in.Text(), 10, 64)
		if err == nil {
			err = d.Expect(room, "boot:1", all, -1)
		}
		fmt.Println("expected", room, err)
	}
	_ = ds.close()
}

type roomChild struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	dead bool
}

func startRoomChild(t *testing.T, boot string) *roomChild {
	cmd := exec.Command(os.Args[0], "-test.run=^TestUCXRoomChild$", "-test.v")
	cmd.Env = append(os.Environ(), roomChildEnv+"="+boot)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &roomChild{cmd: cmd, in: in, out: bufio.NewScanner(out)}
	t.Cleanup(c.kill)
	return c
}

// expect has the child Expect room and waits for its answer.
func (c *roomChild) expect(t *testing.T, room uint64) {
	t.Helper()
	if _, err := fmt.Fprintln(c.in, room); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("expected %d <nil>", room)
	for c.out.Scan() {
		if line := c.out.Text(); line == want {
			return
		} else if len(line) > 8 && line[:8] == "expected" {
			t.Fatalf("child: %s", line)
		}
	}
	t.Fatalf("child exited before expecting room %d: %v", room, c.out.Err())
}

// kill kills the child and reaps it, as a crash would end it.
func (c *roomChild) kill() {
	if c.dead {
		return
	}
	c.dead = true
	_ = c.cmd.Process.Kill()
	_ = c.cmd.Wait()
}

// halfOpenRelay forwards connections to target and, when the client side
// dies, keeps the target side open (draining it) until the target closes:
// the target learns of the loss only from its own timeouts.
type halfOpenRelay struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

func newHalfOpenRelay(t *testing.T, target string) *halfOpenRelay {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &halfOpenRelay{ln: ln}
	r.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			r.mu.Lock()
			r.conns = append(r.conns, c, s)
			r.mu.Unlock()
			r.wg.Go(func() { _, _ = io.Copy(s, c) }) // s stays open on EOF
			r.wg.Go(func() {
				_, _ = io.Copy(c, s)
				_, _ = io.Copy(io.Discard, s)
			})
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		r.mu.Lock()
		for _, c := range r.conns {
			_ = c.Close()
		}
		r.mu.Unlock()
		r.wg.Wait()
	})
	return r
}

func (r *halfOpenRelay) addr() string { return r.ln.Addr().String() }
