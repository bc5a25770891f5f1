{{/* The EPP's name: its Deployment, Service, ServiceAccount and pod label app=<release>-epp. */}}
{{- define "llm-epp.eppName" -}}
{{- printf "%s-epp" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llm-epp.labels" -}}
app.kubernetes.io/name: llm-epp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "llm-epp.selectorLabels" -}}
app: {{ include "llm-epp.eppName" . }}
{{- end -}}

{{/* An image reference from {repository, tag, pullPolicy}, defaulting to the EPP's image. */}}
{{- define "llm-epp.image" -}}
{{- $base := .root.Values.inferenceExtension.image -}}
{{- $image := merge (deepCopy (.image | default dict)) $base -}}
{{- printf "%s:%s" $image.repository (toString ($image.tag | default .root.Chart.AppVersion)) -}}
{{- end -}}

{{- define "llm-epp.pullPolicy" -}}
{{- (.image | default dict).pullPolicy | default .root.Values.inferenceExtension.image.pullPolicy -}}
{{- end -}}

{{/* Prediction server sidecars: latencyPredictor.predictionServerCount, else predictionServers.count. */}}
{{- define "llm-epp.predictionServerCount" -}}
{{- $lp := .Values.inferenceExtension.latencyPredictor -}}
{{- if kindIs "invalid" $lp.predictionServerCount -}}
{{- int $lp.predictionServers.count -}}
{{- else -}}
{{- int $lp.predictionServerCount -}}
{{- end -}}
{{- end -}}

{{/* The sidecars' probe listeners, which also serve their /metrics: "name:port" per sidecar,
comma-separated (empty without the latency predictor). The container ports carry these names. */}}
{{- define "llm-epp.sidecarMetricsPorts" -}}
{{- $lp := .Values.inferenceExtension.latencyPredictor -}}
{{- $ports := list -}}
{{- if $lp.enabled -}}
{{- $ports = append $ports (printf "train-health:%d" (int $lp.trainingServer.healthPort)) -}}
{{- range $i := until (int (include "llm-epp.predictionServerCount" .)) -}}
{{- $ports = append $ports (printf "pred-health-%d:%d" (add $i 1) (add $lp.predictionServers.healthStartPort $i)) -}}
{{- end -}}
{{- end -}}
{{- join "," $ports -}}
{{- end -}}

{{/* Comma-separated prediction server URLs, as the EPP's --predictor-url takes them. */}}
{{- define "llm-epp.predictorUrls" -}}
{{- $start := int .Values.inferenceExtension.latencyPredictor.predictionServers.startPort -}}
{{- $urls := list -}}
{{- range $i := until (int (include "llm-epp.predictionServerCount" .)) -}}
{{- $urls = append $urls (printf "http://127.0.0.1:%d" (add $start $i)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{/* Command-line flags from a map: {name: value} -> ["--name=value", ...], sorted by name. */}}
{{- define "llm-epp.flags" -}}
{{- range $name, $value := . }}
- {{ printf "--%s=%v" $name $value | quote }}
{{- end }}
{{- end -}}

{{/* The EndpointPickerConfig file name in the ConfigMap, and its content. */}}
{{- define "llm-epp.configName" -}}
{{- $ie := .Values.inferenceExtension -}}
{{- if $ie.pluginsCustomConfig -}}
{{- first (keys $ie.pluginsCustomConfig) -}}
{{- else if $ie.pluginsConfigFile -}}
{{- printf "%s.yaml" $ie.pluginsConfigFile -}}
{{- else if $ie.latencyPredictor.enabled -}}
predicted-latency.yaml
{{- else -}}
gie-default.yaml
{{- end -}}
{{- end -}}

{{- define "llm-epp.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* The NATS the chart deploys for active-active sync (sync.enabled, no sync.natsUrl). */}}
{{- define "llm-epp.natsName" -}}
{{- printf "%s-nats" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llm-epp.deploysNats" -}}
{{- $sync := .Values.inferenceExtension.sync -}}
{{- if and $sync.enabled (not $sync.natsUrl) }}true{{ end -}}
{{- end -}}

{{/* The EPP's --sync-nats-url: sync.natsUrl, else the chart's NATS Service. */}}
{{- define "llm-epp.natsUrl" -}}
{{- $sync := .Values.inferenceExtension.sync -}}
{{- $scheme := ternary "tls" "nats" (eq (toString $sync.tls.enabled) "true") -}}
{{- $sync.natsUrl | default (printf "%s://%s.%s.svc:%d" $scheme (include "llm-epp.natsName" .) .Release.Namespace (int $sync.nats.port)) -}}
{{- end -}}

{{/* The NATS secret from sync.auth as env vars named .token / .password (the EPP's and the NATS
config's names differ). */}}
{{- define "llm-epp.natsSecretEnv" -}}
{{- if eq .auth.type "token" -}}
- name: {{ .token }}
  valueFrom: {secretKeyRef: {name: {{ .auth.secretName }}, key: {{ .auth.tokenKey }}}}
{{- else if eq .auth.type "userPassword" -}}
- name: {{ .password }}
  valueFrom: {secretKeyRef: {name: {{ .auth.secretName }}, key: {{ .auth.passwordKey }}}}
{{- end -}}
{{- end -}}

{{/* ext_proc TLS: the Secret with the EPP's certificate, and the name gateways verify (a DNS
SAN of the certificate, sent as SNI). */}}
{{- define "llm-epp.tlsSecretName" -}}
{{- .Values.inferenceExtension.tls.secretName | default (printf "%s-tls" (include "llm-epp.eppName" .)) -}}
{{- end -}}

{{- define "llm-epp.tlsServerName" -}}
{{- printf "%s.%s.svc" (include "llm-epp.eppName" .) .Release.Namespace -}}
{{- end -}}

{{/* Where the pod mounts its Secrets (outside /etc/llm-epp, the config map's read-only mount). */}}
{{- define "llm-epp.secretsDir" -}}
/var/run/llm-epp
{{- end -}}

{{/* The EPP's decision-trace response headers (epp.requestcontrol.lifecycle, epp.observability.decision, epp.latency.report). */}}
{{- define "llm-epp.traceHeaders" -}}
x-llm-epp-endpoint, x-llm-epp-decision, x-llm-epp-predicted-ttft-ms, x-llm-epp-predicted-tpot-ms, x-llm-epp-candidates-ttft-ms, x-llm-epp-prediction-fallback
{{- end }}
