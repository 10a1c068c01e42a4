package sidecar

import (
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer"
)

// newTransport opens a transport this build offers: tcp, shm (engine
// memory copied between kvproxies of one host), and ucx in cgo builds (it
// needs libucp; to a kvproxy of the same host id it copies as shm does).
func newTransport(name, hostID string) (kvtransfer.Transport, error) {
	switch {
	case name == "tcp":
		return &kvtransfer.TCP{}, nil
	case name == "shm":
		return &kvtransfer.SHM{HostID: hostID}, nil
	case name == "ucx" && ucxBuilt:
		tr, err := newUCX(hostID)
		if err != nil {
			return nil, fmt.Errorf("transport ucx: %w", err)
		}
		return tr, nil
	}
	return nil, fmt.Errorf("transport %q not available in this build", name)
}
