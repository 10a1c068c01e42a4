package loadgen

import "errors"

// chunk is what one streamed (or whole non-streamed) JSON reply says about generation progress.
type chunk struct {
	content bool // carries non-empty generated text
	tokens  int  // cumulative completion tokens the server reported (usage or meta_info), -1 if none
	err     bool // an {"error": ...} object instead of a completion
}

var errBadJSON = errors.New("malformed JSON chunk")

// maxDepth bounds nesting while skipping values, so hostile input cannot blow the stack or loop long.
const maxDepth = 64

// parseChunk reads the few fields that matter from an OpenAI chat/completions chunk or an SGLang
// /generate chunk without unmarshalling or allocating:
//
//	choices[0].delta.content, choices[0].delta.reasoning_content, choices[0].text,
//	choices[0].message.content, text              → content
//	usage.completion_tokens, meta_info.completion_tokens → tokens
//	error (not null)                                    → err
func parseChunk(b []byte) (chunk, error) {
	c := chunk{tokens: -1}
	s := scanner{b: b}
	if s.peek() != '{' {
		return c, errBadJSON
	}
	err := s.object(func(key []byte) error {
		switch string(key) {
		case "choices":
			return s.array(func(i int) error {
				if i > 0 {
					return s.skip()
				}
				return s.object(func(key []byte) error {
					switch string(key) {
					case "text":
						return s.nonEmptyString(&c.content)
					case "delta", "message":
						return s.object(func(key []byte) error {
							if string(key) == "content" || string(key) == "reasoning_content" {
								return s.nonEmptyString(&c.content)
							}
							return s.skip()
						})
					}
					return s.skip()
				})
			})
		case "text":
			return s.nonEmptyString(&c.content)
		case "usage", "meta_info":
			return s.object(func(key []byte) error {
				if string(key) == "completion_tokens" {
					return s.int(&c.tokens)
				}
				return s.skip()
			})
		case "error":
			c.err = s.peek() != 'n'
			return s.skip()
		}
		return s.skip()
	})
	if err != nil {
		return chunk{tokens: -1}, err
	}
	if s.ws(); s.i != len(s.b) {
		return chunk{tokens: -1}, errBadJSON
	}
	return c, nil
}

// scanner walks JSON bytes. Strings are compared raw (escapes kept): the keys we look for have none.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) peek() byte {
	s.ws()
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

// object calls field for each key with the scanner at the value, which field must consume. Any
// other value (usage is null on all but the last OpenAI chunk) is skipped: a field of an
// unexpected type carries nothing we count, and is no reason to fail the request.
func (s *scanner) object(field func(key []byte) error) error {
	if s.peek() != '{' {
		return s.skip()
	}
	s.i++
	if s.peek() == '}' {
		s.i++
		return nil
	}
	for {
		key, err := s.str()
		if err != nil {
			return err
		}
		if s.peek() != ':' {
			return errBadJSON
		}
		s.i++
		if err := field(key); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
			s.ws()
		case '}':
			s.i++
			return nil
		default:
			return errBadJSON
		}
	}
}

// array calls elem for each element with the scanner at it; any other value is skipped.
func (s *scanner) array(elem func(i int) error) error {
	if s.peek() != '[' {
		return s.skip()
	}
	s.i++
	if s.peek() == ']' {
		s.i++
		return nil
	}
	for i := 0; ; i++ {
		if err := elem(i); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case ']':
			s.i++
			return nil
		default:
			return errBadJSON
		}
	}
}

// str consumes a string and returns its raw contents.
func (s *scanner) str() ([]byte, error) {
	if s.peek() != '"' {
		return nil, errBadJSON
	}
	start := s.i + 1
	for j := start; j < len(s.b); j++ {
		switch s.b[j] {
		case '\\':
			j++
		case '"':
			s.i = j + 1
			return s.b[start:j], nil
		}
	}
	return nil, errBadJSON
}

// nonEmptyString sets *set when the value is a non-empty string; other values are skipped.
func (s *scanner) nonEmptyString(set *bool) error {
	if s.peek() != '"' {
		return s.skip()
	}
	v, err := s.str()
	if len(v) > 0 {
		*set = true
	}
	return err
}

// int reads a non-negative integer (a fraction or exponent is skipped); other values are skipped.
func (s *scanner) int(v *int) error {
	if c := s.peek(); c < '0' || c > '9' {
		return s.skip()
	}
	n := 0
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		if n < 1<<40 {
			n = n*10 + int(s.b[s.i]-'0')
		}
		s.i++
	}
	*v = n
	return s.skipNumberTail()
}

func (s *scanner) skipNumberTail() error {
	for s.i < len(s.b) {
		switch c := s.b[s.i]; {
		case c >= '0' && c <= '9', c == '.', c == 'e', c == 'E', c == '+', c == '-':
			s.i++
		default:
			return nil
		}
	}
	return nil
}

// skip consumes one value of any kind.
func (s *scanner) skip() error {
	depth := 0
	for {
		switch c := s.peek(); c {
		case '"':
			if _, err := s.str(); err != nil {
				return err
			}
		case '{', '[':
			if depth++; depth > maxDepth {
				return errBadJSON
			}
			s.i++
			continue
		case '}', ']':
			if depth == 0 {
				return errBadJSON
			}
			depth--
			s.i++
		case ',', ':':
			if depth == 0 {
				return errBadJSON
			}
			s.i++
			continue
		case 't', 'f', 'n':
			lit := "null"
			if c == 't' {
				lit = "true"
			} else if c == 'f' {
				lit = "false"
			}
			if len(s.b)-s.i < len(lit) || string(s.b[s.i:s.i+len(lit)]) != lit {
				return errBadJSON
			}
			s.i += len(lit)
		case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
			s.i++
			if err := s.skipNumberTail(); err != nil {
				return err
			}
		default:
			return errBadJSON
		}
		if depth == 0 {
			return nil
		}
	}
}
