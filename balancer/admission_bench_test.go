package balancer

import (
	"context"
	"testing"
	"time"
)

func BenchmarkAdmissionAcquireRelease(b *testing.B) {
	a := NewAdmission(AdmissionConfig{MaxConcurrent: 1 << 20, QueueSize: 100, QueueTimeout: time.Second})
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			rel, err := a.Acquire(ctx)
			if err != nil {
				b.Fatal(err)
			}
			rel()
		}
	})
}
