//go:build cgo

package ucx

import (
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// closeChildEnv makes the test binary run the wireup-close rounds itself:
// before the fix UCX 1.13 aborted the process, which only a parent sees as
// a failure.
const closeChildEnv = "PDROUTER_TEST_UCX_CLOSE_CHILD" // not UCX_*: UCX warns of unknown ones

// wireupRounds is how many times the child closes a worker with a reply
// pending; the steps are ordered, so each round is a hit, not a chance.
const wireupRounds = 3

// TestCloseWhilePeerWireupPending: a peer connects by worker address and
// this worker closes while the wireup reply to it is still queued. UCX 1.13
// (before openucx/ucx#8175) aborted in ucp_worker_destroy: the reply sat in
// the tcp endpoint's pending queue, waiting for the peer to acknowledge the
// transport connection, and purging it there failed an assertion ("got REP
// message"). Seen as kvproxy aborting on SIGTERM right after a peer
// connected.
func TestCloseWhilePeerWireupPending(t *testing.T) {
	if os.Getenv(closeChildEnv) != "" {
		for i := range wireupRounds {
			t.Run(strconv.Itoa(i), closeWithReplyPending)
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCloseWhilePeerWireupPending$", "-test.v")
	cmd.Env = append(os.Environ(), closeChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out[:min(len(out), 4096)]) // UCX's message, not every goroutine
	}
}

// closeWithReplyPending orders the wireup by pausing one loop at a time:
// each side can then take only its next step.
func closeWithReplyPending(t *testing.T) {
	ctxA, ctxB := loopbackContext(t), loopbackContext(t)
	a, err := NewLoop(ctxA, LoopConfig{})
	must(t, err)
	b, err := NewLoop(ctxB, LoopConfig{})
	must(t, err)
	var addr []byte
	must(t, a.Do(func(w *Worker) (err error) { addr, err = w.Address(); return err }))
	mem, err := ctxA.Alloc(4096)
	must(t, err)
	packed, err := mem.PackRkey()
	must(t, err)
	const step = 50 * time.Millisecond // ample for one side's step on loopback

	resumeA := pause(t, a)
	var ep *Endpoint
	// B connects to A's tcp interface (the kernel accepts it). Unpacking A's
	// key, as kvtransfer does, makes B ask A for its endpoint id (RMA over
	// tcp is emulated with active messages): the wireup request waits until
	// A acknowledges the connection.
	must(t, b.Do(func(w *Worker) (err error) {
		if ep, err = w.ConnectAddress(addr); err != nil {
			return err
		}
		_, err = ep.UnpackRkey(packed)
		return err
	}))
	resumeB := pause(t, b)
	resumeA() // A acknowledges B's connection
	time.Sleep(step)
	resumeA = pause(t, a)
	resumeB() // B sends its wireup request
	time.Sleep(step)
	resumeB = pause(t, b)
	// A creates its endpoint to B and queues the reply until B acknowledges
	// A's own connection, which B, paused, does not yet.
	resumeA()
	time.Sleep(step)
	// B comes back after A began closing: a close that waits for the reply
	// to go out finishes; one that destroys the worker at once aborts.
	go func() { time.Sleep(closeQuiet / 4); resumeB() }()
	start := time.Now()
	must(t, a.Close())
	t.Logf("close took %v", time.Since(start))

	must(t, b.Do(func(*Worker) error { return ep.Close() }))
	must(t, b.Close())
	must(t, mem.Close())
	must(t, ctxA.Close())
	must(t, ctxB.Close())
	if l := LiveObjects(); l != (Live{}) {
		t.Fatalf("UCX objects left: %+v", l)
	}
}

func loopbackContext(t *testing.T) *Context {
	t.Helper()
	ctx, err := NewContext(Config{Options: map[string]string{"TLS": "tcp", "NET_DEVICES": "lo"}})
	must(t, err)
	return ctx
}

// pause parks l's goroutine in a closure, so its worker makes no progress
// until the returned function is called.
func pause(t *testing.T, l *Loop) (resume func()) {
	t.Helper()
	parked, release := make(chan struct{}), make(chan struct{})
	must(t, l.Submit(func(*Worker) { close(parked); <-release }))
	<-parked
	return func() { close(release) }
}
