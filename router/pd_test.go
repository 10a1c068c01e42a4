package router

import (
	"testing"
	"time"
)

// A stream's wait for prefill's head ends when the head is in or the grace
// is over, and a pooled timer that fired leaves no tick behind for its
// next user.
func TestWaitClosed(t *testing.T) {
	closed, open := headChannels()
	if !waitClosed(closed, time.Hour) {
		t.Fatal("a closed channel timed out")
	}
	if waitClosed(open, time.Millisecond) {
		t.Fatal("an open channel reported closed")
	}
	start := time.Now()
	if waitClosed(open, 20*time.Millisecond) || time.Since(start) < 20*time.Millisecond {
		t.Fatal("a timer reused after firing ended the wait early")
	}
}

// headChannels are a prefill head that is in and one that is not.
func headChannels() (closed, open chan struct{}) {
	closed, open = make(chan struct{}), make(chan struct{})
	close(closed)
	return closed, open
}
