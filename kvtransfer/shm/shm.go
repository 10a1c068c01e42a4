// Package shm is an engine's KV memory as a shared file: a memfd the engine
// maps and passes to its kvproxy (SCM_RIGHTS), which maps it too, so pages
// move into and out of the engine's memory without a copy.
package shm

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Segment is one mapping of a shared-memory file and an fd for that file.
type Segment struct {
	fd  int
	Mem []byte
}

// Create makes a memfd of size bytes and maps it.
func Create(name string, size int) (*Segment, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ftruncate memfd to %d: %w", size, err)
	}
	s, err := Map(fd)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return s, nil
}

// Map maps the whole file behind fd (shared, read-write) and takes
// ownership of fd.
func Map(fd int) (*Segment, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	if st.Size <= 0 {
		return nil, fmt.Errorf("shared segment is empty")
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", st.Size, err)
	}
	return &Segment{fd: fd, Mem: mem}, nil
}

// Fd is the file's fd, to pass to the other process.
func (s *Segment) Fd() int { return s.fd }

// Close unmaps the segment and closes the fd.
func (s *Segment) Close() error {
	err := unix.Munmap(s.Mem)
	s.Mem = nil
	if cerr := unix.Close(s.fd); err == nil {
		err = cerr
	}
	return err
}
