package splice

import (
	"math/rand/v2"
	"slices"
	"strconv"
)

// NewRoom draws a bootstrap room uniformly from [0, 2^63-1], as
// sglang-router and SGLang's mini load balancer do.
func NewRoom() uint64 { return rand.Uint64() & (1<<63 - 1) }

// AppendBootstrap appends body with bootstrap_host, bootstrap_port and
// bootstrap_room set for the pair's prefill worker. Client-sent bootstrap
// values are replaced in place (key order survives); missing keys are added
// before the closing brace. Everything else is copied byte for byte.
// It returns the first room drawn.
//
// host is sent as a JSON string, port as an integer or null when it is
// NoPort, and batch > 1 turns each value into an array with a fresh room per
// element.
func AppendBootstrap(dst, body []byte, info *Info, host string, port, batch int) ([]byte, uint64) {
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

	// Replace present values in body order.
	order := [3]int{0, 1, 2}
	slices.SortFunc(order[:], func(a, b int) int { return int(info.Bootstrap[a].Start - info.Bootstrap[b].Start) })
	pos := 0
	for _, k := range order {
		sp := info.Bootstrap[k]
		if !sp.OK() {
			continue
		}
		dst = append(dst, body[pos:sp.Start]...)
		dst = append(dst, vals[k]...)
		pos = int(sp.End)
	}
	closing := lastBrace(body)
	dst = append(dst, body[pos:closing]...)
	empty := isEmptyObject(body, closing)
	for k, key := range bootstrapKeys {
		if info.Bootstrap[k].OK() {
			continue
		}
		if !empty {
			dst = append(dst, ',')
		}
		empty = false
		dst = append(dst, '"')
		dst = append(dst, key...)
		dst = append(dst, '"', ':')
		dst = append(dst, vals[k]...)
	}
	return append(dst, body[closing:]...), room
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
