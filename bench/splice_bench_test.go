// Package bench holds the benchmarks behind bench/RESULTS.md.
package bench

import (
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
// one validating scan plus the bootstrap splice into a reused buffer.
// sglang-router's CI gate for the same step is 5 µs per request.
func BenchmarkInspectInject(b *testing.B) {
	for _, size := range []int{1 << 10, 64 << 10, 1 << 20} {
		body := chatBody(size)
		b.Run(sizeName(size), func(b *testing.B) {
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
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return strconv.Itoa(n>>20) + "MiB"
	}
	return strconv.Itoa(n>>10) + "KiB"
}
