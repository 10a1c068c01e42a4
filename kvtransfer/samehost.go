package kvtransfer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SHM is the same-host transport for engine-owned memory: the writing
// kvproxy maps the peer engine's memfd itself (opened through the peer
// kvproxy's /proc/PID/fd, so both run on one host under one user) and
// copies straight from its mapping of the local engine's memory into it:
// one memcpy, no socket, no UCX. UCX over shared memory cannot do that for
// memory it did not allocate (UCX 1.13's posix and sysv register no
// foreign memory and fall back to active messages).
type SHM struct {
	TCP
	// HostID is this machine's id (default: the boot id); peers whose id
	// differs are on another host (kvproxy --host-id).
	HostID string
}

var _ MemoryTransport = (*SHM)(nil)

func (*SHM) Name() string { return "shm" }

// shmKeyLen is a packed key: boot id (36 bytes, text), pid, fd, the
// memfd's inode (so a reused fd number is never mistaken for it), the
// mapping's address in the peer kvproxy and its length.
const shmKeyLen = 36 + 4 + 4 + 8 + 8 + 8

var bootID = sync.OnceValues(func() ([]byte, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return nil, fmt.Errorf("shm transport: boot id: %w", err)
	}
	id := []byte(strings.TrimSpace(string(b)))
	if len(id) != 36 {
		return nil, fmt.Errorf("shm transport: boot id %q", id)
	}
	return id, nil
})

type shmRegistration struct {
	mem []byte
	key []byte
}

func (r *shmRegistration) RKey() []byte { return r.key }
func (*shmRegistration) Close() error   { return nil }

// RegisterMemory publishes where a peer finds the memfd: this process and
// the fd's number in it.
func (*SHM) RegisterMemory(b []byte, fd int) (MemoryRegistration, error) {
	id, err := bootID()
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if fd < 0 || unix.Fstat(fd, &st) != nil {
		return nil, errors.New("shm transport: no memfd")
	}
	k := append([]byte(nil), id...)
	k = binary.LittleEndian.AppendUint32(k, uint32(os.Getpid()))
	k = binary.LittleEndian.AppendUint32(k, uint32(fd))
	k = binary.LittleEndian.AppendUint64(k, st.Ino)
	k = binary.LittleEndian.AppendUint64(k, uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))))
	k = binary.LittleEndian.AppendUint64(k, uint64(len(b)))
	return &shmRegistration{mem: b, key: k}, nil
}

// WorkerAddress is the host id: peers on another host fail at once.
func (s *SHM) WorkerAddress() ([]byte, error) {
	if s.HostID != "" {
		return []byte(s.HostID), nil
	}
	return bootID()
}

func (s *SHM) MemoryEndpoint(addr []byte) (MemoryEndpoint, error) {
	id, err := s.WorkerAddress()
	if err != nil {
		return nil, err
	}
	if !bytes.Equal(addr, id) {
		return nil, errors.New("shm transport: the peer kvproxy runs on another host")
	}
	return &shmEndpoint{}, nil
}

// shmEndpoint holds the peer mappings it opened, until it closes: mu is
// read-held by writes, so Close never unmaps under a copy.
type shmEndpoint struct {
	mu     sync.RWMutex
	maps   []*shmMapping
	closed bool
}

// shmMapping is a peer engine's memory mapped here; base is the peer
// kvproxy's address of it, which MemoryOp.Remote is relative to.
type shmMapping struct {
	mem  []byte
	base uint64
}

func (e *shmEndpoint) Unpack(rkey []byte) (RemoteKey, error) {
	if len(rkey) != shmKeyLen {
		return nil, fmt.Errorf("shm transport: key of %d bytes", len(rkey))
	}
	pid := binary.LittleEndian.Uint32(rkey[36:])
	fd := binary.LittleEndian.Uint32(rkey[40:])
	ino := binary.LittleEndian.Uint64(rkey[44:])
	base := binary.LittleEndian.Uint64(rkey[52:])
	n := binary.LittleEndian.Uint64(rkey[60:])
	path := fmt.Sprintf("/proc/%d/fd/%d", pid, fd)
	f, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("shm transport: open the peer's memfd %s (both kvproxies must run under one user): %w", path, err)
	}
	defer unix.Close(f)
	var st unix.Stat_t
	if err := unix.Fstat(f, &st); err != nil || st.Ino != ino || uint64(st.Size) < n || n == 0 {
		return nil, fmt.Errorf("shm transport: %s is not the peer's memfd of %d bytes any more (inode %d, size %d): %v", path, n, st.Ino, st.Size, err)
	}
	ptr, err := unix.MmapPtr(f, 0, nil, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("shm transport: map the peer's memfd: %w", err)
	}
	m := &shmMapping{mem: unsafe.Slice((*byte)(ptr), n), base: base}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errors.Join(errors.New("shm transport: endpoint closed"), unmap(m.mem))
	}
	e.maps = append(e.maps, m)
	return m, nil
}

// Put copies every op; the bytes are in the peer's memory when it returns.
func (e *shmEndpoint) Put(ctx context.Context, ops []MemoryOp) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return errors.New("shm transport: endpoint closed")
	}
	for i, o := range ops {
		if i%64 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		reg, ok1 := o.Local.(*shmRegistration)
		m, ok2 := o.Key.(*shmMapping)
		if !ok1 || !ok2 {
			return fmt.Errorf("shm put: op %d has a registration or key of another transport", i)
		}
		off := o.Remote - m.base
		if o.Remote < m.base || off > uint64(len(m.mem)) || o.Len > uint64(len(m.mem))-off ||
			o.LocalOff > uint64(len(reg.mem)) || o.Len > uint64(len(reg.mem))-o.LocalOff {
			return fmt.Errorf("shm put: op %d outside its regions", i)
		}
		copy(m.mem[off:off+o.Len], reg.mem[o.LocalOff:o.LocalOff+o.Len])
	}
	return nil
}

func (e *shmEndpoint) Forget(k RemoteKey) {
	m, ok := k.(*shmMapping)
	if !ok {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, x := range e.maps {
		if x == m {
			_ = unmap(m.mem)
			e.maps = append(e.maps[:i], e.maps[i+1:]...)
			return
		}
	}
}

func (e *shmEndpoint) Close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	for _, m := range e.maps {
		_ = unmap(m.mem)
	}
	e.maps = nil
}
