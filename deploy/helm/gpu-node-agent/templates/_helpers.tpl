{{/* Names, labels and the agent's config, as NVIDIA's device-plugin chart builds them. */}}

{{- define "gpu-node-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release name alone when it already contains the chart name: release gpu-node-agent gives deploy/'s names. */}}
{{- define "gpu-node-agent.fullname" -}}
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

{{- define "gpu-node-agent.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{- define "gpu-node-agent.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: nothing that changes per upgrade (a DaemonSet's selector is immutable). */}}
{{- define "gpu-node-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-node-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpu-node-agent.labels" -}}
helm.sh/chart: {{ include "gpu-node-agent.chart" . }}
{{ include "gpu-node-agent.selectorLabels" . }}
app.kubernetes.io/part-of: gpu-node-agent
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "gpu-node-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpu-node-agent.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gpu-node-agent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpu-node-agent.configMapName" -}}
{{- default (printf "%s-config" (include "gpu-node-agent.fullname" .)) .Values.existingConfigMap -}}
{{- end -}}

{{/* dst gets src deep-merged into it: maps key by key, anything else (lists, scalars, false, "") replaces.
     Written out because sprig's mergeOverwrite skips "empty" sources (false, 0, ""). */}}
{{- define "gpu-node-agent.deepMerge" -}}
{{- $dst := .dst -}}
{{- range $key, $value := .src -}}
{{- if and (kindIs "map" $value) (kindIs "map" (get $dst $key)) -}}
{{- include "gpu-node-agent.deepMerge" (dict "dst" (get $dst $key) "src" $value) -}}
{{- else -}}
{{- $_ := set $dst $key $value -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The agent's config as a map: files/config.yaml, `config` merged over it, metricsAddress from metrics.port. */}}
{{- define "gpu-node-agent.configMap" -}}
{{- $config := .Files.Get "files/config.yaml" | fromYaml -}}
{{- include "gpu-node-agent.deepMerge" (dict "dst" $config "src" (deepCopy .Values.config)) -}}
{{- if not (hasKey .Values.config "metricsAddress") -}}
{{- $_ := set $config "metricsAddress" (printf ":%d" (int .Values.metrics.port)) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* The config file's text: the default file verbatim (comments kept) when nothing changes it, else the merge. */}}
{{- define "gpu-node-agent.configFile" -}}
{{- $file := .Files.Get "files/config.yaml" -}}
{{- $merged := include "gpu-node-agent.configMap" . -}}
{{- if eq $merged (toYaml ($file | fromYaml)) -}}
{{- $file -}}
{{- else -}}
{{- $merged -}}
{{- end -}}
{{- end -}}

{{/* NVSentinel's socket directory on the host, mounted at the same path in the container, and the socket the agent
     is told: both from these two helpers, so the mount and the flag cannot disagree. */}}
{{- define "gpu-node-agent.nvsentinelDir" -}}
{{- clean .Values.nvsentinel.hostSocketDir -}}
{{- end -}}

{{- define "gpu-node-agent.nvsentinelSocket" -}}
{{- printf "%s/%s" (include "gpu-node-agent.nvsentinelDir" .) .Values.nvsentinel.socketName -}}
{{- end -}}
