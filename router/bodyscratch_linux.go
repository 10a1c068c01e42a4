package router

import "syscall"

// reserve maps n bytes of address space that cost memory only where
// written (MAP_NORESERVE; refused under strict overcommit).
func reserve(n int) ([]byte, error) {
	return syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE|syscall.MAP_NORESERVE)
}

func unreserve(b []byte) {
	syscall.Munmap(b) //nolint:errcheck // fails only for a mapping reserve did not make
}
