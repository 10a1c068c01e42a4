// Package redact keeps credentials out of logs: every entry a wrapped
// logger writes has credential header values and bearer tokens replaced.
package redact

import (
	"regexp"
	"strings"
	"unicode"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Every log line of a wrapped logger goes through core: values of
// credential headers (and bearer tokens anywhere) are replaced before any
// encoder, console or --json-log, sees them. The router logs no request
// heads on purpose (fasthttp's errors run with SecureErrorLogMessage), so
// this is the net for what a library, an error string or a future log line
// carries by accident.

const mark = "[REDACTED]"

// secretHeader matches "Name: value" or "Name=value" for the credential
// headers, up to the end of the line or of a quoted or listed value.
var secretHeader = regexp.MustCompile(`(?i)\b(authorization|proxy-authorization|cookie|set-cookie|x-api-key|api-key|x-auth-token|x-amz-security-token)(\s*[:=]\s*)[^\r\n"',;]*`)

// bearer matches a bearer or basic credential on its own.
var bearer = regexp.MustCompile(`(?i)\b(bearer\s+[A-Za-z0-9._~+/=-]+|basic\s+[A-Za-z0-9+/]{8,}={0,2})`)

// Secrets returns s with credential values replaced.
func Secrets(s string) string {
	s = secretHeader.ReplaceAllString(s, "${1}${2}"+mark)
	return bearer.ReplaceAllStringFunc(s, func(m string) string {
		return m[:strings.IndexFunc(m, unicode.IsSpace)] + " " + mark
	})
}

// Logger makes every entry log writes redacted.
func Logger(log *zap.Logger) *zap.Logger {
	return log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core { return core{c} }))
}

type core struct{ zapcore.Core }

func (c core) With(fields []zapcore.Field) zapcore.Core {
	return core{c.Core.With(redactFields(fields))}
}

func (c core) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c core) Write(e zapcore.Entry, fields []zapcore.Field) error {
	e.Message = Secrets(e.Message)
	return c.Core.Write(e, redactFields(fields))
}

// redactFields rewrites the fields that carry text: strings, byte strings,
// errors (as their message) and stringers.
func redactFields(fields []zapcore.Field) []zapcore.Field {
	out := fields
	for i, f := range fields {
		var text string
		switch f.Type {
		case zapcore.StringType:
			text = f.String
		case zapcore.ByteStringType:
			text = string(f.Interface.([]byte))
		case zapcore.ErrorType:
			if err, ok := f.Interface.(error); ok && err != nil {
				text = err.Error()
			}
		case zapcore.StringerType:
			if s, ok := f.Interface.(interface{ String() string }); ok {
				text = s.String()
			}
		default:
			continue
		}
		clean := Secrets(text)
		if clean == text && f.Type == zapcore.StringType {
			continue
		}
		if &out[0] == &fields[0] {
			out = append([]zapcore.Field(nil), fields...) // never edit the caller's slice
		}
		out[i] = zap.String(f.Key, clean)
	}
	return out
}
