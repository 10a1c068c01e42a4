package splice

import (
	"strings"
	"testing"
)

func TestKVTransferMS(t *testing.T) {
	for _, c := range []struct {
		body string
		ms   float64
		ok   bool
	}{
		// pdrouter's engines (mockworker, enginesim) on /generate and the OpenAI routes.
		{`{"text":"x","meta_info":{"id":"1","kv_transfer":{"bytes":4096,"pages":2,"transport":"tcp","checksum_ok":true,"transfer_ms":12.5}}}`, 12.5, true},
		{`{"id":"c","choices":[],"kv_transfer":[{"bytes":1,"transfer_ms":3},{"bytes":1,"transfer_ms":9}]}`, 3, true},
		// SGLang's (req_time_stats.py), as Python's json writes it.
		{`{"meta_info": {"kv_transfer": {"latency_ms": 1.5e2, "total_mb": 16.0, "speed_gb_s": 0.1}}}`, 150, true},
		// Nothing to report, or nothing usable.
		{`{"meta_info":{"id":"1"}}`, 0, false},
		{`{"meta_info":{"kv_transfer":null}}`, 0, false},
		{`{"meta_info":{"kv_transfer":{"bytes":3}}}`, 0, false},
		{`{"meta_info":{"kv_transfer":{"transfer_ms":-1}}}`, 0, false},
		{`{"meta_info":{"kv_transfer":{"transfer_ms":"fast"}}}`, 0, false},
		{`{"meta_info":{"kv_transfer":{"transfer_ms":4`, 0, false}, // not all here yet
		// Generated text that names the key is escaped, so it is no key.
		{`{"text":"say \"kv_transfer\": {\"transfer_ms\": 1}","meta_info":{"kv_transfer":{"transfer_ms":2}}}`, 2, true},
	} {
		ms, ok := KVTransferMS([]byte(c.body))
		if ok != c.ok || ms != c.ms {
			t.Errorf("%s: got %v %v, want %v %v", c.body, ms, ok, c.ms, c.ok)
		}
	}
}

// A reply read in pieces finds the object wherever the cuts fall.
func TestKVScanAcrossPieces(t *testing.T) {
	chunk := `data: {"text":"` + strings.Repeat("tok ", 100) + `","meta_info":{"id":"1"}}` + "\n\n"
	last := `data: {"text":"end","meta_info":{"kv_transfer":{"bytes":4096,"pages":2,"transport":"tcp","checksum_ok":true,"transfer_ms":7.25}}}` + "\n\n"
	stream := []byte(strings.Repeat(chunk, 3) + last + "data: [DONE]\n\n")
	for _, size := range []int{1, 2, 7, 64, 255, 256, 257, 1000, len(stream)} {
		for first := 0; first < min(size, 50); first++ {
			var k KVScan
			got, found := 0.0, false
			for rest, n := stream, first; len(rest) > 0 && !found; n = size {
				n = min(max(n, 1), len(rest))
				got, found = k.Feed(rest[:n])
				rest = rest[n:]
			}
			if !found || got != 7.25 {
				t.Fatalf("pieces of %d (first %d): got %v %v", size, first, got, found)
			}
		}
	}
	// A kv_transfer that is no object is let go at once, and a later one found.
	var odd KVScan
	odd.Feed([]byte(`data: {"meta_info":{"kv_transfer":`))
	if odd.pending == nil {
		t.Fatal("an object cut after its key is not kept")
	}
	if _, found := odd.Feed([]byte(`null}}` + "\n\n")); found || odd.pending != nil {
		t.Fatalf("kv_transfer null: found %v, kept %q", found, odd.pending)
	}
	if ms, found := odd.Feed([]byte(last)); !found || ms != 7.25 {
		t.Fatalf("after a null one: %v %v", ms, found)
	}
	var k KVScan
	piece := []byte(chunk)
	if n := testing.AllocsPerRun(100, func() { k.Feed(piece) }); n != 0 {
		t.Errorf("feed: %v allocations", n)
	}
}

// FuzzKVScan: any reply cut anywhere neither panics nor grows the scan
// past kvObjectMax, and a reply fed whole reads as KVTransferMS reads it.
func FuzzKVScan(f *testing.F) {
	f.Add([]byte(`data: {"meta_info":{"kv_transfer":{"transfer_ms":7.25}}}`+"\n\n"), uint16(20))
	f.Add([]byte(`{"kv_transfer":[{"latency_ms":1e2}]}`), uint16(3))
	f.Add([]byte(`"kv_transfer" : [ {`), uint16(14))
	f.Fuzz(func(t *testing.T, body []byte, cut uint16) {
		var whole KVScan
		ms, ok := whole.Feed(body)
		if wms, wok := KVTransferMS(body); ms != wms || ok != wok {
			t.Fatalf("whole: %v %v, KVTransferMS %v %v", ms, ok, wms, wok)
		}
		var k KVScan
		at := int(cut) % (len(body) + 1)
		for _, p := range [][]byte{body[:at], body[at:]} {
			if ms, ok := k.Feed(p); ok && ms < 0 {
				t.Fatalf("negative time %v", ms)
			}
			if len(k.pending) > kvObjectMax {
				t.Fatalf("pending %d bytes", len(k.pending))
			}
		}
	})
}
