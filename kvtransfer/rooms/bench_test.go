package rooms

import (
	"context"
	"testing"
)

// BenchmarkEmptyRoom is the control overhead of one room with nothing to
// move: Expect, XFER_REQ, Send(last), DONE, Success on both sides.
func BenchmarkEmptyRoom(b *testing.B) {
	for _, tr := range []string{"tcp", "shm", "ucx"} {
		b.Run(tr, func(b *testing.B) {
			pr := newPair(b, tr, nil)
			ctx := context.Background()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				room := uint64(i + 1)
				if err := pr.D.Expect(room, "boot:1", nil, -1); err != nil {
					b.Fatal(err)
				}
				if err := pr.P.Send(room, nil, true, -1); err != nil {
					b.Fatal(err)
				}
				if st, err := pr.D.Wait(ctx, room); err != nil || st.State != Success {
					b.Fatalf("%+v %v", st, err)
				}
			}
		})
	}
}
