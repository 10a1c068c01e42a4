//go:build !linux

package router

import "errors"

// epoller is Linux's shared watch (connwatch_linux.go); elsewhere every
// watch is a goroutine of its own.
type epoller struct{}

func newEpoller() (*epoller, error) { return nil, errors.ErrUnsupported }

func (*epoller) add(*connWatch) error { return errors.ErrUnsupported }
func (*epoller) remove(*connWatch)    {}
func (*epoller) close()               {}

func (*epoller) addParked(*parkedConn) error   { return errors.ErrUnsupported }
func (*epoller) rearmParked(*parkedConn) error { return errors.ErrUnsupported }
func (*epoller) removeParked(*parkedConn)      {}
