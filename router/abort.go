package router

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/router/splice"
)

// Closing a leg's connection frees the router's side only: SGLang keeps
// prefilling or decoding a request whose client left (and its own router
// never aborts PD requests, sgl-project/sglang#39461). So a leg cut short,
// the client gone, the request timed out or its attempt abandoned, tells
// its engine to drop the request by the rid both legs carry: SGLang's
// POST /abort_request {"rid": …}, fire and forget, bounded by
// Config.AbortTimeout, off every request's path.

// Bounds on the work aborts may make: a storm of departures sheds aborts
// (the engines then finish the work) rather than piling up goroutines.
const (
	maxAbortsInFlight = 512
	maxAbortsPerLeg   = 64 // rids of one batch request
)

// engineRID is the request id a leg's engine knows the request by: its
// JSON value, in a buffer that lives as long as the leg, and the batch
// size SGLang expands a string rid by. The zero value sends no abort.
type engineRID struct {
	val   []byte
	batch int
}

// engineAborts counts the abort calls under way. Once closed (the end of
// Shutdown) none starts: it would outlive the Shutdown that waited for them.
type engineAborts struct {
	inFlight atomic.Int32
	mu       sync.Mutex
	closed   bool
}

// close stops new aborts; those under way are in s.background.
func (a *engineAborts) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closed = true
}

// setRID gives b, the body a leg sends, the rid the engine will know the
// request by: the client's (copied: the leg may outlive the handler), else a
// fresh one set on b, which costs no copy of the body. With aborts off a
// body without a rid is sent as it is.
//
// A retry sends the client's rid with "-retry<n>" appended: SGLang's
// scheduler aborts every request whose rid starts with the one named, and
// refuses a rid it still holds, so attempts must not share one. The first
// keeps the client's as it is; its abort is sent before the retry is
// (request.settle), so it cannot reach the retry's longer rid.
func (s *Server) setRID(r *request, b *splice.Body, batch int) engineRID {
	var val []byte
	switch {
	case r.info.RID.OK():
		val = r.body[r.info.RID.Start:r.info.RID.End]
		if own := splice.SuffixRID(val, retrySuffix(r.attempt)); r.attempt > 0 && own != nil {
			b.Set("rid", r.info.RID, own)
			val = own
		} else {
			val = bytes.Clone(val)
		}
	case s.cfg.AbortTimeout > 0:
		val = splice.SetNewRID(b)
	}
	if s.cfg.AbortTimeout == 0 {
		return engineRID{}
	}
	return engineRID{val, batch}
}

func retrySuffix(attempt int) string { return "-retry" + strconv.Itoa(attempt) }

// abortIfHeld is called as l closes: an engine that was sent the request
// and has not finished answering it still holds it if the leg's scope was
// cut short, or if its send failed once the request may have reached it.
func (l *leg) abortIfHeld() {
	if l.rid.val == nil || l.sc == nil || (l.sc.Cause() == nil && !l.lost) {
		return
	}
	if l.resp != nil && (l.resp.eof || l.resp.StatusCode/100 != 2) {
		return // the engine is done with it
	}
	// The rid may live in a body a retry is about to reuse.
	l.s.abortEngine(l.w, engineRID{bytes.Clone(l.rid.val), l.rid.batch}, l.req)
}

// abortEngine sends w the aborts for rid on a goroutine of their own,
// counted in r.aborts. That goroutine's Done may come after r's life: r
// stays pinned until then, or a recycled request's WaitGroup would take it.
// The caller is within r's life (a leg closing).
func (s *Server) abortEngine(w *balancer.Worker, rid engineRID, r *request) {
	s.aborts.mu.Lock()
	defer s.aborts.mu.Unlock()
	if s.aborts.closed {
		s.log.Warn("engine abort dropped: the router has shut down", zap.String("worker", w.URL))
		return
	}
	if s.aborts.inFlight.Add(1) > maxAbortsInFlight {
		s.aborts.inFlight.Add(-1)
		s.log.Warn("engine abort shed: too many under way", zap.String("worker", w.URL))
		return
	}
	s.background.Add(1)
	r.pin()
	r.aborts.Add(1)
	go s.sendAborts(w.BaseURL, w.APIKey, rid, r)
}

func (s *Server) sendAborts(url, apiKey string, rid engineRID, r *request) {
	defer s.background.Done()
	defer s.aborts.inFlight.Add(-1)
	defer r.unpin()
	defer r.aborts.Done()
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.AbortTimeout)
	defer cancel()
	splice.RIDs(rid.val, rid.batch, maxAbortsPerLeg, func(v []byte) {
		body := append(append(make([]byte, 0, len(v)+9), `{"rid":`...), v...)
		body = append(body, '}')
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/abort_request", bytes.NewReader(body))
		if err != nil {
			return
		}
		req.Header.Set("Content-Type", "application/json")
		if apiKey != "" {
			req.Header.Set("Authorization", "Bearer "+apiKey)
		}
		resp, err := s.infoCalls.Do(req)
		if err != nil {
			s.log.Debug("engine abort failed", zap.String("worker", url), zap.ByteString("rid", v), zap.Error(err))
			return
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			s.log.Debug("engine abort refused", zap.String("worker", url), zap.ByteString("rid", v), zap.Int("status", resp.StatusCode))
		}
	})
}
