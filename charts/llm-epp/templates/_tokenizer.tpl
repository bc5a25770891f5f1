{{/*
The served model's tokenizer for the EPP. auto (the default): the EPP itself downloads the
tokenizer of the model the pool's /v1/models names, from the Hugging Face Hub (the hub
environment below), and estimates token counts until it has it; no volume. estimate: no
tokenizer at all, token counts always estimated from the text; no volume. Every other source
gives --tokenizer-dir: a pod volume mounted read-only at llm-epp.tokenizerDir, either a volume
that holds the files (configMap, secret, volume) or an emptyDir that an init container fills
(image: copy from an image; hub: download).
*/}}
{{- define "llm-epp.tokenizerDir" -}}
/tokenizer
{{- end -}}

{{/* The files the EPP reads (epp.app.TOKENIZER_FILES). */}}
{{- define "llm-epp.tokenizerFiles" -}}
tokenizer.json tokenizer_config.json
{{- end -}}

{{/* The tokenizer source, after checking that its values are set. */}}
{{- define "llm-epp.tokenizerSource" -}}
{{- $t := .Values.inferenceExtension.tokenizer -}}
{{- if not $t.source -}}
{{- fail "inferenceExtension.tokenizer.source is required: the EPP needs the served model's tokenizer (tokenizer.json, tokenizer_config.json), e.g. auto (the default), or --set inferenceExtension.tokenizer.source=hub --set inferenceExtension.tokenizer.hub.repo=meta-llama/Llama-3.1-8B-Instruct (sources: auto, estimate, configMap, secret, volume, image, hub; see docs/operations.md, 'Deploy on Kubernetes')" -}}
{{- else if eq $t.source "configMap" -}}
{{- $_ := required "inferenceExtension.tokenizer.configMap.name is required with source configMap" $t.configMap.name -}}
{{- else if eq $t.source "secret" -}}
{{- $_ := required "inferenceExtension.tokenizer.secret.name is required with source secret" $t.secret.name -}}
{{- else if eq $t.source "volume" -}}
{{- if not $t.volume.spec -}}
{{- fail "inferenceExtension.tokenizer.volume.spec is required with source volume, e.g. {persistentVolumeClaim: {claimName: models}}" -}}
{{- end -}}
{{- else if eq $t.source "image" -}}
{{- $_ := required "inferenceExtension.tokenizer.image.repository is required with source image" $t.image.repository -}}
{{- $_ := required "inferenceExtension.tokenizer.image.path is required with source image (the directory in the image with the tokenizer files)" $t.image.path -}}
{{- else if eq $t.source "hub" -}}
{{- $_ := required "inferenceExtension.tokenizer.hub.repo is required with source hub, e.g. meta-llama/Llama-3.1-8B-Instruct" $t.hub.repo -}}
{{- end -}}
{{- $t.source -}}
{{- end -}}

{{/* Whether the tokenizer's files come in a pod volume (not with sources auto and estimate). */}}
{{- define "llm-epp.tokenizerMounted" -}}
{{- if not (has (include "llm-epp.tokenizerSource" .) (list "auto" "estimate")) -}}true{{- end -}}
{{- end -}}

{{/* The EPP's flags that say where its tokenizer comes from. */}}
{{- define "llm-epp.tokenizerArgs" -}}
{{- $every := int .Values.inferenceExtension.tokenizer.tokenizeEvery -}}
{{- if not (include "llm-epp.tokenizerMounted" .) -}}
- "--tokenizer-source={{ include "llm-epp.tokenizerSource" . }}"
{{- else -}}
- "--tokenizer-dir={{ include "llm-epp.tokenizerDir" . }}"
{{- end }}
{{- if gt $every 1 }}
{{- if eq (include "llm-epp.tokenizerSource" .) "estimate" -}}
{{- fail "inferenceExtension.tokenizer.tokenizeEvery samples the model's tokenizer: source estimate has none (choose auto or a source that delivers it)" -}}
{{- end }}
- "--tokenize-every={{ $every }}"
{{- end -}}
{{- end -}}

{{/* The environment of a Hugging Face Hub client (`hf download`, the EPP with source auto). */}}
{{- define "llm-epp.hubEnv" -}}
{{- $t := .Values.inferenceExtension.tokenizer -}}
# The client keeps its cache and settings under HF_HOME: the writable /tmp, not the read-only root.
- {name: HF_HOME, value: /tmp/huggingface}
- {name: HF_HUB_DISABLE_TELEMETRY, value: "1"}
{{- with $t.hub.endpoint }}
- {name: HF_ENDPOINT, value: {{ . | quote }}}
{{- end }}
{{- if $t.hub.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ $t.hub.tokenSecret.name }}, key: {{ $t.hub.tokenSecret.key }}}
{{- end }}
{{- end -}}

{{/* The pod volume named "tokenizer" (none with sources auto and estimate). */}}
{{- define "llm-epp.tokenizerVolume" -}}
{{- $t := .Values.inferenceExtension.tokenizer -}}
{{- $source := include "llm-epp.tokenizerSource" . -}}
{{- if include "llm-epp.tokenizerMounted" . -}}
- name: tokenizer
{{- if eq $source "configMap" }}
  configMap:
    name: {{ $t.configMap.name }}
    items:
      {{- range splitList " " (include "llm-epp.tokenizerFiles" .) }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
{{- else if eq $source "secret" }}
  secret:
    secretName: {{ $t.secret.name }}
    items:
      {{- range splitList " " (include "llm-epp.tokenizerFiles" .) }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
{{- else if eq $source "volume" }}
  {{- toYaml $t.volume.spec | nindent 2 }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $t.sizeLimit }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The EPP container's mount of the tokenizer volume (none with sources auto and estimate). */}}
{{- define "llm-epp.tokenizerMount" -}}
{{- $t := .Values.inferenceExtension.tokenizer -}}
{{- if include "llm-epp.tokenizerMounted" . -}}
- name: tokenizer
  mountPath: {{ include "llm-epp.tokenizerDir" . }}
  readOnly: true
  {{- if and (eq $t.source "volume") $t.volume.subPath }}
  subPath: {{ $t.volume.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The init container that fills the tokenizer volume (sources image and hub), else nothing. */}}
{{- define "llm-epp.tokenizerInitContainer" -}}
{{- $t := .Values.inferenceExtension.tokenizer -}}
{{- $source := include "llm-epp.tokenizerSource" . -}}
{{- $dir := include "llm-epp.tokenizerDir" . -}}
{{- $files := splitList " " (include "llm-epp.tokenizerFiles" .) -}}
{{- if eq $source "image" }}
- name: copy-tokenizer
  image: {{ $t.image.repository }}{{ with $t.image.tag }}:{{ . }}{{ end }}
  imagePullPolicy: {{ $t.image.pullPolicy | default "IfNotPresent" }}
  command:
    - cp
    {{- range $files }}
    - {{ printf "%s/%s" (trimSuffix "/" $t.image.path) . | quote }}
    {{- end }}
    - {{ printf "%s/" $dir | quote }}
  resources:
    {{- toYaml $t.resources | nindent 4 }}
  securityContext:
    {{- include "llm-epp.containerSecurity" . | nindent 4 }}
  volumeMounts:
    - {name: tokenizer, mountPath: {{ $dir }}}
{{- else if eq $source "hub" }}
- name: download-tokenizer
  image: {{ include "llm-epp.image" (dict "root" . "image" $t.hub.image) }}
  imagePullPolicy: {{ include "llm-epp.pullPolicy" (dict "root" . "image" $t.hub.image) }}
  command:
    - hf
    - download
    - {{ $t.hub.repo | quote }}
    {{- range $files }}
    - {{ . }}
    {{- end }}
    - "--revision={{ $t.hub.revision }}"
    - "--local-dir={{ $dir }}"
  env:
    {{- include "llm-epp.hubEnv" . | nindent 4 }}
  resources:
    {{- toYaml $t.resources | nindent 4 }}
  securityContext:
    {{- include "llm-epp.containerSecurity" . | nindent 4 }}
  volumeMounts:
    - {name: tokenizer, mountPath: {{ $dir }}}
    - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end -}}
