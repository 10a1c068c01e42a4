package router

import (
	"bytes"
	"io"
)

// An engine's own error event in a PD stream, SGLang's or vLLM's
// (`data: {"error": ...}`), is relayed word for word, as sglang-router
// relays every decode chunk, unless it is about the KV transfer: its words
// then name the kvproxy's control socket and the internal bootstrap
// address, and the client gets upstreamError's kv_transfer_failed event
// instead, as for a non-stream.

var errorLines = [...][]byte{[]byte(`data: {"error"`), []byte(`data:{"error"`)}

// completeErrorEvent reads more of r into buf after its n bytes while
// they end inside an error event, or inside a line that may begin one, so
// that scrubKVErrors sees it whole. atLineStart: buf follows a line's end.
func completeErrorEvent(r io.Reader, buf []byte, n int, atLineStart bool) (int, error) {
	for n < len(buf) && errorEventOpen(buf[:n], atLineStart) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// errorEventOpen reports whether b ends inside an error event or in a
// line that may still become an error line.
func errorEventOpen(b []byte, atLineStart bool) bool {
	last := -1
	for i := nextErrorLine(b, 0, atLineStart); i >= 0; i = nextErrorLine(b, i+1, atLineStart) {
		last = i
	}
	if last >= 0 && eventLen(b[last:]) < 0 {
		return true
	}
	i := bytes.LastIndexByte(b, '\n')
	if tail := b[i+1:]; len(tail) > 0 && (i >= 0 || atLineStart) {
		for _, p := range errorLines {
			if len(tail) < len(p) && bytes.HasPrefix(p, tail) {
				return true
			}
		}
	}
	return false
}

var dataField = []byte("data:")

// eventLen is the length of the event b starts with, up to and including
// the empty line that ends it ("\n\n" or "\n\r\n"); -1 if it has not ended.
func eventLen(b []byte) int {
	for i := 0; ; {
		k := bytes.IndexByte(b[i:], '\n')
		if k < 0 {
			return -1
		}
		i += k + 1
		if i < len(b) && b[i] == '\r' {
			i++
		}
		if i < len(b) && b[i] == '\n' {
			return i + 1
		}
	}
}

// nextErrorLine is where the first error line at or after from starts in
// b, or -1.
func nextErrorLine(b []byte, from int, atLineStart bool) int {
	for i := from; i < len(b); i += len(dataField) {
		k := bytes.Index(b[i:], dataField)
		if k < 0 {
			return -1
		}
		i += k
		if i > 0 && b[i-1] != '\n' || i == 0 && !atLineStart {
			continue
		}
		for _, p := range errorLines {
			if bytes.HasPrefix(b[i:], p) {
				return i
			}
		}
	}
	return -1
}

// scrubKVErrors returns b with each whole error event about the KV
// transfer replaced by the router's own (side: who sent it); b itself when
// there is none.
func scrubKVErrors(b []byte, side string, atLineStart bool) []byte {
	var out []byte
	done := 0
	for i := nextErrorLine(b, 0, atLineStart); i >= 0; i = nextErrorLine(b, i+1, atLineStart) {
		n := eventLen(b[i:])
		if n < 0 {
			break
		}
		data := b[i+len(dataField) : i+n]
		data = data[:bytes.IndexByte(data, '\n')]
		if e := upstreamError(side, 500, bytes.TrimSpace(data)); e.Code == "kv_transfer_failed" {
			out = append(append(out, b[done:i]...), e.sseFrame()...)
			done = i + n
		}
	}
	if out == nil {
		return b
	}
	return append(out, b[done:]...)
}
