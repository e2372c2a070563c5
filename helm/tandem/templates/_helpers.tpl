{{/* vim: set filetype=mustache: */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name prefix of every resource. Kept to 40 characters: KubeRay derives
"<cluster>-head-svc" and "<cluster>-<group>-worker-<suffix>" pod names from it.
*/}}
{{- define "tandem.fullname" -}}
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

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The RayCluster's name; KubeRay names the head Service "<name>-head-svc". */}}
{{- define "tandem.rayClusterName" -}}
{{- include "tandem.fullname" . -}}
{{- end -}}

{{/* Label shared by every Ray pod (head and workers) and no other pod. */}}
{{- define "tandem.rayNodeLabel" -}}
tandem/ray-node: "true"
{{- end -}}

{{- define "tandem.rayAddress" -}}
{{- if .Values.gateway.rayAddress -}}
{{- .Values.gateway.rayAddress -}}
{{- else -}}
{{- printf "%s-head-svc:6379" (include "tandem.rayClusterName" .) -}}
{{- end -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.flavor -}}
{{- $tag = printf "%s-%s" $tag .Values.image.flavor -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Name of the Secret holding the API key, or "" when the API is open. */}}
{{- define "tandem.apiKeySecretName" -}}
{{- if .Values.apiKey.enabled -}}
{{- default (printf "%s-api-key" (include "tandem.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* Name of the Secret holding the Ray auth token, or "" when Ray token authentication is off. */}}
{{- define "tandem.rayAuthSecretName" -}}
{{- if .Values.ray.auth.enabled -}}
{{- default (printf "%s-ray-auth" (include "tandem.fullname" .)) .Values.ray.auth.existingSecret -}}
{{- end -}}
{{- end -}}

{{/*
The chart-managed secret material, base64-encoded, as a dict (call with include and
fromYaml): apiKey, salt (of the API key's pod checksum), rayToken. Generated once
(randAlphaNum) and afterwards read back from the release's Secrets (lookup), so upgrades
keep them. Computed once per render (kept in .Values._tandemSecrets): every template
sees the same values, also on the first install.
*/}}
{{- define "tandem.secretData" -}}
{{- if not (hasKey .Values "_tandemSecrets") -}}
{{- $fullname := include "tandem.fullname" . -}}
{{- $api := (lookup "v1" "Secret" .Release.Namespace (printf "%s-api-key" $fullname)).data | default dict -}}
{{- $ray := (lookup "v1" "Secret" .Release.Namespace (printf "%s-ray-auth" $fullname)).data | default dict -}}
{{- $out := dict -}}
{{- if .Values.apiKey.value -}}
{{- $_ := set $out "apiKey" (.Values.apiKey.value | b64enc) -}}
{{- else -}}
{{- $_ := set $out "apiKey" (get $api .Values.apiKey.secretKey | default (randAlphaNum 48 | b64enc)) -}}
{{- end -}}
{{- $_ := set $out "salt" (get $api "checksum-salt" | default (randAlphaNum 32 | b64enc)) -}}
{{- $_ := set $out "rayToken" (get $ray .Values.ray.auth.secretKey | default (randAlphaNum 48 | b64enc)) -}}
{{- $_ := set .Values "_tandemSecrets" $out -}}
{{- end -}}
{{- toYaml (get .Values "_tandemSecrets") -}}
{{- end -}}

{{/*
Deliberate openings need security.allowInsecure; so do LoadBalancer/NodePort Services and
Ingresses behind NetworkPolicies that do not say who may reach the API.
*/}}
{{- define "tandem.checkSecurity" -}}
{{- $open := list -}}
{{- if not .Values.networkPolicy.enabled }}{{ $open = append $open "networkPolicy.enabled=false" }}{{ end -}}
{{- if not .Values.ray.auth.enabled }}{{ $open = append $open "ray.auth.enabled=false" }}{{ end -}}
{{- if not .Values.apiKey.enabled }}{{ $open = append $open "apiKey.enabled=false" }}{{ end -}}
{{- if and $open (not .Values.security.allowInsecure) -}}
{{- fail (printf "%s opens the release to every pod of the Kubernetes cluster (Ray runs any code it is sent; the API serves anyone): set security.allowInsecure=true to render it anyway" (join ", " $open)) -}}
{{- end -}}
{{- $gw := .Values.gateway -}}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.apiFrom) (or $gw.ingress.enabled (ne $gw.service.type "ClusterIP")) -}}
{{- fail "networkPolicy.apiFrom is empty, so only pods of the release namespace reach the API: with gateway.ingress.enabled or a LoadBalancer/NodePort Service, name who may reach it (the ingress controller's namespace, or an ipBlock)" -}}
{{- end -}}
{{- end -}}

{{/* Where the gateway reads the API key (a Secret mounted as a file). */}}
{{- define "tandem.apiKeyDir" -}}/var/run/secrets/tandem/api-key{{- end -}}
{{- define "tandem.rayAuthDir" -}}/var/run/secrets/tandem/ray-auth{{- end -}}

{{/* Ray token authentication: environment of every Ray process (the token is a file). */}}
{{- define "tandem.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN_PATH
  value: {{ include "tandem.rayAuthDir" . }}/token
{{- end -}}
{{- end -}}

{{- define "tandem.rayAuthMounts" -}}
{{- if .Values.ray.auth.enabled -}}
- name: ray-auth
  mountPath: {{ include "tandem.rayAuthDir" . }}
  readOnly: true
{{- end -}}
{{- end -}}

{{- define "tandem.rayAuthVolumes" -}}
{{- if .Values.ray.auth.enabled -}}
- name: ray-auth
  secret:
    secretName: {{ include "tandem.rayAuthSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.ray.auth.secretKey }}
        path: token
{{- end -}}
{{- end -}}

{{/* The --model path, or "" for the embedded default model. */}}
{{- define "tandem.modelPath" -}}
{{- if ne .Values.model.source "embedded" -}}
{{- if not .Values.model.name -}}
{{- fail (printf "model.name is required when model.source is %q: the checkpoint folder under %s" .Values.model.source .Values.model.mountPath) -}}
{{- end -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{/* Container security context: the global one with a component's overrides. Call with (list $ overrides). */}}
{{- define "tandem.containerSecurityContext" -}}
{{- $root := index . 0 -}}
{{- $override := index . 1 | default dict -}}
{{- toYaml (mustMergeOverwrite (deepCopy $root.Values.containerSecurityContext) (deepCopy $override)) -}}
{{- end -}}

{{/* Environment shared by every tandem container. */}}
{{- define "tandem.commonEnv" -}}
- name: HOME
  value: /home/tandem
- name: TANDEM_CACHE_DIR
  value: /home/tandem/.cache/tandem
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- end -}}

{{/* Scratch volumes (read-only root filesystem): /tmp and the home directory. */}}
{{- define "tandem.scratchVolumes" -}}
- name: tmp
  {{- with .Values.scratch.tmpSizeLimit }}
  emptyDir:
    sizeLimit: {{ . }}
  {{- else }}
  emptyDir: {}
  {{- end }}
- name: home
  {{- with .Values.scratch.homeSizeLimit }}
  emptyDir:
    sizeLimit: {{ . }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end -}}

{{- define "tandem.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/tandem
{{- end -}}

{{/* Ray's object store and NCCL use /dev/shm. Call with (dict "size" ...). */}}
{{- define "tandem.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .size }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end -}}

{{- define "tandem.modelVolumes" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    {{- with $m.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- else if eq $m.source "image" }}
- name: model
  {{- with $m.image.sizeLimit }}
  emptyDir:
    sizeLimit: {{ . }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.modelMounts" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  mountPath: {{ include "tandem.modelPath" . }}
  {{- if $m.pvc.subPath }}
  subPath: {{ printf "%s/%s" (trimSuffix "/" $m.pvc.subPath) $m.name }}
  {{- else }}
  subPath: {{ $m.name }}
  {{- end }}
  readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  mountPath: {{ include "tandem.modelPath" . }}
  subPath: {{ $m.name }}
  readOnly: true
{{- else if eq $m.source "image" }}
- name: model
  mountPath: {{ include "tandem.modelPath" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Init container that copies the weights out of the model image (source=image). */}}
{{- define "tandem.modelInitContainers" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" }}
- name: copy-model
  image: {{ printf "%s:%s" (required "model.image.repository is required when model.source is image" $m.image.repository) (required "model.image.tag is required when model.source is image" $m.image.tag) }}
  imagePullPolicy: {{ $m.image.pullPolicy }}
  command:
    - sh
    - -c
    - cp -R "$MODEL_SRC"/. "$MODEL_DST"/
  env:
    - name: MODEL_SRC
      value: {{ $m.image.sourcePath | quote }}
    - name: MODEL_DST
      value: /model-out
  volumeMounts:
    - name: model
      mountPath: /model-out
  resources:
    requests:
      cpu: 100m
      memory: 128Mi
    limits:
      memory: 512Mi
  securityContext:
    {{- include "tandem.containerSecurityContext" (list . dict) | nindent 4 }}
{{- end }}
{{- end -}}

{{/*
Container resources with the GPU limit added. Call with
(dict "resources" ... "gpus" N "gpuResourceName" ...).
*/}}
{{- define "tandem.containerResources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := get $res "limits" | default dict -}}
{{- $_ := set $limits .gpuResourceName (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $requests := get $res "requests" | default dict -}}
{{- $_ := set $requests .gpuResourceName (int .gpus) -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
GPUs per tandem worker, for `tandem serve --gpus-per-worker` (one value for
both pools): <group>.gpus / <group>.workersPerPod, equal for every pool in use.
*/}}
{{- define "tandem.gpusPerWorker" -}}
{{- $root := . -}}
{{- $seen := dict -}}
{{- range $name := list "prefill" "decode" -}}
{{- $g := index $root.Values $name -}}
{{- $gpus := int $g.gpus -}}
{{- $wpp := int $g.workersPerPod -}}
{{- if ne (mod $gpus $wpp) 0 -}}
{{- fail (printf "%s.gpus (%d) must be a multiple of %s.workersPerPod (%d): every worker gets the same number of GPUs" $name $gpus $name $wpp) -}}
{{- end -}}
{{- $inUse := or (gt (int $g.replicas) 0) (and $root.Values.ray.autoscaling.enabled (gt (int $g.maxReplicas) 0)) -}}
{{- if $inUse -}}
{{- $_ := set $seen $name (div $gpus $wpp) -}}
{{- end -}}
{{- end -}}
{{- if and (hasKey $seen "prefill") (hasKey $seen "decode") (ne (get $seen "prefill") (get $seen "decode")) -}}
{{- fail (printf "prefill has %d GPU(s) per worker and decode %d: tandem serve takes one --gpus-per-worker for both pools (set gpus / workersPerPod equal)" (get $seen "prefill") (get $seen "decode")) -}}
{{- end -}}
{{- if hasKey $seen "prefill" -}}
{{- get $seen "prefill" -}}
{{- else if hasKey $seen "decode" -}}
{{- get $seen "decode" -}}
{{- else -}}
0
{{- end -}}
{{- end -}}

{{/* The head's readiness/liveness check: the dashboard's /api/gcs_healthz. */}}
{{- define "tandem.headProbe" -}}
{{- if .Values.ray.dashboard.exposeOnPodIP -}}
httpGet:
  path: /api/gcs_healthz
  port: 8265
{{- else -}}
exec:
  command:
    - python
    - -c
    - import urllib.request; urllib.request.urlopen('http://127.0.0.1:8265/api/gcs_healthz', timeout=2)
{{- end -}}
{{- end -}}

{{/*
A CPU quantity ("2", 2, "1.5", "1500m") in whole cores, rounded down, at least 1.
*/}}
{{- define "tandem.wholeCpus" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q -}}
{{- max 1 (div (int (float64 (trimSuffix "m" $q))) 1000) -}}
{{- else -}}
{{- max 1 (int (floor (float64 $q))) -}}
{{- end -}}
{{- end -}}
