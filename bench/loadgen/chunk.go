package loadgen

import (
	"errors"

	"github.com/pdrouter/pdrouter/router/splice"
)

// chunk is what one streamed (or whole non-streamed) JSON reply says about generation progress.
type chunk struct {
	content bool // carries non-empty generated text
	tokens  int  // cumulative completion tokens the server reported (usage or meta_info), -1 if none
	err     bool // an {"error": ...} object instead of a completion
}

var errBadJSON = errors.New("malformed JSON chunk")

// parseChunk reads the few fields that matter from an OpenAI chat/completions chunk or an SGLang
// /generate chunk with a splice.Walker, without unmarshalling or allocating:
//
//	choices[0].delta.content, choices[0].delta.reasoning_content, choices[0].text,
//	choices[0].message.content, text              → content
//	usage.completion_tokens, meta_info.completion_tokens → tokens
//	error (not null)                                    → err
func parseChunk(b []byte) (chunk, error) {
	c := chunk{tokens: -1}
	w := splice.NewWalker(b)
	content := func() error {
		s, _, err := w.String()
		c.content = c.content || len(s) > 0
		return err
	}
	if w.Peek() != '{' {
		return c, errBadJSON
	}
	err := w.Object(func(key []byte) error {
		switch string(key) {
		case "choices":
			return w.Array(func(i int) error {
				if i > 0 {
					return w.Skip()
				}
				return w.Object(func(key []byte) error {
					switch string(key) {
					case "text":
						return content()
					case "delta", "message":
						return w.Object(func(key []byte) error {
							if string(key) == "content" || string(key) == "reasoning_content" {
								return content()
							}
							return w.Skip()
						})
					}
					return w.Skip()
				})
			})
		case "text":
			return content()
		case "usage", "meta_info":
			return w.Object(func(key []byte) error {
				if string(key) != "completion_tokens" {
					return w.Skip()
				}
				n, ok, err := w.Int()
				if ok {
					c.tokens = n
				}
				return err
			})
		case "error":
			c.err = w.Peek() != 'n'
			return w.Skip()
		}
		return w.Skip()
	})
	if err == nil {
		err = w.End()
	}
	if err != nil {
		return chunk{tokens: -1}, errBadJSON
	}
	return c, nil
}
