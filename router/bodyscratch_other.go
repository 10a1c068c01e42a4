//go:build !linux

package router

import "errors"

// reserve is Linux's (bodyscratch_linux.go); elsewhere a chunked body grows
// on the heap.
func reserve(int) ([]byte, error) { return nil, errors.ErrUnsupported }

func unreserve([]byte) {}
