{{/* Chart name. */}}
{{- define "ferrum.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release-chart, or the release name alone when it already contains the chart name. */}}
{{- define "ferrum.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ferrum.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferrum.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ferrum.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "ferrum.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferrum
{{- end -}}

{{- define "ferrum.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ferrum.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ferrum.image" -}}
{{- $variant := ternary "cuda" "cpu" .Values.gpu.enabled -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $variant) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The server's config.yaml: models plus serve flags by their long names. */}}
{{- define "ferrum.config" -}}
{{- $cfg := dict
  "models" .Values.models
  "host" "0.0.0.0"
  "port" (int .Values.ports.grpc)
  "metrics_port" (ternary (int .Values.ports.metrics) 0 .Values.metrics.enabled)
  "device" .Values.device
  "dtype" .Values.dtype
  "kv_budget_tokens" (int .Values.kvBudgetTokens)
  "max_message_bytes" (int .Values.maxMessageBytes)
  "max_batch" (int .Values.maxBatch)
  "grace_period" .Values.gracePeriodSeconds
  "stall_timeout" .Values.stallTimeoutSeconds
  "log_format" .Values.logFormat
  "log_level" .Values.logLevel
  "reflection" .Values.reflection
  "trust_remote_code" .Values.trustRemoteCode -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $cfg "tls_cert" "/etc/ferrum/tls/tls.crt" -}}
{{- $_ := set $cfg "tls_key" "/etc/ferrum/tls/tls.key" -}}
{{- if .Values.tls.mutual -}}
{{- $_ := set $cfg "tls_client_ca" "/etc/ferrum/tls/ca.crt" -}}
{{- end -}}
{{- end -}}
{{- if .Values.auth.existingSecret -}}
{{- $_ := set $cfg "auth_token_file" (printf "/etc/ferrum/auth/%s" .Values.auth.key) -}}
{{- end -}}
{{- if .Values.adminAuth.existingSecret -}}
{{- $_ := set $cfg "admin_token_file" (printf "/etc/ferrum/admin/%s" .Values.adminAuth.key) -}}
{{- end -}}
{{- if .Values.gateway.sharedPrefixCache -}}
{{- if not .Values.gateway.enabled -}}
{{- fail "gateway.sharedPrefixCache needs gateway.enabled (without the gateway, set extraConfig.vllm_shared_prefix_cache)" -}}
{{- end -}}
{{- $_ := set $cfg "vllm_shared_prefix_cache" true -}}
{{- end -}}
{{- if and .Values.gateway.enabled .Values.gateway.openWorkerAdminRpcs -}}
{{- $_ := set $cfg "open_admin_rpcs" true -}}
{{- end -}}
{{- if .Values.hub.token.existingSecret -}}
{{- $_ := set $cfg "hub_token_file" (printf "/etc/ferrum/hub/%s" .Values.hub.token.key) -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite $cfg .Values.extraConfig) -}}
{{- end -}}

{{/* One probe: native gRPC, or the TLS-capable exec check when TLS is on (kubelet gRPC probes are plaintext). */}}
{{- define "ferrum.probe" -}}
{{- $root := index . 0 -}}
{{- $p := index . 1 -}}
{{- $service := "" -}}
{{- if gt (len .) 2 -}}{{- $service = index . 2 -}}{{- end -}}
{{- if $root.Values.tls.enabled -}}
exec:
  command: ["python", "/opt/ferrum/healthcheck.py", {{ $root.Values.ports.grpc | quote }}, {{ $service | quote }}]
{{- else -}}
grpc:
  port: {{ $root.Values.ports.grpc }}
  service: {{ $service | quote }}
{{- end }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ $p.timeoutSeconds }}
failureThreshold: {{ $p.failureThreshold }}
{{- end -}}

{{/* The gateway's own labels: a different app name, so the workers' selectors never match its pods. */}}
{{- define "ferrum.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-gateway" (include "ferrum.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ferrum.gatewayLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "ferrum.gatewaySelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferrum
{{- end -}}

{{/* The labels of the worker pods the gateway discovers (plain, both-role workers). */}}
{{- define "ferrum.workerSelector" -}}
{{ include "ferrum.selectorLabels" . }}
app.kubernetes.io/component: model-executor
{{- end -}}
