//go:build cgo

package rooms

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/ucx"
)

func init() {
	transports["ucx"] = func() (kvtransfer.Transport, error) { return kvtransfer.NewUCX() }
}

func TestTransferUCX(t *testing.T) {
	for _, tls := range []string{"tcp", "posix,cma,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			testTransfer(t, "ucx")
		})
	}
	if l := ucx.LiveObjects(); l != (ucx.Live{}) {
		t.Fatalf("kvtransfer.UCX objects leaked: %+v", l)
	}
}

// TestUCXPeerLossKeepsTransport: a decode peer dies in the middle of
// transfers; only its rooms fail, and the prefill's transport (one worker
// for every peer) still moves pages to the other decode. All along, the
// prefill's worker thread gets the signals the Go runtime sends its threads:
// one landing in the idle loop's poll once stopped the worker, after which
// every transfer of that kvproxy failed with "ucx: closed". Every thread of
// the process gets them here, the worker threads among them.
func TestUCXPeerLossKeepsTransport(t *testing.T) {
	for _, tls := range []string{"tcp", "posix,cma,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			resolve := func(context.Context, string) (string, error) { return ln.Addr().String(), nil }
			// A room whose XFER_REQ D1 never got out before dying is
			// unknown to P's link, so only the bootstrap timeout can end
			// it: keep that short.
			cfg := Config{BootstrapTimeout: 3 * time.Second, Resolve: resolve}
			ps := newSide(t, "P", "ucx", ln, 1, cfg)
			d1s := newSide(t, "D1", "ucx", nil, 0, cfg)
			d2s := newSide(t, "D2", "ucx", nil, 0, cfg)
			p, d1, d2 := ps.R, d1s.R, d2s.R
			ptr, ppool, d2pool := ps.T, ps.Mem, d2s.Mem

			stopSignals := make(chan struct{})
			var signals sync.WaitGroup
			signals.Go(func() {
				for {
					select {
					case <-stopSignals:
						return
					case <-time.After(5 * time.Millisecond):
						signalThreads(t, syscall.SIGURG)
					}
				}
			})
			defer func() { close(stopSignals); signals.Wait() }()

			all := make([]uint32, testPages)
			for i := range all {
				all[i] = uint32(i)
			}
			// transfer moves the whole pool into d in 8 chunks.
			transfer := func(d *Rooms, room uint64) error {
				if err := d.Expect(room, "boot:1", all, -1); err != nil {
					return err
				}
				for c := 0; c < 8; c++ {
					if err := p.Send(room, all[c*8:(c+1)*8], c == 7, -1); err != nil {
						return err
					}
				}
				return nil
			}

			// Rooms to D1 keep flowing while D1 dies: its transport first,
			// as a crash would leave it, then its engine.
			var sent []uint64
			for room := uint64(1); ; room++ {
				if room == 4 {
					time.Sleep(200 * time.Millisecond) // the loop sleeps, signalled, between bursts
				}
				if room == 6 {
					if err := d1s.close(); err != nil {
						t.Fatal(err)
					}
				}
				if err := transfer(d1, room); err != nil {
					if !errors.Is(err, kvtransfer.ErrClosed) {
						t.Fatalf("room %d: %v", room, err)
					}
					break
				}
				sent = append(sent, room)
				if room <= 3 {
					wait(t, p, room, Success)
				}
			}
			if len(sent) != 5 {
				t.Fatalf("sent %d rooms to D1, want 5", len(sent))
			}
			for _, room := range sent {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				st, err := p.Wait(ctx, room)
				cancel()
				if err != nil || !st.State.Terminal() {
					t.Fatalf("room %d to the dead peer: %+v %v", room, st, err)
				}
				// Its own endpoint's error is fine; a stopped worker is not.
				if st.State == Failed && strings.Contains(st.Reason, ucx.ErrClosed.Error()) {
					t.Fatalf("room %d to the dead peer failed with %q", room, st.Reason)
				}
			}

			// Idle for a while (the loop sleeps and gets signalled), then
			// the same transport serves D2.
			time.Sleep(300 * time.Millisecond)
			for room := uint64(100); room < 103; room++ {
				clear(d2pool.bufs[0])
				if err := transfer(d2, room); err != nil {
					t.Fatalf("room %d to D2: %v", room, err)
				}
				if st := wait(t, d2, room, Success); st.Pages != testPages {
					t.Fatalf("room %d to D2: %d pages", room, st.Pages)
				}
				wait(t, p, room, Success)
				for b := range 4 {
					if !bytes.Equal(ppool.bufs[b], d2pool.bufs[b]) {
						t.Fatalf("room %d: buffer %d differs on D2", room, b)
					}
				}
			}
			select {
			case <-ptr.Done():
				t.Fatalf("prefill transport stopped: %v", ptr.Err())
			default:
			}
			eventually(t, "rooms freed", func() bool { return p.ActiveRooms() == 0 && d2.ActiveRooms() == 0 })
		})
	}
	if l := ucx.LiveObjects(); l != (ucx.Live{}) {
		t.Fatalf("kvtransfer.UCX objects leaked: %+v", l)
	}
}

// signalThreads sends sig to every thread of this process.
func signalThreads(t *testing.T, sig syscall.Signal) {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Error(err)
		return
	}
	for _, task := range tasks {
		if tid, err := strconv.Atoi(task.Name()); err == nil {
			_ = syscall.Tgkill(syscall.Getpid(), tid, sig)
		}
	}
}
