//go:build !cgo

package sidecar

import (
	"errors"

	"github.com/pdrouter/pdrouter/kvtransfer"
)

const ucxBuilt = false

func newUCX(string) (kvtransfer.Transport, error) { return nil, errors.New("ucx needs a cgo build") }
