//go:build cgo

package main

import "github.com/pdrouter/pdrouter/kvtransfer"

// The ucx transport needs libucp, so only cgo builds offer it.
func init() {
	transports["ucx"] = func() (kvtransfer.Transport, error) { return kvtransfer.NewUCX() }
}
