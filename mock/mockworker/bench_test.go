package mockworker

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// The mock must not be the bottleneck of router benchmarks.
func benchPost(b *testing.B, cfg Config, path, body string) {
	s, err := Start(cfg)
	if err != nil {
		b.Fatal(err)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	defer func() {
		tr.CloseIdleConnections()
		s.Close()
	}()
	c := &http.Client{Transport: tr}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := c.Post(s.URL()+path, "application/json", strings.NewReader(body))
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
		}
	})
}

func BenchmarkGenerate(b *testing.B) {
	benchPost(b, Config{}, "/generate", `{"text":"hello there","sampling_params":{"max_new_tokens":16}}`)
}

func BenchmarkDecodeChatStream(b *testing.B) {
	benchPost(b, Config{Role: RoleDecode}, "/v1/chat/completions",
		`{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true,`+boot+`}`)
}
