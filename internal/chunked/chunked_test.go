package chunked

import (
	"bytes"
	"errors"
	"net/http/httputil"
	"testing"
)

// encode frames body as chunks of at most size bytes, with trailer lines.
func encode(body []byte, size int, trailer string) []byte {
	var b bytes.Buffer
	w := httputil.NewChunkedWriter(&b)
	for len(body) > 0 {
		n := min(size, len(body))
		w.Write(body[:n])
		body = body[n:]
	}
	w.Close() // the last chunk, "0\r\n"
	b.WriteString(trailer + "\r\n")
	return b.Bytes()
}

// scanAll feeds p in pieces of step bytes and returns where the body ended
// (-1: not yet).
func scanAll(t testing.TB, p []byte, step int) (int, error) {
	t.Helper()
	var c Scanner
	for at := 0; at < len(p); at += step {
		piece := p[at:min(at+step, len(p))]
		n, err := c.Scan(piece)
		if err != nil {
			return -1, err
		}
		if c.Done() {
			return at + n, nil
		}
		if n != len(piece) {
			t.Fatalf("took %d of %d bytes before the end", n, len(piece))
		}
	}
	return -1, nil
}

func TestScannerFindsTheEnd(t *testing.T) {
	cases := []struct {
		name string
		body []byte
	}{
		{"plain", encode([]byte("hello, world"), 5, "")},
		{"empty", encode(nil, 1, "")},
		{"trailers", encode([]byte("data"), 3, "X-A: 1\r\nX-B: 2\r\n")},
		{"extension", []byte("4;name=value\r\nabcd\r\n0\r\n\r\n")},
		{"upper hex", append(append([]byte("1A\r\n"), bytes.Repeat([]byte("x"), 26)...), "\r\n0\r\n\r\n"...)},
	}
	for _, tc := range cases {
		for _, step := range []int{1, 2, 3, 7, len(tc.body)} {
			next := append(bytes.Clone(tc.body), "GET / HTTP/1.1\r\n"...) // the next message
			end, err := scanAll(t, next, step)
			if err != nil || end != len(tc.body) {
				t.Errorf("%s, %d-byte pieces: end %d, %v; want %d", tc.name, step, end, err, len(tc.body))
			}
		}
	}
}

func TestScannerRefusesBadSizes(t *testing.T) {
	for _, bad := range []string{"\r\n", "x\r\n", "-1\r\n", "1000000000000000\r\n"} {
		var c Scanner
		if _, err := c.Scan([]byte(bad)); !errors.Is(err, ErrFraming) {
			t.Errorf("%q: %v, want ErrFraming", bad, err)
		}
	}
}

func TestScannerTakesNothingAfterTheEnd(t *testing.T) {
	var c Scanner
	if n, err := c.Scan([]byte("0\r\n\r\n")); n != 5 || err != nil || !c.Done() {
		t.Fatalf("%d, %v, done %v", n, err, c.Done())
	}
	if n, err := c.Scan([]byte("more")); n != 0 || err != nil {
		t.Fatalf("after the end: %d, %v; want 0, nil", n, err)
	}
}

// Any bytes in any pieces: the same verdict as in one piece, and a
// well-formed encoding of the fuzzed body ends exactly where it ends.
func FuzzScanner(f *testing.F) {
	f.Add([]byte("4\r\nabcd\r\n0\r\n\r\n"), 3, uint8(2))
	f.Add([]byte("zz"), 1, uint8(1))
	f.Fuzz(func(t *testing.T, p []byte, step int, size uint8) {
		if step < 1 || step > len(p)+1 {
			step = 1
		}
		whole, wholeErr := scanAll(t, p, len(p)+1)
		split, splitErr := scanAll(t, p, step)
		if whole != split || (wholeErr == nil) != (splitErr == nil) {
			t.Fatalf("whole: %d, %v; in %d-byte pieces: %d, %v", whole, wholeErr, step, split, splitErr)
		}
		enc := encode(p, int(size)+1, "")
		if end, err := scanAll(t, append(enc, p...), step); err != nil || end != len(enc) {
			t.Fatalf("encoded %d bytes: end %d, %v; want %d", len(p), end, err, len(enc))
		}
	})
}

// The end is found wherever the bytes are cut in two.
func TestScannerEveryCut(t *testing.T) {
	msg := []byte("4\r\nabcd\r\nA;x=y\r\n0123456789\r\n0\r\nT: 1\r\n\r\nNEXT")
	bodyLen := bytes.Index(msg, []byte("NEXT"))
	for cut := 0; cut <= len(msg); cut++ {
		var c Scanner
		n1, err1 := c.Scan(msg[:cut])
		n2, err2 := 0, error(nil)
		if !c.Done() {
			n2, err2 = c.Scan(msg[n1:])
		}
		if err1 != nil || err2 != nil || !c.Done() || n1+n2 != bodyLen {
			t.Fatalf("cut at %d: %d+%d bytes, done %v, errors %v %v; want %d", cut, n1, n2, c.Done(), err1, err2, bodyLen)
		}
	}
}
