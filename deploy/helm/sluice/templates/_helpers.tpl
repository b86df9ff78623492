{{/* Names and labels. */}}
{{- define "sluice.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sluice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "sluice.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* The Secret the chart creates for apiKey.value / hfToken.value. */}}
{{- define "sluice.secretName" -}}
{{- printf "%s-secrets" (include "sluice.fullname" .) -}}
{{- end -}}

{{- define "sluice.poolName" -}}
{{- .Values.inferencePool.name | default (include "sluice.fullname" .) -}}
{{- end -}}

{{- define "sluice.eppName" -}}
{{- printf "%s-epp" (include "sluice.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.eppServiceName" -}}
{{- if .Values.inferencePool.endpointPicker.create -}}
{{- include "sluice.eppName" . -}}
{{- else -}}
{{- required "inferencePool.endpointPicker.serviceName names your picker's Service when endpointPicker.create is false" .Values.inferencePool.endpointPicker.serviceName -}}
{{- end -}}
{{- end -}}

{{/* GPUs per pod: gpu.count, else one per tensor-parallel rank. */}}
{{- define "sluice.gpuCount" -}}
{{- if .Values.gpu.count -}}
{{- int64 .Values.gpu.count -}}
{{- else -}}
{{- int64 (index .Values.launcher "num-shard" | default 1) -}}
{{- end -}}
{{- end -}}

{{/*
A flag's value as the command line wants it: Helm reads YAML numbers as
floats, and 1073741824 would print as 1.073741824e+09.
*/}}
{{- define "sluice.flagValue" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/*
The container's args: --hostname and --port from `server`, then every set
key of `launcher` as --KEY[=VALUE] (sorted), then extraArgs.
*/}}
{{- define "sluice.args" -}}
{{- $owned := list "hostname" "port" "api-key" "prefix-caching" "web-ui" -}}
- --hostname={{ .Values.server.hostname }}
- --port={{ int64 .Values.server.port }}
{{- range $name, $value := .Values.launcher }}
{{- if has $name $owned }}
{{- fail (printf "launcher.%s: the chart sets --%s itself (see values.yaml)" $name $name) }}
{{- end }}
{{- if kindIs "bool" $value }}
{{- if $value }}
- --{{ $name }}
{{- end }}
{{- else if kindIs "slice" $value }}
{{- range $value }}
- {{ printf "--%s=%s" $name (include "sluice.flagValue" .) | quote }}
{{- end }}
{{- else if not (kindIs "invalid" $value) }}
- {{ printf "--%s=%s" $name (include "sluice.flagValue" $value) | quote }}
{{- end }}
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
terminationGracePeriodSeconds: preStop + the launcher's drain + what it
gives the router (5 s) and the shards (10 s) to exit + 5 s of margin.
*/}}
{{- define "sluice.minGracePeriod" -}}
{{- add (int64 .Values.termination.preStopSleepSeconds) (int64 (index .Values.launcher "shutdown-timeout" | default 30)) 20 -}}
{{- end -}}

{{- define "sluice.gracePeriod" -}}
{{- $min := include "sluice.minGracePeriod" . | int64 -}}
{{- if .Values.termination.gracePeriodSeconds -}}
{{- $set := int64 .Values.termination.gracePeriodSeconds -}}
{{- if lt $set $min -}}
{{- fail (printf "termination.gracePeriodSeconds=%d is shorter than preStopSleepSeconds + launcher.shutdown-timeout + 20 = %d: the kubelet would kill in-flight requests" $set $min) -}}
{{- end -}}
{{- $set -}}
{{- else -}}
{{- $min -}}
{{- end -}}
{{- end -}}

{{/* Whether the cache is one claim that cannot follow pods across nodes. */}}
{{- define "sluice.cacheIsSingleNode" -}}
{{- if and (has .Values.cache.type (list "pvc" "existingClaim")) (not (has "ReadWriteMany" .Values.cache.accessModes)) (not (has "ReadOnlyMany" .Values.cache.accessModes)) -}}
true
{{- end -}}
{{- end -}}

{{/* Checks across values that a schema cannot express. */}}
{{- define "sluice.validate" -}}
{{- if not (has .Values.cache.type (list "pvc" "existingClaim" "emptyDir")) -}}
{{- fail (printf "cache.type must be pvc, existingClaim or emptyDir, not %q" .Values.cache.type) -}}
{{- end -}}
{{- if and (eq .Values.cache.type "existingClaim") (not .Values.cache.existingClaim) -}}
{{- fail "cache.type=existingClaim needs cache.existingClaim (the claim's name)" -}}
{{- end -}}
{{- if and (include "sluice.cacheIsSingleNode" .) (or .Values.autoscaling.enabled (gt (int64 .Values.replicaCount) 1)) -}}
{{- fail "cache: a ReadWriteOnce claim attaches to one node, so several replicas cannot share it; set cache.accessModes to [ReadWriteMany] (a storage class that offers it) or cache.type=emptyDir" -}}
{{- end -}}
{{- if and .Values.gpu.enabled (eq (toString (index .Values.launcher "device")) "cpu") -}}
{{- fail "launcher.device=cpu with gpu.enabled=true would hold GPUs it never uses; use values-cpu.yaml or set gpu.enabled=false" -}}
{{- end -}}
{{- if not (has .Values.termination.preStopAction (list "sleep" "exec")) -}}
{{- fail (printf "termination.preStopAction must be sleep or exec, not %q" .Values.termination.preStopAction) -}}
{{- end -}}
{{- if and .Values.apiKey.value .Values.apiKey.existingSecret -}}
{{- fail "apiKey: give value or existingSecret, not both" -}}
{{- end -}}
{{- if and .Values.hfToken.value .Values.hfToken.existingSecret -}}
{{- fail "hfToken: give value or existingSecret, not both" -}}
{{- end -}}
{{- end -}}
