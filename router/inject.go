package router

import (
	"math/rand/v2"
	"slices"
	"strconv"

	"github.com/pdrouter/pdrouter/balancer"
)

// newRoom draws a bootstrap room uniformly from [0, 2^63-1], as
// sglang-router and SGLang's mini load balancer do.
func newRoom() uint64 { return rand.Uint64() & (1<<63 - 1) }

// batchSize is the number of prompts in a request for bootstrap purposes:
// 1 unless the body is a batch (spec §2.2), improved where upstream is wrong:
// a completions prompt that is one list of token ids is a single prompt.
func batchSize(route routeKind, body []byte, info *bodyInfo) int {
	switch route {
	case routeGenerate:
		if info.inputIDs.ok() {
			if n, allArrays := arrayLen(body, info.inputIDs); allArrays {
				return n
			}
		}
		if info.text.ok() && body[info.text.start] == '[' {
			if n, _ := arrayLen(body, info.text); n > 0 {
				return n
			}
		}
	case routeChat:
		if info.n > 1 {
			return int(info.n)
		}
	case routeCompletions:
		if info.prompt.ok() && body[info.prompt.start] == '[' {
			n, allArrays := arrayLen(body, info.prompt)
			if n > 0 && (allArrays || firstString(body, info.prompt) != nil) {
				return n
			}
		}
	}
	return 1
}

// appendInjected appends body with bootstrap_host, bootstrap_port and
// bootstrap_room set for the pair's prefill worker. Client-sent bootstrap
// values are replaced in place (key order survives); missing keys are added
// before the closing brace. Everything else is copied byte for byte.
// It returns the first room drawn.
func appendInjected(dst, body []byte, info *bodyInfo, prefill *balancer.Worker, batch int) ([]byte, uint64) {
	var vals [3][]byte
	var scratch [96]byte
	room := newRoom()
	if batch <= 1 {
		v := scratch[:0]
		v = strconv.AppendQuote(v, prefill.BootstrapHost)
		vals[0] = v
		v = appendPort(v[len(v):], prefill.BootstrapPort)
		vals[1] = v
		vals[2] = strconv.AppendUint(v[len(v):], room, 10)
	} else {
		vals[0] = appendRepeated(nil, batch, func(b []byte) []byte { return strconv.AppendQuote(b, prefill.BootstrapHost) })
		vals[1] = appendRepeated(nil, batch, func(b []byte) []byte { return appendPort(b, prefill.BootstrapPort) })
		first := true
		vals[2] = appendRepeated(nil, batch, func(b []byte) []byte {
			r := room
			if !first {
				r = newRoom()
			}
			first = false
			return strconv.AppendUint(b, r, 10)
		})
	}

	// Replace present values in body order.
	order := [3]int{0, 1, 2}
	slices.SortFunc(order[:], func(a, b int) int { return int(info.bootstrap[a].start - info.bootstrap[b].start) })
	pos := 0
	for _, k := range order {
		sp := info.bootstrap[k]
		if !sp.ok() {
			continue
		}
		dst = append(dst, body[pos:sp.start]...)
		dst = append(dst, vals[k]...)
		pos = int(sp.end)
	}
	closing := lastBrace(body)
	dst = append(dst, body[pos:closing]...)
	empty := isEmptyObject(body, closing)
	for k, key := range bootstrapKeys {
		if info.bootstrap[k].ok() {
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

func appendPort(b []byte, port int) []byte {
	if port == balancer.NoBootstrapPort {
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
