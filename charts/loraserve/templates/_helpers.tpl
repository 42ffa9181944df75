{{/* Names, labels and image of the LoRAServe chart. */}}

{{- define "loraserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "loraserve.labels" -}}
helm.sh/chart: {{ include "loraserve.chart" . }}
{{ include "loraserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: loraserve
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "loraserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "loraserve.runtimeImage" -}}
{{- default (include "loraserve.image" .) .Values.operator.runtimeImage }}
{{- end }}

{{- define "loraserve.webhookServiceName" -}}
{{- printf "%s-webhook" (include "loraserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraserve.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "loraserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraserve.peeringKind" -}}
{{- if .Values.watch.namespaces }}KopfPeering{{ else }}ClusterKopfPeering{{ end }}
{{- end }}

{{- define "loraserve.peered" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{- /* A map as comma-separated key=value pairs, sorted by key. */}}
{{- define "loraserve.keyValues" -}}
{{- $pairs := list }}
{{- range $k, $v := . }}{{ $pairs = append $pairs (printf "%s=%s" $k $v) }}{{ end }}
{{- join "," $pairs }}
{{- end }}
