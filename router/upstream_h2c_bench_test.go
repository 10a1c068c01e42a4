package router

import (
	"io"
	"net"
	"net/http"
	"strconv"
	"testing"
)

// cannedH2CBackend is cannedBackend served by net/http with h2c beside
// HTTP/1.1, reporting enable_http2.
func cannedH2CBackend(b *testing.B, stream bool) string {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	reply := `{"text":" tok1 tok2 tok3 tok4","meta_info":{"id":"x","prompt_tokens":3,"completion_tokens":4}}`
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /server_info", func(w http.ResponseWriter, _ *http.Request) {
		io.WriteString(w, `{"served_model_name":"mock","enable_http2":true}`)
	})
	mux.HandleFunc("POST /generate", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if !stream {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, reply)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 8 {
			io.WriteString(w, `data: {"text":"tok`+strconv.Itoa(i)+`"}`+"\n\n")
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: mux, Protocols: &p}
	go srv.Serve(ln) //nolint:errcheck // ends at Close
	b.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// benchH2C is benchRouter over h2c backends; http2=false sends them
// HTTP/1.1, the same-run baseline.
func benchH2C(b *testing.B, stream, http2 bool) {
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: cannedH2CBackend(b, stream), BootstrapPort: 8998}}
	cfg.Decode = []string{cannedH2CBackend(b, stream)}
	cfg.Manager.UpstreamHTTP2 = http2
	base, srv := serveInProcess(b, cfg)
	url := base + "/generate"
	body := []byte(`{"text":"The quick brown fox jumps over the lazy dog","sampling_params":{"max_new_tokens":4},"stream":` + strconv.FormatBool(stream) + `}`)
	benchPosts(b, srv, url, body)
}

// PD over the same net/http backends, HTTP/1.1 then h2c (client, router
// and backends share the process: compare the pair, not absolutes).
func BenchmarkPDNetHTTPBackendH1(b *testing.B)        { benchH2C(b, false, false) }
func BenchmarkPDNetHTTPBackendH2C(b *testing.B)       { benchH2C(b, false, true) }
func BenchmarkPDStreamNetHTTPBackendH1(b *testing.B)  { benchH2C(b, true, false) }
func BenchmarkPDStreamNetHTTPBackendH2C(b *testing.B) { benchH2C(b, true, true) }
