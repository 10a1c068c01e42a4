package balancer

import "testing"

func BenchmarkBreakerAllowClosed(b *testing.B) {
	br := NewBreaker(DefaultBreakerConfig())
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !br.Allow() {
				b.Fatal("closed breaker refused")
			}
		}
	})
}

func BenchmarkBreakerRecordSuccess(b *testing.B) {
	br := NewBreaker(DefaultBreakerConfig())
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			br.Record(true)
		}
	})
}
