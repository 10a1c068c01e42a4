package router

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http/httputil"
	"strconv"
	"sync"

	"github.com/valyala/fasthttp"
)

// leftBodyHeader marks a request whose body frameBody left on the
// connection; its value is the body's length, -1 for chunked. A client's
// own is removed; forwardHeaders never sends it on.
const leftBodyHeader = "Pdrouter-Left-Body"

// frameBody runs once a head is read, before fasthttp reads the
// body: a chunked body, or one larger than smallBody and within the limit,
// is left on the connection for readBody, and fasthttp reads none of it.
// A small body arrives with its head and stays in fasthttp's pooled buffer;
// fasthttp refuses one over the limit from its Content-Length.
func (s *Server) frameBody(h *fasthttp.RequestHeader) {
	h.Del(leftBodyHeader)
	n := h.ContentLength()
	if n != -1 && (n <= smallBody || n > s.cfg.MaxPayloadSize) {
		return
	}
	var v [20]byte
	h.SetContentLength(0)
	h.SetBytesV(leftBodyHeader, strconv.AppendInt(v[:0], int64(n), 10))
}

// leftBody is the length of the body frameBody left on the connection.
func leftBody(h *fasthttp.RequestHeader) (int, bool) {
	v := h.Peek(leftBodyHeader)
	if v == nil {
		return 0, false
	}
	n, err := strconv.Atoi(bstr(v))
	return n, err == nil
}

// readLeftBody reads the body frameBody left on the connection.
func (s *Server) readLeftBody(ctx *fasthttp.RequestCtx, n int) *apiError {
	ctx.Request.Header.Del(leftBodyHeader) // read: the connection may be kept
	hc := clientHeadConn(ctx.Conn())
	if hc == nil { // frameBody runs for headConns only
		return &apiError{Status: 500, Code: "internal_error", Message: "request body not readable"}
	}
	if n >= 0 {
		defer hc.bodyDone(nil)
		return s.setBody(ctx, n, bodyReader{hc})
	}
	br := chunkReaders.Get().(*bufio.Reader)
	br.Reset(bodyReader{hc})
	defer func() {
		br.Reset(nil)
		chunkReaders.Put(br)
	}()
	if e := s.setBody(ctx, -1, &trailedChunks{br: br, chunks: httputil.NewChunkedReader(br), limit: s.cfg.MaxHeaderSize}); e != nil {
		return e
	}
	unread, _ := br.Peek(br.Buffered())
	hc.bodyDone(unread)
	return nil
}

// unconsumedBody makes the connection close after a response sent without
// reading the body frameBody left on it: its bytes are no next request.
func unconsumedBody(ctx *fasthttp.RequestCtx) {
	if _, left := leftBody(&ctx.Request.Header); left {
		ctx.SetConnectionClose()
	}
}

// bodyReader reads a body from its connection.
type bodyReader struct{ c *headConn }

func (r bodyReader) Read(p []byte) (int, error) { return r.c.readBody(p) }

// chunkReaders hold the framing of chunked bodies while they are read.
var chunkReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}

// trailedChunks decodes a chunked body and reads its trailer section (up
// to limit bytes; dropped, as fasthttp's merge of it into the head would
// be for the router) before it ends, so nothing of the body is left to
// read.
type trailedChunks struct {
	br     *bufio.Reader
	chunks io.Reader
	limit  int
	done   bool
}

var errTrailerTooLarge = errors.New("chunked body trailer too large")

func (t *trailedChunks) Read(p []byte) (int, error) {
	if t.done {
		return 0, io.EOF
	}
	n, err := t.chunks.Read(p)
	if err != io.EOF {
		return n, err
	}
	for read := 0; ; {
		line, err := t.br.ReadSlice('\n')
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return n, err
		}
		if read += len(line); read > t.limit {
			return n, errTrailerTooLarge
		}
		if len(bytes.TrimRight(line, "\r\n")) == 0 {
			t.done = true
			return n, io.EOF
		}
	}
}
