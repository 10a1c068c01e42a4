package splice

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unsafe"
)

// within reports whether s lies inside buf's memory.
func within(s, buf []byte) bool {
	if len(s) == 0 || len(buf) == 0 {
		return false
	}
	p, lo := uintptr(unsafe.Pointer(unsafe.SliceData(s))), uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
	return p >= lo && p+uintptr(len(s)) <= lo+uintptr(len(buf))
}

func TestBodySegmentsShareTheClientBytes(t *testing.T) {
	src := []byte(`{"text":"` + strings.Repeat("x", 1<<20) + `","bootstrap_port":7,"stream":true}`)
	var info Info
	if err := Inspect(src, &info); err != nil {
		t.Fatal(err)
	}
	var b Body
	b.Reset(src)
	SetBootstrap(&b, &info, "10.0.0.1", 8998, 1)
	rid := SetNewRID(&b)

	shared := 0
	for s := range b.Segments {
		if within(s, src) {
			shared += len(s)
		}
	}
	// Everything but the replaced port value (1 byte) is the client's own
	// memory, not a copy.
	if shared != len(src)-1 {
		t.Fatalf("%d of %d client bytes sent from the client's buffer", shared, len(src))
	}
	out := b.AppendTo(nil)
	if b.Len() != len(out) {
		t.Fatalf("Len %d, body %d bytes", b.Len(), len(out))
	}
	var m map[string]any
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatal(err)
	}
	if m["bootstrap_port"] != 8998.0 || m["bootstrap_host"] != "10.0.0.1" || m["stream"] != true || `"`+m["rid"].(string)+`"` != string(rid) {
		t.Fatalf("fields: port %v host %v stream %v rid %v (returned %s)", m["bootstrap_port"], m["bootstrap_host"], m["stream"], m["rid"], rid)
	}
	if !bytes.HasPrefix(out, []byte(`{"text":"xxx`)) || bytes.Count(out, []byte("bootstrap_port")) != 1 {
		t.Fatalf("key order or uniqueness broken: %.40s…", out)
	}
}

func TestBodySetCostsNoAllocation(t *testing.T) {
	src := []byte(`{"text":"hi","bootstrap_room":1}`)
	var info Info
	if err := Inspect(src, &info); err != nil {
		t.Fatal(err)
	}
	var b Body
	allocs := testing.AllocsPerRun(100, func() {
		b.Reset(src)
		SetBootstrap(&b, &info, "host", 8998, 1)
		SetNewRID(&b)
		for s := range b.Segments {
			_ = s
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per body, want 0", allocs)
	}
}

func TestBodyValuesSurviveGrowth(t *testing.T) {
	var b Body
	b.Reset([]byte(`{}`))
	first := b.Set("a", Span{}, []byte(`"first"`))
	big := bytes.Repeat([]byte("1"), 4<<10) // past the inline space: vals moves to the heap
	b.Set("b", Span{}, big)
	if string(first) != `"first"` {
		t.Fatalf("earlier value changed to %.20q", first)
	}
	if got, want := string(b.AppendTo(nil)), `{"a":"first","b":`+string(big)+`}`; got != want {
		t.Fatalf("body %.40q…", got)
	}
}

// A pooled body (vLLM's legs) keeps the heap buffer a long value grew it
// into: the next use's long value costs no allocation, and the bytes are
// the new use's alone. One too large to keep is let go.
func TestBodyReuseKeepsItsGrownBuffer(t *testing.T) {
	long := []byte(`{"remote_engine_id":"` + strings.Repeat("e", 300) + `"}`)
	var b Body
	use := func(src []byte, val []byte) string {
		b.Reuse(src)
		b.Set("kv_transfer_params", Span{}, val)
		return string(b.AppendTo(nil))
	}
	use([]byte(`{"a":1}`), long)
	src := []byte(`{"b":2}`)
	if n := testing.AllocsPerRun(100, func() {
		b.Reuse(src)
		b.Set("kv_transfer_params", Span{}, long)
	}); n != 0 {
		t.Errorf("%v allocations per reuse with a long value, want 0", n)
	}
	if got, want := use([]byte(`{"b":2}`), []byte(`null`)), `{"b":2,"kv_transfer_params":null}`; got != want {
		t.Errorf("reused body %q, want %q", got, want)
	}
	use([]byte(`{}`), bytes.Repeat([]byte("1"), maxKeptVals+1))
	b.Reuse(nil)
	if cap(b.vals) > len(b.space) {
		t.Errorf("a body keeps a %d-byte buffer, more than %d", cap(b.vals), maxKeptVals)
	}
}

func TestBodyUneditedIsTheClientBody(t *testing.T) {
	src := []byte(`{"a":1}`)
	var b Body
	b.Reset(src)
	var segs [][]byte
	for s := range b.Segments {
		segs = append(segs, s)
	}
	if len(segs) != 1 || !within(segs[0], src) || len(segs[0]) != len(src) {
		t.Fatalf("segments %q", segs)
	}
}
