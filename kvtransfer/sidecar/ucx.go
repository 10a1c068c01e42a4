//go:build cgo

package sidecar

import "github.com/pdrouter/pdrouter/kvtransfer"

const ucxBuilt = true

func newUCX() (kvtransfer.Transport, error) { return kvtransfer.NewUCX() }
