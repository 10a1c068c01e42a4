package kvtransfer

import (
	"testing"

	"github.com/pdrouter/pdrouter/testkit/kvtest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newTransport(t testing.TB, name string) Transport { return kvtest.Start(t, name, transports) }

// transports lists the transports built in (ucx with cgo, shm in
// memory_test.go).
var transports = map[string]func() (Transport, error){
	"tcp": func() (Transport, error) { return &TCP{}, nil },
}
