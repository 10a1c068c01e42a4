package splice

import (
	"math/rand/v2"
	"strconv"
)

// NewRoom draws a bootstrap room uniformly from [0, 2^63-1], as
// sglang-router and SGLang's mini load balancer do.
func NewRoom() uint64 { return rand.Uint64() & (1<<63 - 1) }

// SetBootstrap sets bootstrap_host, bootstrap_port and bootstrap_room on
// b for the pair's prefill worker: client-sent values are replaced in place
// (key order survives), missing keys are added before the closing brace,
// everything else stays the client's bytes. It returns the first room
// drawn.
//
// host is sent as a JSON string, port as an integer or null when it is
// NoPort, and batch > 1 turns each value into an array with a fresh room per
// element.
func SetBootstrap(b *Body, info *Info, host string, port, batch int) uint64 {
	var vals [3][]byte
	var scratch [96]byte
	room := NewRoom()
	if batch <= 1 {
		v := scratch[:0]
		v = strconv.AppendQuote(v, host)
		vals[0] = v
		v = appendPort(v[len(v):], port)
		vals[1] = v
		vals[2] = strconv.AppendUint(v[len(v):], room, 10)
	} else {
		vals[0] = appendRepeated(nil, batch, func(b []byte) []byte { return strconv.AppendQuote(b, host) })
		vals[1] = appendRepeated(nil, batch, func(b []byte) []byte { return appendPort(b, port) })
		first := true
		vals[2] = appendRepeated(nil, batch, func(b []byte) []byte {
			r := room
			if !first {
				r = NewRoom()
			}
			first = false
			return strconv.AppendUint(b, r, 10)
		})
	}
	for k, key := range bootstrapKeys {
		b.Set(key, info.Bootstrap[k], vals[k])
	}
	return room
}

// AppendBootstrap appends body with the bootstrap fields SetBootstrap sets,
// in one buffer.
func AppendBootstrap(dst, body []byte, info *Info, host string, port, batch int) ([]byte, uint64) {
	var b Body
	b.Reset(body)
	room := SetBootstrap(&b, info, host, port, batch)
	return b.AppendTo(dst), room
}

// NoPort makes bootstrap_port JSON null: SGLang then uses its default.
const NoPort = -1

func appendPort(b []byte, port int) []byte {
	if port == NoPort {
		return append(b, "null"...)
	}
	return strconv.AppendInt(b, int64(port), 10)
}

func appendRepeated(b []byte, n int, elem func([]byte) []byte) []byte {
	b = append(b, '[')
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = elem(b)
	}
	return append(b, ']')
}

// lastBrace is the index of the object's closing brace (the body is a
// validated object, so it is the last non-space byte).
func lastBrace(body []byte) int {
	i := len(body) - 1
	for i > 0 && body[i] != '}' {
		i--
	}
	return i
}

// isEmptyObject reports whether nothing but whitespace precedes the closing brace
// after the opening one.
func isEmptyObject(body []byte, closing int) bool {
	for i := closing - 1; i >= 0; i-- {
		switch body[i] {
		case ' ', '\t', '\n', '\r':
		case '{':
			return true
		default:
			return false
		}
	}
	return true
}
