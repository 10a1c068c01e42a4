package rooms

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer"
)

// String names an event in the transition tests' failures.
func (ev event) String() string {
	if names := [...]string{matched: "matched", moved: "moved", completed: "completed", failed: "failed"}; int(ev) < len(names) {
		return names[ev]
	}
	return fmt.Sprintf("event(%d)", uint8(ev))
}

func TestRoomTransitions(t *testing.T) {
	type move struct {
		from State
		ev   event
	}
	legal := map[move]State{
		{Bootstrapping, matched}:  WaitingForInput,
		{Bootstrapping, failed}:   Failed,
		{WaitingForInput, moved}:  Transferring,
		{WaitingForInput, failed}: Failed,
		{Transferring, moved}:     Transferring,
		{Transferring, completed}: Success,
		{Transferring, failed}:    Failed,
	}
	for _, from := range []State{Failed, Bootstrapping, WaitingForInput, Transferring, Success} {
		for _, ev := range []event{matched, moved, completed, failed} {
			want, ok := legal[move{from, ev}]
			to, got := next(from, ev)
			switch {
			case ok && (!got || to != want):
				t.Errorf("%v --%v-> %v (legal %t), want %v", from, ev, to, got, want)
			case !ok && (got || to != from):
				t.Errorf("%v --%v-> %v accepted; illegal moves must leave the state", from, ev, to)
			}
		}
	}
}

// TestEveryStateReachesAnEnd walks the ladder from Bootstrapping: every
// reachable state can end, and Success is reachable.
func TestEveryStateReachesAnEnd(t *testing.T) {
	seen := map[State]bool{Bootstrapping: true}
	todo := []State{Bootstrapping}
	for len(todo) > 0 {
		s := todo[0]
		todo = todo[1:]
		if s.Terminal() {
			continue
		}
		if to, ok := next(s, failed); !ok || to != Failed {
			t.Errorf("%v cannot fail", s)
		}
		seen[Failed] = true
		for _, ev := range []event{matched, moved, completed} {
			if to, ok := next(s, ev); ok && !seen[to] {
				seen[to] = true
				todo = append(todo, to)
			}
		}
	}
	for _, s := range []State{WaitingForInput, Transferring, Success, Failed} {
		if !seen[s] {
			t.Errorf("%v unreachable from Bootstrapping", s)
		}
	}
}

// TestEveryRoomEnds holds rooms of both roles in every non-terminal state
// and ends each in every way a room can end: each fails on the side it
// happened on with the reason, and no room is left on either engine.
func TestEveryRoomEnds(t *testing.T) {
	const short = 200 * time.Millisecond
	setups := []struct {
		name  string
		state State
		sides []string // which engines hold the room in that state
		start func(t *testing.T, pr *pair, id uint64)
	}{
		{"prefill-sent-first", Bootstrapping, []string{"P"}, func(t *testing.T, pr *pair, id uint64) {
			if err := pr.P.Send(id, []uint32{1}, true, -1); err != nil {
				t.Fatal(err)
			}
		}},
		{"decode-resolving", Bootstrapping, []string{"D"}, func(t *testing.T, pr *pair, id uint64) {
			if err := pr.D.Expect(id, "hold", []uint32{1}, -1); err != nil {
				t.Fatal(err)
			}
		}},
		{"matched", WaitingForInput, []string{"P", "D"}, func(t *testing.T, pr *pair, id uint64) {
			if err := pr.D.Expect(id, "boot:1", []uint32{1, 2}, -1); err != nil {
				t.Fatal(err)
			}
		}},
		{"first-chunk-moved", Transferring, []string{"P", "D"}, func(t *testing.T, pr *pair, id uint64) {
			if err := pr.D.Expect(id, "boot:1", []uint32{1, 2}, -1); err != nil {
				t.Fatal(err)
			}
			eventually(t, "prefill room matched", func() bool { st, _ := pr.P.Poll(id); return st.State == WaitingForInput })
			if err := pr.P.Send(id, []uint32{3}, false, -1); err != nil {
				t.Fatal(err)
			}
			// Its DONE arrived: nothing is in flight any more.
			eventually(t, "decode room transferring", func() bool { st, _ := pr.D.Poll(id); return st.State == Transferring })
		}},
	}
	endings := []struct {
		name    string
		matched bool // needs a peer
		end     func(e *Rooms, id uint64)
		reason  string
	}{
		{"abort", false, func(e *Rooms, id uint64) { _ = e.Abort(id, "client gone") }, "aborted: client gone"},
		{"timeout", false, func(*Rooms, uint64) {}, "timeout"},
		{"peer-lost", true, func(e *Rooms, _ uint64) {
			e.mu.Lock()
			var links []kvtransfer.Link
			for l := range e.links {
				links = append(links, l)
			}
			e.mu.Unlock()
			for _, l := range links {
				l.Close(errors.New("connection cut"))
			}
		}, "peer lost: connection cut"},
		{"rooms-closed", false, func(e *Rooms, _ uint64) { _ = e.Close() }, "kvproxy closing"},
	}
	for _, su := range setups {
		for _, side := range su.sides {
			for _, en := range endings {
				if en.matched && su.state == Bootstrapping {
					continue
				}
				t.Run(su.name+"/"+side+"/"+en.name, func(t *testing.T) {
					const id = 42
					var pr *pair
					pr = newPair(t, "tcp", func(c *Config) {
						if en.name == "timeout" {
							c.BootstrapTimeout, c.WaitingTimeout = short, short
						}
						if resolve := c.Resolve; resolve != nil {
							c.Resolve = func(ctx context.Context, boot string) (string, error) {
								if boot != "hold" {
									return resolve(ctx, boot)
								}
								// Held until the room ends, so that only the
								// ending under test can end it.
								<-ctx.Done()
								_, _ = pr.D.Wait(context.Background(), id)
								return "", errors.New("held")
							}
						}
					})
					su.start(t, pr, id)
					e := pr.P
					if side == "D" {
						e = pr.D
					}
					eventually(t, su.state.String(), func() bool { st, _ := e.Poll(id); return st.State == su.state })
					en.end(e, id)
					st := wait(t, e, id, Failed)
					if !strings.Contains(st.Reason, en.reason) {
						t.Fatalf("reason %q, want %q", st.Reason, en.reason)
					}
					noRooms(t, pr)
				})
			}
		}
	}
}
