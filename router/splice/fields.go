package splice

// FindFields locates the top-level members of body named keys in one pass:
// out[k] is the value of keys[k] (the last one when a key repeats, as a
// JSON decoder keeps), or absent. body should have passed Inspect; on
// anything else FindFields stops where the JSON breaks, leaving the keys
// not yet seen absent.
func FindFields(body []byte, keys []string, out []Span) {
	clear(out)
	s := scanner{b: body}
	s.skipWS()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return
	}
	s.i++
	s.skipWS()
	for s.i < len(s.b) && s.b[s.i] == '"' {
		keyStart := s.i
		if s.str() != nil {
			return
		}
		key := s.b[keyStart+1 : s.i-1]
		s.skipWS()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return
		}
		s.i++
		s.skipWS()
		valStart := s.i
		if s.value(1) != nil {
			return
		}
		for k, name := range keys {
			if bstr(key) == name {
				out[k] = Span{int32(valStart), int32(s.i)}
			}
		}
		if done, err := s.next('}'); done || err != nil {
			return
		}
		s.skipWS()
	}
}
