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

{{- /*
The admission webhooks the operator serves. kopf serves each handler at /<handler id>;
the ids are the ones `loraserve.operator.webhooks` registers (a chart test keeps them in step).
*/}}
{{- define "loraserve.webhooks" -}}
- kind: Validating
  name: validate.loraserves.loraserve.io
  path: /validate-loraserve
  resource: loraserves
  operations: [CREATE, UPDATE]
- kind: Validating
  name: validate.adapters.loraserve.io
  path: /validate-adapter
  resource: adapters
  operations: [CREATE, UPDATE]
- kind: Mutating
  name: mutate.loraserves.loraserve.io
  path: /mutate-loraserve
  resource: loraserves
  operations: [CREATE, UPDATE]
- kind: Mutating
  name: mutate.adapters.loraserve.io
  path: /mutate-adapter
  resource: adapters
  operations: [CREATE, UPDATE]
{{- end }}

{{- /* The rules the operator needs in every namespace it reconciles (see rbac.yaml). */}}
{{- define "loraserve.namespacedRules" }}
- apiGroups: ["loraserve.io"]
  resources: ["loraserves", "adapters"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["loraserve.io"]
  resources: ["loraserves/status", "adapters/status"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
{{- if and (include "loraserve.peered" .) .Values.watch.namespaces }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
