package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// ErrMalformed is wrapped by every decoding error: the peer that sent the
// bytes is broken or hostile and its connection must be closed.
var ErrMalformed = errors.New("malformed message")

// Limits on decoded collections, so a hostile length prefix cannot make the
// decoder allocate more than the frame it arrived in could describe.
const (
	maxString  = 4 << 10
	maxBlob    = 1 << 20
	maxRegions = 4096
)

// Enc appends little-endian primitives to a byte slice.
type Enc struct{ B []byte }

func (e *Enc) U8(v uint8)   { e.B = append(e.B, v) }
func (e *Enc) U32(v uint32) { e.B = binary.LittleEndian.AppendUint32(e.B, v) }
func (e *Enc) U64(v uint64) { e.B = binary.LittleEndian.AppendUint64(e.B, v) }
func (e *Enc) I32(v int32)  { e.U32(uint32(v)) }

func (e *Enc) Bool(v bool) {
	if v {
		e.U8(1)
		return
	}
	e.U8(0)
}

// Bytes writes a u32 length then the bytes.
func (e *Enc) Bytes(v []byte) {
	e.U32(uint32(len(v)))
	e.B = append(e.B, v...)
}

func (e *Enc) String(v string) {
	e.U32(uint32(len(v)))
	e.B = append(e.B, v...)
}

// Text writes free text (a reason, an error message) cut at a rune to the
// length String decodes: whole, a long one would get the frame rejected as
// malformed and the connection carrying it dropped.
func (e *Enc) Text(v string) {
	if len(v) > maxString {
		n := maxString
		for n > 0 && !utf8.RuneStart(v[n]) {
			n--
		}
		v = v[:n]
	}
	e.String(v)
}

// U32s writes a u32 count then the values.
func (e *Enc) U32s(v []uint32) {
	e.U32(uint32(len(v)))
	for _, x := range v {
		e.U32(x)
	}
}

// Dec reads what Enc wrote. The first failure sticks in Err and every later
// read returns a zero value, so callers check Err once at the end.
type Dec struct {
	B   []byte
	Err error
}

func (d *Dec) fail() {
	if d.Err == nil {
		d.Err = ErrMalformed
	}
}

// failf fails d saying what was wrong, unless it failed already.
func (d *Dec) failf(format string, a ...any) {
	if d.Err == nil {
		d.Err = fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, a...))
	}
}

func (d *Dec) take(n int) []byte {
	if d.Err != nil || n < 0 || n > len(d.B) {
		d.fail()
		return nil
	}
	v := d.B[:n:n]
	d.B = d.B[n:]
	return v
}

func (d *Dec) U8() uint8 {
	b := d.take(1)
	if b == nil {
		return 0
	}
	return b[0]
}

func (d *Dec) U32() uint32 {
	b := d.take(4)
	if b == nil {
		return 0
	}
	return binary.LittleEndian.Uint32(b)
}

func (d *Dec) U64() uint64 {
	b := d.take(8)
	if b == nil {
		return 0
	}
	return binary.LittleEndian.Uint64(b)
}

func (d *Dec) I32() int32 { return int32(d.U32()) }

func (d *Dec) Bool() bool {
	switch d.U8() {
	case 0:
		return false
	case 1:
		return true
	}
	d.fail()
	return false
}

func (d *Dec) lenPrefix(max int) int {
	n := d.U32()
	if d.Err != nil {
		return 0
	}
	if n > uint32(max) || n > math.MaxInt32 {
		d.fail()
		return 0
	}
	return int(n)
}

// Bytes returns a copy, so decoded messages never alias a reused read buffer.
func (d *Dec) Bytes() []byte {
	b := d.take(d.lenPrefix(maxBlob))
	if b == nil {
		return nil
	}
	return append([]byte(nil), b...)
}

func (d *Dec) String() string { return string(d.take(d.lenPrefix(maxString))) }

// U32s checks the count against the bytes left before allocating.
func (d *Dec) U32s() []uint32 {
	n := d.lenPrefix(math.MaxInt32)
	if d.Err != nil {
		return nil
	}
	if n > len(d.B)/4 {
		d.fail()
		return nil
	}
	v := make([]uint32, n)
	for i := range v {
		v[i] = binary.LittleEndian.Uint32(d.B[4*i:])
	}
	d.B = d.B[4*n:]
	return v
}

// End fails unless every byte was consumed: trailing garbage is malformed.
func (d *Dec) End() error {
	if d.Err == nil && len(d.B) != 0 {
		d.fail()
	}
	return d.Err
}
