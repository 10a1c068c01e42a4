//go:build cgo

package kvtransfer

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// UCXLocalSHM is kvproxy's ucx transport: UCX to peers on other hosts,
// shm's single memcpy to peers with the same host id. UCX 1.13 cannot
// register memory it did not allocate for its shared-memory transports
// (samehost.go), so between two kvproxies of one host an engine's memfd
// went by DATA frames on the link (ZeroCopyRMA is false without rc or dc):
// 2.2 s for a 4096-token room where shm takes 0.07 (bench/RESULTS.md).
// Each registration is made with both transports and its key carries both
// (shm's first, at its fixed length); the worker address carries the host
// id, so each side picks per peer, and the link's path says which.
type UCXLocalSHM struct {
	*UCX
	shm *SHM
}

var _ Transport = (*UCXLocalSHM)(nil)

// NewUCXLocalSHM starts UCX (see NewUCX); hostID names this machine to
// peers (empty: the boot id).
func NewUCXLocalSHM(hostID string) (*UCXLocalSHM, error) {
	u, err := NewUCX()
	if err != nil {
		return nil, err
	}
	return &UCXLocalSHM{UCX: u, shm: &SHM{HostID: hostID}}, nil
}

// localRegistration is a mapping registered with both transports.
type localRegistration struct {
	shm, ucx MemoryRegistration
	key      []byte
}

func (r *localRegistration) RKey() []byte { return r.key }

func (r *localRegistration) Close() error { return errors.Join(r.shm.Close(), r.ucx.Close()) }

func (t *UCXLocalSHM) RegisterMemory(b []byte, fd int) (MemoryRegistration, error) {
	if fd < 0 {
		// kvproxy's own staging rings have no memfd; only peers on other
		// hosts put into them, by UCX: a blank shm half keeps the key's form.
		u, err := t.UCX.RegisterMemory(b, fd)
		if err != nil {
			return nil, err
		}
		return &localRegistration{shm: tcpRegistration{}, ucx: u, key: append(make([]byte, shmKeyLen), u.RKey()...)}, nil
	}
	s, err := t.shm.RegisterMemory(b, fd)
	if err != nil {
		return nil, err
	}
	u, err := t.UCX.RegisterMemory(b, fd)
	if err != nil {
		return nil, errors.Join(err, s.Close())
	}
	return &localRegistration{shm: s, ucx: u, key: append(slices.Clip(s.RKey()), u.RKey()...)}, nil
}

// WorkerAddress is the host id's length, the host id, then UCX's address.
func (t *UCXLocalSHM) WorkerAddress() ([]byte, error) {
	host, err := t.shm.WorkerAddress()
	if err != nil {
		return nil, err
	}
	if len(host) == 0 || len(host) > 255 {
		return nil, fmt.Errorf("ucx: host id of %d bytes", len(host))
	}
	ua, err := t.UCX.WorkerAddress()
	if err != nil {
		return nil, err
	}
	return append(append([]byte{byte(len(host))}, host...), ua...), nil
}

// splitAddr parses a peer's WorkerAddress.
func splitAddr(addr []byte) (host string, ucxAddr []byte, err error) {
	if len(addr) == 0 || len(addr) < 1+int(addr[0]) {
		return "", nil, fmt.Errorf("ucx: peer worker address of %d bytes", len(addr))
	}
	return string(addr[1 : 1+addr[0]]), addr[1+addr[0]:], nil
}

// PeerHost is the host id a peer's worker address names.
func (t *UCXLocalSHM) PeerHost(addr []byte) string {
	host, _, _ := splitAddr(addr)
	return host
}

// sameHost reports whether the peer behind addr shares our host id.
func (t *UCXLocalSHM) sameHost(addr []byte) bool {
	ours, err := t.shm.WorkerAddress()
	return err == nil && t.PeerHost(addr) == string(ours)
}

// PeerPath is how host memory moves to the peer behind addr: shm on one
// host, else the plane's choice ("").
func (t *UCXLocalSHM) PeerPath(addr []byte) Path {
	if t.sameHost(addr) {
		return PathSHM
	}
	return ""
}

func (t *UCXLocalSHM) MemoryEndpoint(addr []byte) (MemoryEndpoint, error) {
	host, ua, err := splitAddr(addr)
	if err != nil {
		return nil, err
	}
	var ep MemoryEndpoint
	shm := t.sameHost(addr)
	if shm {
		ep, err = t.shm.MemoryEndpoint([]byte(host))
	} else {
		ep, err = t.UCX.MemoryEndpoint(ua)
	}
	if err != nil {
		return nil, err
	}
	return localEndpoint{MemoryEndpoint: ep, shm: shm}, nil
}

// localEndpoint is one transport's endpoint, given that transport's half
// of each key and registration.
type localEndpoint struct {
	MemoryEndpoint
	shm bool
}

func (e localEndpoint) Unpack(rkey []byte) (RemoteKey, error) {
	if len(rkey) < shmKeyLen {
		return nil, fmt.Errorf("ucx: peer key of %d bytes", len(rkey))
	}
	if e.shm {
		return e.MemoryEndpoint.Unpack(rkey[:shmKeyLen])
	}
	return e.MemoryEndpoint.Unpack(rkey[shmKeyLen:])
}

func (e localEndpoint) Put(ctx context.Context, ops []MemoryOp) error {
	inner := make([]MemoryOp, len(ops))
	for i, o := range ops {
		r, ok := o.Local.(*localRegistration)
		if !ok {
			return fmt.Errorf("ucx put: op %d has a registration of another transport", i)
		}
		o.Local = r.ucx
		if e.shm {
			o.Local = r.shm
		}
		inner[i] = o
	}
	return e.MemoryEndpoint.Put(ctx, inner)
}
