// Package chunked finds where an HTTP/1.1 chunked body (RFC 9112 §7.1)
// ends as its bytes pass, without copying or decoding them: a proxy that
// forwards a body as it arrives needs only that. It checks the chunk-size
// lines and counts the data; chunk extensions and trailer fields are
// skipped, not interpreted.
package chunked

import "errors"

// ErrFraming is a chunk-size line that is not one.
var ErrFraming = errors.New("bad chunked framing")

// maxSizeDigits bounds a chunk size to 15 hex digits: it fits an int64.
const maxSizeDigits = 15

const (
	inSize    = iota // a chunk-size's hex digits
	inExt            // the rest of its line: extensions, CR
	inData           // the chunk's data
	inDataEnd        // the CRLF after the data
	inTrailer        // trailer lines, up to the empty one
)

// Scanner follows one chunked body; the zero value is at its start.
type Scanner struct {
	state, digits, lineLen int
	size                   int64
	done                   bool
}

// Done reports whether the body has ended.
func (c *Scanner) Done() bool { return c.done }

// Scan takes the body's next bytes and returns how many of them belong to
// it: all of p, or up to the body's end once Done.
func (c *Scanner) Scan(p []byte) (int, error) {
	for i := 0; i < len(p) && !c.done; i++ {
		b := p[i]
		switch c.state {
		case inSize, inExt:
			switch d := hexValue(b); {
			case b == '\n':
				if c.digits == 0 {
					return 0, ErrFraming
				}
				c.state, c.digits, c.lineLen = inData, 0, 0
				if c.size == 0 {
					c.state = inTrailer
				}
			case c.state == inSize && d >= 0:
				if c.digits++; c.digits > maxSizeDigits {
					return 0, ErrFraming
				}
				c.size = c.size<<4 | int64(d)
			case c.state == inSize && (b == ';' || b == ' ' || b == '\t' || b == '\r'):
				c.state = inExt
			case c.state == inSize:
				return 0, ErrFraming
			}
		case inData:
			k := min(int64(len(p)-i), c.size)
			c.size -= k
			i += int(k) - 1
			if c.size == 0 {
				c.state = inDataEnd
			}
		case inDataEnd:
			if b == '\n' {
				c.state = inSize
			}
		case inTrailer:
			if b == '\n' {
				if c.lineLen == 0 {
					c.done = true
					return i + 1, nil
				}
				c.lineLen = 0
			} else if b != '\r' {
				c.lineLen++
			}
		}
	}
	if c.done {
		return 0, nil
	}
	return len(p), nil
}

func hexValue(b byte) int {
	switch {
	case '0' <= b && b <= '9':
		return int(b - '0')
	case 'a' <= b && b <= 'f':
		return int(b-'a') + 10
	case 'A' <= b && b <= 'F':
		return int(b-'A') + 10
	}
	return -1
}
