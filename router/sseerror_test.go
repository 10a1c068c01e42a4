package router

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
	"time"
)

// kvEngineError is an engine's error about the KV transfer as a PD stream
// carries it: it names the kvproxy's control socket and the bootstrap URL.
const kvEngineError = `data: {"error":{"message":"KV transfer failed: kvproxy expect: dial unix /run/pdrouter/kv.sock: connect: no such file or directory (bootstrap http://10.1.2.3:8998/route)"}}` + "\n\n"

// Issue 26: an engine's own error event in the middle of a PD stream is
// relayed word for word, as sglang-router relays decode's chunks, unless
// it is about the KV transfer: then it names no socket or address of ours
// (as TestKVTransferErrorHidesInternals for a non-stream). It was relayed
// word for word either way. The event arrives in pieces, flushed apart.
func TestEngineSSEErrorMidStream(t *testing.T) {
	for name, c := range map[string]struct {
		event      string
		want, not  []string
		firstEvent bool
	}{
		"kv transfer": {event: kvEngineError,
			want: []string{`"code":"kv_transfer_failed"`, "KV transfer between prefill and decode failed"},
			not:  []string{"kv.sock", "10.1.2.3"}},
		"kv transfer first": {event: kvEngineError, firstEvent: true,
			want: []string{`"code":"kv_transfer_failed"`},
			not:  []string{"kv.sock", "10.1.2.3"}},
		"other, verbatim": {event: `data: {"error": {"message": "CUDA out of memory on rank 3", "code": 500}}` + "\n\n",
			want: []string{`data: {"error": {"message": "CUDA out of memory on rank 3", "code": 500}}` + "\n\n"}},
		"kv words in text, verbatim": {event: `data: {"text":"a kvproxy bootstrap error"}` + "\n\n",
			want: []string{`data: {"text":"a kvproxy bootstrap error"}` + "\n\n"}},
	} {
		for _, mode := range []string{"pd", "vllm-pd"} {
			t.Run(mode+"/"+name, func(t *testing.T) {
				decode := legWorker(t, func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Content-Type", "text/event-stream")
					if !c.firstEvent {
						w.Write([]byte("data: {\"text\":\"a\"}\n\n"))
						w.(http.Flusher).Flush()
					}
					for _, piece := range []string{c.event[:3], c.event[3:12], c.event[12 : len(c.event)-1], c.event[len(c.event)-1:]} {
						w.Write([]byte(piece))
						w.(http.Flusher).Flush()
						time.Sleep(20 * time.Millisecond)
					}
					w.Write([]byte("data: [DONE]\n\n"))
				})
				cfg := legPDConfig(legWorker(t, answer(200)), decode)
				cfg.VLLMPDDisaggregation = mode == "vllm-pd"
				e := startLegEnv(t, cfg)
				status, body := e.stream(t, bodyPath(mode), `{"text":"x","prompt":"x","stream":true}`)
				if status != 200 {
					t.Fatalf("status %d: %s", status, body)
				}
				for _, w := range c.want {
					if !strings.Contains(body, w) {
						t.Errorf("client got %q; want %q in it", body, w)
					}
				}
				for _, n := range c.not {
					if strings.Contains(body, n) {
						t.Errorf("client got %q, naming %q", body, n)
					}
				}
				if !c.firstEvent && !strings.HasPrefix(body, "data: {\"text\":\"a\"}\n\n") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
					t.Errorf("client got %q; want the other events untouched", body)
				}
			})
		}
	}
}

// stream posts body to path and reads the whole reply.
func (e *legEnv) stream(t *testing.T, path, body string) (int, string) {
	t.Helper()
	return postStreamVia(t, e.client, e.base+path, body)
}

func TestScrubKVErrors(t *testing.T) {
	ev := `data: {"text":"a"}` + "\n\n"
	for name, c := range map[string]struct {
		in          string
		atLineStart bool
		scrubbed    bool
	}{
		"alone":                {kvEngineError, true, true},
		"between events":       {ev + kvEngineError + ev, true, true},
		"crlf":                 {strings.ReplaceAll(kvEngineError, "\n", "\r\n"), true, true},
		"not at a line start":  {kvEngineError, false, false},
		"unfinished":           {strings.TrimSuffix(kvEngineError, "\n"), true, false},
		"no space after data:": {strings.Replace(kvEngineError, "data: ", "data:", 1), true, true},
		"other error":          {`data: {"error":"bad sampling params"}` + "\n\n", true, false},
	} {
		t.Run(name, func(t *testing.T) {
			out := scrubKVErrors([]byte(c.in), "decode", c.atLineStart)
			if got := !bytes.Equal(out, []byte(c.in)); got != c.scrubbed {
				t.Fatalf("scrubbed %v, want %v: %q", got, c.scrubbed, out)
			}
			if c.scrubbed && (bytes.Contains(out, []byte("kv.sock")) || !bytes.Contains(out, []byte("kv_transfer_failed")) ||
				strings.Count(string(out), "data:") != strings.Count(c.in, "data:")) {
				t.Fatalf("%q", out)
			}
		})
	}
}

func TestErrorEventOpen(t *testing.T) {
	for in, open := range map[string]bool{
		"":                                      false,
		"data: {\"text\":\"a\"}\n\n":            false,
		"data: {\"te":                           false,
		"data: {\"err":                          true,
		"da":                                    true,
		"data: {\"text\":\"a\"}\n\nd":           true,
		strings.TrimSuffix(kvEngineError, "\n"): true,
		kvEngineError:                           false,
		kvEngineError + "data: {\"error\"":      true,
	} {
		if got := errorEventOpen([]byte(in), true); got != open {
			t.Errorf("errorEventOpen(%q) = %v, want %v", in, got, open)
		}
	}
}

// scrubKVErrors leaves a stream without a KV error event as it is, and
// never leaves the socket path of one it saw whole.
func FuzzScrubKVErrors(f *testing.F) {
	f.Add([]byte(kvEngineError), true)
	f.Add([]byte("data: {\"error\"\n\ndata: {\"error\":{\"message\":\"kvproxy\"}}\r\n\r\n"), true)
	f.Fuzz(func(t *testing.T, b []byte, atLineStart bool) {
		out := scrubKVErrors(b, "decode", atLineStart)
		if !bytes.Contains(b, []byte(`"error"`)) && !bytes.Equal(out, b) {
			t.Fatalf("%q changed into %q", b, out)
		}
		errorEventOpen(b, atLineStart)
	})
}
