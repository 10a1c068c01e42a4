//go:build cgo

package kvtransfer

import (
	"testing"

	"github.com/pdrouter/pdrouter/ucx"
)

func init() {
	transports["ucx"] = func() (Transport, error) { return NewUCX() }
}

func TestTransferUCX(t *testing.T) {
	for _, tls := range []string{"tcp", "posix,cma,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			testTransfer(t, "ucx")
		})
	}
	if l := ucx.LiveObjects(); l != (ucx.Live{}) {
		t.Fatalf("UCX objects leaked: %+v", l)
	}
}
