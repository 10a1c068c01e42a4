//go:build !linux

package router

import (
	"context"
	"net"
)

// evLoops are Linux's (evloop_linux.go); elsewhere every request is
// fasthttp's.
type evLoops struct{}

func newEvLoops(*Server, int) (*evLoops, error) { return nil, nil }

func (*evLoops) take(net.Conn) bool { return false }

func (*evLoops) shutdown(context.Context) {}

func (*evLoops) awaitHandoffs(context.Context) {}
