// Package bench holds the benchmarks behind bench/RESULTS.md.
package bench

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/router/splice"
)

// chatBody builds an OpenAI chat request of about size bytes.
func chatBody(size int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"meta-llama/Llama-3.1-8B-Instruct","stream":true,"max_tokens":256,"temperature":0.7,"messages":[`)
	for i := 0; b.Len() < size-64; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		b.WriteString(`{"role":"` + role + `","content":"message ` + strconv.Itoa(i) + ` lorem ipsum dolor sit amet, consectetur \"adipiscing\" elit, sed do eiusmod tempor"}`)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// BenchmarkInspectInject is the router's per-request body work in PD mode:
// one validating scan plus the bootstrap splice into a reused buffer
// ("splice"). Baselines from the same run: encoding/json.Valid alone
// ("json-valid": validation only, nothing learnt or written), and decoding
// into a map, setting the three fields and encoding again ("reserialise":
// what sglang-router does, whose CI gate for it is 5 µs per request).
func BenchmarkInspectInject(b *testing.B) {
	for _, size := range []int{1 << 10, 64 << 10, 1 << 20} {
		body := chatBody(size)
		b.Run(sizeName(size)+"/splice", func(b *testing.B) {
			dst := make([]byte, 0, len(body)+256)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				var info splice.Info
				if err := splice.Inspect(body, &info); err != nil {
					b.Fatal(err)
				}
				dst, _ = splice.AppendBootstrap(dst[:0], body, &info, "10.0.0.12", 8998, 1)
			}
		})
		b.Run(sizeName(size)+"/json-valid", func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if !json.Valid(body) {
					b.Fatal("invalid")
				}
			}
		})
		b.Run(sizeName(size)+"/reserialise", func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				var m map[string]any
				if err := json.Unmarshal(body, &m); err != nil {
					b.Fatal(err)
				}
				m["bootstrap_host"], m["bootstrap_port"], m["bootstrap_room"] = "10.0.0.12", 8998, splice.NewRoom()
				if _, err := json.Marshal(m); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return strconv.Itoa(n>>20) + "MiB"
	}
	return strconv.Itoa(n>>10) + "KiB"
}
