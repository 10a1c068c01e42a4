package mockworker

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// apiError is an error answered in SGLang's OpenAI-compatible error shape.
type apiError struct {
	status  int
	message string
}

func errorf(status int, format string, args ...any) *apiError {
	return &apiError{status: status, message: fmt.Sprintf(format, args...)}
}

// errorType names an HTTP status the way SGLang's error bodies do,
// e.g. 400 -> "BadRequestError".
func errorType(status int) string {
	t := strings.ReplaceAll(http.StatusText(status), " ", "")
	if t == "" {
		t = "Status" + strconv.Itoa(status)
	}
	return strings.TrimSuffix(t, "Error") + "Error"
}

// errorBody is {"object":"error","message":...,"type":...,"param":null,"code":N}.
func errorBody(status int, message string) []byte {
	b := make([]byte, 0, 96+len(message))
	b = append(b, `{"object":"error","message":`...)
	msg, _ := json.Marshal(message) // a string always marshals
	b = append(b, msg...)
	b = append(b, `,"type":"`...)
	b = append(b, errorType(status)...)
	b = append(b, `","param":null,"code":`...)
	b = strconv.AppendInt(b, int64(status), 10)
	return append(b, '}')
}

func writeError(w http.ResponseWriter, e *apiError) error {
	return writeJSONBytes(w, e.status, errorBody(e.status, e.message))
}

func writeJSONBytes(w http.ResponseWriter, status int, body []byte) error {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, err := w.Write(body)
	return err
}
