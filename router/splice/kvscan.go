package splice

import (
	"bytes"
	"strconv"
	"strings"
)

// The kv_transfer object a PD reply reports (the engines' KV transfer
// time), found in a whole reply or in one read in pieces as it streams.

// kvObjectMax is longer than any kv_transfer object the engines write.
const kvObjectMax = 512

// KVScan finds a reply's kv_transfer object when fed the reply in pieces;
// its zero value is ready.
// It keeps the last bytes of a piece, in case the next completes a key cut
// in two, and only while an object is cut in two (once in a reply that
// reports one, at most) a copy of it: scanning holds 40 bytes per attempt.
type KVScan struct {
	edge    [len(`"kv_transfer"`) - 1]byte
	n       int8
	pending []byte // from a "kv_transfer" on, while its object is incomplete
}

// Feed scans the reply's next piece and returns the transfer time in ms
// once a complete object reports one.
func (k *KVScan) Feed(p []byte) (float64, bool) {
	if k.pending != nil {
		room := kvObjectMax - len(k.pending)
		k.pending = append(k.pending, p[:min(len(p), room)]...)
		if ms, ok := KVTransferMS(k.pending); ok {
			k.pending = nil
			return ms, true
		}
		key := bytes.Index(k.pending, kvTransferKey)
		if len(p) < room && (key < 0 || mayOpenObject(k.pending[key+len(kvTransferKey):])) {
			return 0, false // still incomplete
		}
		k.pending = nil // longer than any object, or none: not one of ours
	}
	// A key that began in the last piece?
	var joined [2 * len(KVScan{}.edge)]byte
	m := copy(joined[:], k.edge[:k.n])
	m += copy(joined[m:], p)
	if i := bytes.Index(joined[:m], kvTransferKey); i >= 0 && i < int(k.n) {
		k.pending = append(make([]byte, 0, kvObjectMax), joined[i:k.n]...)
		k.n = 0
		return k.Feed(p)
	}
	if ms, ok := KVTransferMS(p); ok {
		return ms, true
	}
	// An object that the next piece may complete?
	if i := bytes.LastIndex(p, kvTransferKey); i >= 0 && len(p)-i < kvObjectMax {
		if rest := p[i+len(kvTransferKey):]; mayOpenObject(rest) && !objectComplete(rest) {
			k.pending = append(make([]byte, 0, kvObjectMax), p[i:]...)
			k.n = 0
			return 0, false
		}
	}
	window := p
	if len(p) < len(k.edge) {
		window = joined[:m]
	}
	k.n = int8(copy(k.edge[:], window[max(len(window)-len(k.edge), 0):]))
	return 0, false
}

var (
	kvTransferKey = []byte(`"kv_transfer"`)
	// transfer_ms is pdrouter's engines' (mockworker, enginesim), latency_ms
	// SGLang's (meta_info.kv_transfer.latency_ms).
	kvTimeKeys = [][]byte{[]byte(`"transfer_ms"`), []byte(`"latency_ms"`)}
)

// KVTransferMS is the transfer time in ms of the first complete kv_transfer
// object in b: meta_info.kv_transfer on /generate, the OpenAI routes'
// top-level kv_transfer, or the first element of an array of them.
func KVTransferMS(b []byte) (float64, bool) {
	for {
		i := bytes.Index(b, kvTransferKey)
		if i < 0 {
			return 0, false
		}
		b = b[i+len(kvTransferKey):]
		obj, ok := jsonObjectAfterColon(b)
		if !ok {
			continue
		}
		for _, key := range kvTimeKeys {
			if ms, ok := numberField(obj, key); ok {
				return ms, true
			}
		}
	}
}

// jsonObjectAfterColon is the flat object (or an array's first one) that
// b's `: {...}` holds, without its closing brace; false if b has not got
// all of it.
func jsonObjectAfterColon(b []byte) ([]byte, bool) {
	b = skipSpace(b)
	if len(b) == 0 || b[0] != ':' {
		return nil, false
	}
	b = skipSpace(b[1:])
	if len(b) > 0 && b[0] == '[' {
		b = skipSpace(b[1:])
	}
	if len(b) == 0 || b[0] != '{' {
		return nil, false
	}
	end := bytes.IndexByte(b, '}')
	if end < 0 {
		return nil, false
	}
	return b[1:end], true
}

// mayOpenObject reports whether b, what follows a key, is the start of
// `: {` or `: [{` (or empty: more may come).
func mayOpenObject(b []byte) bool {
	if b = skipSpace(b); len(b) == 0 {
		return true
	}
	if b[0] != ':' {
		return false
	}
	if b = skipSpace(b[1:]); len(b) > 0 && b[0] == '[' {
		b = skipSpace(b[1:])
	}
	return len(b) == 0 || b[0] == '{'
}

func objectComplete(b []byte) bool {
	_, ok := jsonObjectAfterColon(b)
	return ok
}

// numberField is the non-negative number that obj holds under key.
func numberField(obj, key []byte) (float64, bool) {
	i := bytes.Index(obj, key)
	if i < 0 {
		return 0, false
	}
	v := skipSpace(obj[i+len(key):])
	if len(v) == 0 || v[0] != ':' {
		return 0, false
	}
	v = skipSpace(v[1:])
	n := 0
	for n < len(v) && strings.IndexByte("0123456789.eE+-", v[n]) >= 0 {
		n++
	}
	ms, err := strconv.ParseFloat(bstr(v[:n]), 64)
	if err != nil || ms < 0 {
		return 0, false
	}
	return ms, true
}

func skipSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\n' || b[0] == '\r') {
		b = b[1:]
	}
	return b
}
