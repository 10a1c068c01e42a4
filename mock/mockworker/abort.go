package mockworker

import (
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"time"
)

// RecordedAbort is one POST /abort_request as the mock received it.
type RecordedAbort struct {
	RID        string `json:"rid"`
	AbortAll   bool   `json:"abort_all,omitempty"`
	UnixNano   int64  `json:"unix_nano"`
	AuthHeader string `json:"authorization,omitempty"`
}

// abortLog keeps every abort since start or the last Reset (aborts are rare
// and tests read them all).
type abortLog struct {
	mu   sync.Mutex
	list []RecordedAbort
}

// Aborts returns the aborts received, oldest first.
func (s *Server) Aborts() []RecordedAbort {
	s.aborts.mu.Lock()
	defer s.aborts.mu.Unlock()
	return append([]RecordedAbort(nil), s.aborts.list...)
}

func (l *abortLog) reset() {
	l.mu.Lock()
	l.list = nil
	l.mu.Unlock()
}

// abortRequest is SGLang's POST /abort_request: body AbortReq {"rid": str,
// "abort_all": bool}, answered 200 with an empty body whether or not the
// rid is known.
func (s *Server) abortRequest(w http.ResponseWriter, r *http.Request) {
	var req struct {
		RID      string `json:"rid"`
		AbortAll bool   `json:"abort_all"`
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err == nil {
		err = json.Unmarshal(body, &req)
	}
	if err != nil {
		_ = writeError(w, badRequest("abort_request: %v", err))
		return
	}
	s.aborts.mu.Lock()
	s.aborts.list = append(s.aborts.list, RecordedAbort{RID: req.RID, AbortAll: req.AbortAll,
		UnixNano: time.Now().UnixNano(), AuthHeader: r.Header.Get("Authorization")})
	s.aborts.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func (s *Server) mockAborts(w http.ResponseWriter, _ *http.Request) { s.writeAny(w, s.Aborts()) }
