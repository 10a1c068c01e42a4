package splice

// FindFields validates body as Inspect does (exactly one JSON object: the
// same errors) and locates its top-level members named keys, in one pass:
// out[k] is the value of keys[k] (the last one when a key repeats, as a
// JSON decoder keeps), or absent. On a broken body the keys not seen
// before the break are left absent.
func FindFields(body []byte, keys []string, out []Span) error {
	clear(out)
	s := scanner{b: body}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		if s.i < len(s.b) && s.value(0) == nil {
			return ErrNotObject
		}
		return ErrBadJSON
	}
	s.i++
	s.skipWS()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return s.end()
	}
	for {
		s.skipWS()
		keyStart := s.i
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return ErrBadJSON
		}
		if err := s.str(); err != nil {
			return err
		}
		key := s.b[keyStart+1 : s.i-1]
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return ErrBadJSON
		}
		s.i++
		s.skipWS()
		valStart := s.i
		if err := s.value(1); err != nil {
			return err
		}
		for k, name := range keys {
			if bstr(key) == name {
				out[k] = Span{int32(valStart), int32(s.i)}
			}
		}
		done, err := s.next('}')
		if err != nil {
			return err
		}
		if done {
			return s.end()
		}
	}
}
