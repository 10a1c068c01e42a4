// Package shm is an engine's KV memory as a shared file: a memfd the engine
// maps and passes to its kvproxy (SCM_RIGHTS), which maps it too, so pages
// move into and out of the engine's memory without a copy.
package shm

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Segment is one mapping of a shared-memory file and an fd for that file.
type Segment struct {
	fd  int
	Mem []byte
}

// Create makes a memfd of size bytes and maps it (shared, read-write).
func Create(name string, size int) (*Segment, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ftruncate memfd to %d: %w", size, err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("mmap %d bytes: %w", size, err)
	}
	return &Segment{fd: fd, Mem: mem}, nil
}

// Fd is the file's fd, to pass to the other process.
func (s *Segment) Fd() int { return s.fd }

// Close unmaps the segment and closes the fd.
func (s *Segment) Close() error {
	err := errors.Join(unix.Munmap(s.Mem), unix.Close(s.fd))
	s.Mem = nil
	return err
}
