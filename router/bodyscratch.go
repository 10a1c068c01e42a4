package router

// bodyScratch is memory a chunked body grows into without copies: address
// space reserved up to the limit (reserve), of which only the pages
// written are resident, handed back to the OS once the body is copied out.
// Where nothing can be reserved it is a heap slice grown by append.
type bodyScratch struct {
	mem      []byte
	reserved bool
}

func newBodyScratch(limit int) *bodyScratch {
	if mem, err := reserve(limit); err == nil {
		return &bodyScratch{mem: mem[:0], reserved: true}
	}
	return &bodyScratch{mem: make([]byte, 0, 2*smallBody)}
}

func (s *bodyScratch) len() int { return len(s.mem) }

func (s *bodyScratch) append(b []byte) { s.mem = append(s.mem, b...) }

// tail is where the next read goes; grow(n) then takes n bytes of it.
func (s *bodyScratch) tail() []byte {
	if len(s.mem) == cap(s.mem) && !s.reserved {
		s.mem = append(s.mem, 0)[:len(s.mem)]
	}
	return s.mem[len(s.mem):cap(s.mem)]
}

func (s *bodyScratch) grow(n int) { s.mem = s.mem[:len(s.mem)+n] }

// copy returns the body in a buffer of its exact size.
func (s *bodyScratch) copy() []byte {
	if !s.reserved {
		return s.mem
	}
	return append([]byte(nil), s.mem...)
}

func (s *bodyScratch) free() {
	if s.reserved {
		unreserve(s.mem[:cap(s.mem)])
		s.mem, s.reserved = nil, false
	}
}
