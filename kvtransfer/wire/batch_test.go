package wire

import (
	"bytes"
	"net"
	"testing"
)

// TestDataBatchOverTCP: many DATA frames of every size (more than one
// writev's worth), read back frame by frame, small ones straight past the
// read buffer.
func TestDataBatchOverTCP(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var pieces []DataPiece
	src := make([]byte, MaxDataLen)
	for i := range src {
		src[i] = byte(i*31 + i>>10)
	}
	for i := range 1500 {
		n := (i * 977) % (48 << 10)
		pieces = append(pieces, DataPiece{Region: uint32(i), Offset: uint64(i) << 20, Data: src[i : i+n]})
	}
	pieces = append(pieces, DataPiece{Region: 9999, Data: src}) // a whole 8 MiB frame
	errc := make(chan error, 1)
	go func() {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			errc <- err
			return
		}
		defer c.Close()
		errc <- NewConn(c).WriteDataThen(pieces, nil)
	}()
	nc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	conn := NewConn(nc)
	for i, p := range pieces {
		m, err := conn.Read()
		if err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		d, ok := m.(*Data)
		if !ok || d.Region != p.Region || d.Offset != p.Offset || int(d.N) != len(p.Data) {
			t.Fatalf("frame %d: %+v, want region %d offset %d len %d", i, m, p.Region, p.Offset, len(p.Data))
		}
		got := make([]byte, d.N)
		if err := conn.ReadData(got); err != nil || !bytes.Equal(got, p.Data) {
			t.Fatalf("frame %d payload: %v", i, err)
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if err := NewConn(nc).WriteDataThen([]DataPiece{{Data: make([]byte, MaxDataLen+1)}}, nil); err == nil {
		t.Fatal("an oversized piece was sent")
	}
}
