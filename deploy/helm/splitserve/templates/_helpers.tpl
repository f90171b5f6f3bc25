{{/* The release's name prefix: short enough that "<fullname>-<role>-<ordinal>" stays a DNS label. */}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: dict "root" $ "component" "decode" */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* A pool's name (its StatefulSet and headless Service): dict "root" $ "role" "decode" */}}
{{- define "splitserve.pool" -}}
{{- printf "%s-%s" (include "splitserve.fullname" .root) .role -}}
{{- end -}}

{{/* The DNS name the gateway re-resolves: the pool's headless Service, every ready pod one address. */}}
{{- define "splitserve.poolAddress" -}}
{{- $pool := index .root.Values .role -}}
{{- printf "dns:///%s.%s.svc.%s:%v" (include "splitserve.pool" .) .root.Release.Namespace .root.Values.clusterDomain $pool.port -}}
{{- end -}}

{{/* The --model value every process gets ("" = the embedded default). */}}
{{- define "splitserve.modelArg" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "huggingface" -}}{{ required "model.id is required when model.source is huggingface" $m.id }}
{{- else if or (eq $m.source "pvc") (eq $m.source "hostPath") -}}{{ trimSuffix "/" (printf "/models/%s" $m.path) }}
{{- end -}}
{{- end -}}

{{/* Model flags of every process, as YAML list items. */}}
{{- define "splitserve.modelArgs" -}}
{{- $model := include "splitserve.modelArg" . -}}
{{- if $model }}
- --model
- {{ $model | quote }}
{{- end }}
{{- if and .Values.model.revision (eq .Values.model.source "huggingface") }}
- --revision
- {{ .Values.model.revision | quote }}
{{- end }}
{{- end -}}

{{/* Volumes for the model (the volume, or the hub cache), as YAML list items. */}}
{{- define "splitserve.modelVolumes" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName | quote }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path | quote }}
    type: Directory
{{- else if eq $m.source "huggingface" }}
- name: hf-cache
{{- if $m.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $m.cache.existingClaim | quote }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.cache.sizeLimit }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "splitserve.modelMounts" -}}
{{- $m := .Values.model -}}
{{- if or (eq $m.source "pvc") (eq $m.source "hostPath") }}
- {name: model, mountPath: /models, readOnly: true}
{{- else if eq $m.source "huggingface" }}
- {name: hf-cache, mountPath: /var/cache/huggingface}
{{- end }}
{{- end -}}

{{/* Environment every splitserve container gets besides the shared ConfigMap: pod facts and Secrets. */}}
{{- define "splitserve.podEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
{{- if .Values.internalToken.existingSecret }}
- name: SPLITSERVE_INTERNAL_TOKEN    # a flag would show in ps
  valueFrom: {secretKeyRef: {name: {{ .Values.internalToken.existingSecret | quote }}, key: {{ .Values.internalToken.key | quote }}}}
{{- end }}
{{- if and (eq .Values.model.source "huggingface") .Values.model.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom: {secretKeyRef: {name: {{ .Values.model.tokenSecret.name | quote }}, key: {{ .Values.model.tokenSecret.key | quote }}}}
{{- end }}
{{- end -}}

{{- define "splitserve.tlsVolume" -}}
{{- if .root.Values.internalTls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ required (printf "internalTls.secrets.%s is required when internalTls.enabled" .role) (index .root.Values.internalTls.secrets .role) | quote }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "splitserve.tlsMount" -}}
{{- if .Values.internalTls.enabled }}
- {name: internal-tls, mountPath: /etc/splitserve/tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* terminationGracePeriodSeconds: preStop, then the drain of the longest stream, then a margin to exit. */}}
{{- define "splitserve.terminationGrace" -}}
{{- add .Values.drain.preStopSeconds .Values.drain.longestStreamSeconds 15 -}}
{{- end -}}

{{- define "splitserve.metricsAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
