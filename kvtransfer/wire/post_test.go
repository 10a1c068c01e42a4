package wire

import (
	"net"
	"testing"
	"time"
)

func tcpPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// TestPostWritesAtOnceWhenFree: with no writer on the connection, Post
// writes the frame before it returns (no goroutine to start and wake).
func TestPostWritesAtOnceWhenFree(t *testing.T) {
	a, b := tcpPair(t)
	w, r := NewConn(a), NewConn(b)
	for seq := uint64(1); seq <= 50; seq++ {
		w.Post(&MemFenceAck{Seq: seq})
		w.pmu.Lock()
		queued, flushing := len(w.posted), w.flushing
		w.pmu.Unlock()
		if queued != 0 || flushing || len(w.rest) != 0 {
			t.Fatalf("Post %d left %d frames queued (flushing %t, %d bytes unsent)", seq, queued, flushing, len(w.rest))
		}
		m, err := r.Read()
		if ack, ok := m.(*MemFenceAck); err != nil || !ok || ack.Seq != seq {
			t.Fatalf("frame %d: %+v %v", seq, m, err)
		}
	}
}

// TestPostIntoAFullSocketNeitherBlocksNorReorders: while the peer reads
// nothing, Post returns at once however much is queued; what a socket took
// only in part is sent whole and in order once the peer reads, before a
// frame written later.
func TestPostIntoAFullSocketNeitherBlocksNorReorders(t *testing.T) {
	a, b := tcpPair(t)
	w, r := NewConn(a), NewConn(b)
	regions := make([]MemRegion, 2000) // ~70 KB a frame
	for i := range regions {
		regions[i] = MemRegion{ID: uint32(i + 1), Base: uint64(i+1) << 12, Len: 1 << 12}
	}
	const posts = 200 // ~14 MB: more than the socket buffers hold
	start := time.Now()
	for seq := uint64(1); seq <= posts; seq++ {
		w.Post(&MemRegions{Seq: seq, Regions: regions})
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Posts into a full socket took %v", d)
	}
	later := make(chan error, 1)
	go func() { later <- w.Write(&MemFence{Seq: posts + 1}) }()
	for seq := uint64(1); seq <= posts; seq++ {
		m, err := r.Read()
		if rs, ok := m.(*MemRegions); err != nil || !ok || rs.Seq != seq || len(rs.Regions) != len(regions) {
			t.Fatalf("frame %d: %T %v", seq, m, err)
		}
	}
	if m, err := r.Read(); err != nil || m.(*MemFence).Seq != posts+1 {
		t.Fatalf("the frame written after the posts: %+v %v", m, err)
	}
	if err := <-later; err != nil {
		t.Fatal(err)
	}
}

// TestWriteDataThen: DATA frames then the control frame, in order, over
// several writevs when the batch needs them.
func TestWriteDataThen(t *testing.T) {
	a, b := tcpPair(t)
	w, r := NewConn(a), NewConn(b)
	small := []DataPiece{{Region: 1, Offset: 8, Data: []byte("sixty-four")}}
	big := make([]DataPiece, 600) // more than one writev's 512 frames
	for i := range big {
		big[i] = DataPiece{Region: uint32(i), Data: []byte{byte(i)}}
	}
	errc := make(chan error, 1)
	go func() {
		err := w.WriteDataThen(small, &MemFence{Seq: 1})
		if err == nil {
			err = w.WriteDataThen(big, &MemFence{Seq: 2})
		}
		if err == nil {
			err = w.WriteDataThen(nil, &MemFence{Seq: 3})
		}
		errc <- err
	}()
	for seq, batch := range [][]DataPiece{small, big, nil} {
		for i, p := range batch {
			m, err := r.Read()
			d, ok := m.(*Data)
			if err != nil || !ok || d.Region != p.Region || d.Offset != p.Offset || int(d.N) != len(p.Data) {
				t.Fatalf("batch %d frame %d: %+v %v", seq, i, m, err)
			}
			got := make([]byte, d.N)
			if err := r.ReadData(got); err != nil || string(got) != string(p.Data) {
				t.Fatalf("batch %d frame %d: %q %v", seq, i, got, err)
			}
		}
		m, err := r.Read()
		if f, ok := m.(*MemFence); err != nil || !ok || f.Seq != uint64(seq+1) {
			t.Fatalf("fence %d: %+v %v", seq+1, m, err)
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}
