{{- define "pdrouter.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdrouter.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdrouter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdrouter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdrouter.labels" -}}
{{ include "pdrouter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdrouter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdrouter.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace discovery watches; "" when it watches all of them. */}}
{{- define "pdrouter.watchNamespace" -}}
{{- if ne .Values.discovery.namespace "*" -}}
{{- default .Release.Namespace .Values.discovery.namespace -}}
{{- end -}}
{{- end -}}

{{/* One flag and its key=value tokens, as YAML list items. */}}
{{- define "pdrouter.selectorArgs" -}}
- {{ .flag }}
{{- range $k, $v := .selector }}
- {{ printf "%s=%s" $k $v | quote }}
{{- end }}
{{- end -}}

{{- define "pdrouter.scheme" -}}
{{- if .Values.tls.enabled }}HTTPS{{ else }}HTTP{{ end -}}
{{- end -}}
