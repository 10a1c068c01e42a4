package kvtransfer

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newTransport starts the transport called name; an optional one not
// built in (ucx without cgo) or not usable here skips the test.
func newTransport(t testing.TB, name string) Transport {
	if name == "tcp" {
		return &TCP{}
	}
	f, ok := transports[name]
	if !ok {
		t.Skipf("transport %s not built in", name)
	}
	tr, err := f()
	if err != nil {
		t.Skipf("transport %s: %v", name, err)
	}
	return tr
}

// transports lists the optional transports built in (ucx with cgo).
var transports = map[string]func() (Transport, error){}
