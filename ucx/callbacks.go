//go:build cgo

package ucx

/*
#include "glue.h"
*/
import "C"

import (
	"runtime/cgo"
	"unsafe"
)

// ucxgoAMRecv is the active-message callback; handle is the cgo.Handle of
// the AMHandler that SetAMHandler registered.
//
//export ucxgoAMRecv
func ucxgoAMRecv(handle C.uintptr_t, hdr unsafe.Pointer, hlen C.size_t, data unsafe.Pointer, n C.size_t) C.ucs_status_t {
	fn := cgo.Handle(handle).Value().(AMHandler)
	fn(unsafe.Slice((*byte)(hdr), int(hlen)), unsafe.Slice((*byte)(data), int(n)))
	return C.UCS_OK
}
