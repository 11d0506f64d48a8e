{{/*
Names. KubeRay derives RayCluster, Pod and Service names from the RayService name by appending
suffixes (-xxxxx, -head-svc, -serve-svc, worker group names), so the base name stays at 40
characters to keep those under Kubernetes' 63.
*/}}
{{- define "stepserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "stepserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stepserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stepserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stepserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stepserve.labels" -}}
helm.sh/chart: {{ include "stepserve.chart" . }}
{{ include "stepserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "stepserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The model's path inside the pods (ClusterConfig.engine.model); empty for the bundled default.
*/}}
{{- define "stepserve.modelPath" -}}
{{- if ne .Values.model.source "default" }}
{{- if .Values.model.subPath }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.subPath) }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stepserve.modelClaimName" -}}
{{- if .Values.model.pvc.existingClaim }}
{{- .Values.model.pvc.existingClaim }}
{{- else if .Values.model.pvc.create }}
{{- printf "%s-model" (include "stepserve.fullname" .) }}
{{- else }}
{{- fail "model.source is \"pvc\": set model.pvc.existingClaim, or model.pvc.create=true" }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding the API keys; empty when the API is open.
*/}}
{{- define "stepserve.apiKeySecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else if .Values.auth.apiKeys }}
{{- printf "%s-api-keys" (include "stepserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "stepserve.apiKeySecretKey" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecretKey }}
{{- else }}
{{- print "api-keys" }}
{{- end }}
{{- end }}

{{/*
The ClusterConfig the application is built from (the `args` of the Serve application), as YAML.
Every key is a ClusterConfig field: the test suite validates it with ClusterConfig.model_validate.
The fixed replica count is not among them: Serve replaces every replica when `args` change, so
it goes to the LLMServer deployment's override (stepserve.serveConfig), a change Serve applies
in place.
*/}}
{{- define "stepserve.clusterConfig" -}}
{{- $engine := deepCopy .Values.engine }}
{{- $modelPath := include "stepserve.modelPath" . }}
{{- if and $modelPath (not .Values.models) }}
{{- $_ := set $engine "model" $modelPath }}
{{- end }}
{{- /* several models: each entry's fixed replica count goes to its deployment's override, as
the one model's does (stepserve.serveConfig) */}}
{{- $models := list }}
{{- range .Values.models }}
{{- $models = append $models (omit . "replicas") }}
{{- end }}
{{- $http := deepCopy .Values.http }}
{{- $_ := set $http "host" "0.0.0.0" }}
{{- $_ := set $http "port" 8000 }}
{{- $_ := unset $http "ingress_replicas" }}
{{- $config := pick .Values "name" "autoscaling" "routing" "num_cpus_per_replica" "cpu_threads_per_replica" "max_ongoing_requests" "log_prompts" "tracing" "pd" }}
{{- $_ := set $config "engine" $engine }}
{{- $_ := set $config "models" $models }}
{{- $_ := set $config "http" $http }}
{{- $_ := set $config "auth" (dict "api_keys_env" .Values.auth.api_keys_env) }}
{{- toYaml $config }}
{{- end }}

{{/*
serveConfigV2: one Serve application built by cluster.app:build_app from the ClusterConfig.
*/}}
{{- define "stepserve.serveConfig" -}}
{{- /* LLMServer's override: what may change without replacing replicas (and reloading the model).
user_config is what a CPU replica picks its torch threads from (replica/deployment.py
resolve_cpu_threads); the replicas sharing a pod's cores are the first group's replicasPerPod. */}}
{{- $group := first .Values.workerGroups | default dict }}
{{- $perPod := int (coalesce $group.replicasPerPod .Values.workerGroupDefaults.replicasPerPod 1) }}
{{- $threads := dict "cpu_threads" .Values.cpu_threads_per_replica "num_cpus_per_replica" .Values.num_cpus_per_replica "replicas_per_machine" $perPod }}
{{- $deployments := list }}
{{- if not .Values.models }}
{{- $llm := dict "name" "LLMServer" "user_config" $threads }}
{{- if not .Values.autoscaling.enabled }}
{{- $_ := set $llm "num_replicas" (int .Values.replicas) }}
{{- end }}
{{- $deployments = append $deployments $llm }}
{{- end }}
{{- /* one LLMServer-<served name> per model (cluster/app.py deployment_name) */}}
{{- range $i, $m := .Values.models }}
{{- $engine := $m.engine | default dict }}
{{- $name := regexReplaceAll "[^A-Za-z0-9._-]" (toString $engine.served_model_name) "_" }}
{{- $scaling := merge (deepCopy ($m.autoscaling | default dict)) (deepCopy $.Values.autoscaling) }}
{{- $cpuThreads := ternary $m.cpu_threads_per_replica $.Values.cpu_threads_per_replica (hasKey $m "cpu_threads_per_replica") }}
{{- $numCpus := ternary $m.num_cpus_per_replica $.Values.num_cpus_per_replica (hasKey $m "num_cpus_per_replica") }}
{{- $llm := dict "name" (printf "LLMServer-%s" $name) "user_config" (dict "cpu_threads" $cpuThreads "num_cpus_per_replica" $numCpus "replicas_per_machine" $perPod) }}
{{- if not $scaling.enabled }}
{{- $_ := set $llm "num_replicas" (int ($m.replicas | default $.Values.replicas)) }}
{{- end }}
{{- $deployments = append $deployments $llm }}
{{- end }}
{{- $ingress := dict "name" "Ingress" "num_replicas" (int (default 1 .Values.http.ingress_replicas)) }}
{{- $deployments = append $deployments $ingress }}
{{- $app := dict "name" .Values.name "import_path" "cluster.app:build_app" "route_prefix" "/" "args" (include "stepserve.clusterConfig" . | fromYaml) "deployments" $deployments }}
{{- /* where Serve runs its HTTP proxies (cluster/app.py SERVE_PROXY_LOCATIONS) */}}
{{- $proxyLocation := get (dict "head" "HeadOnly" "every_node" "EveryNode") (default "head" .Values.http.proxy_location) }}
{{- toYaml (dict "proxy_location" $proxyLocation "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app)) }}
{{- end }}

{{/*
Environment of every Ray container: the API keys (from the Secret) and the user's extra env.
*/}}
{{- define "stepserve.env" -}}
{{- $secret := include "stepserve.apiKeySecretName" . }}
{{- if $secret }}
- name: {{ .Values.auth.api_keys_env }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "stepserve.apiKeySecretKey" . }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Pod template metadata shared by head and workers; the argument is (dict "root" $ "component" X).
A change of the chart-made API-key Secret changes the pod template, so KubeRay rolls the pods.
*/}}
{{- define "stepserve.podMetadata" -}}
{{- $root := .root -}}
labels:
  {{- include "stepserve.selectorLabels" $root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with $root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- if or $root.Values.podAnnotations (and $root.Values.auth.apiKeys (not $root.Values.auth.existingSecret)) }}
annotations:
  {{- if and $root.Values.auth.apiKeys (not $root.Values.auth.existingSecret) }}
  checksum/api-keys: {{ $root.Values.auth.apiKeys | toJson | sha256sum }}
  {{- end }}
  {{- with $root.Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
The model volume and its mount, and the init container that fills it (model.source=init).
*/}}
{{- define "stepserve.modelVolumes" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "stepserve.modelClaimName" . }}
    readOnly: true
{{- else if eq .Values.model.source "init" }}
- name: model
  {{- $limit := .Values.model.init.sizeLimit }}
  emptyDir: {{ ternary (dict "sizeLimit" $limit) (dict) (not (empty $limit)) | toJson }}
{{- end }}
{{- end }}

{{- define "stepserve.modelMounts" -}}
{{- if ne .Values.model.source "default" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "stepserve.modelInitContainers" -}}
{{- if eq .Values.model.source "init" }}
{{- $init := .Values.model.init }}
- name: fetch-model
  image: {{ default (include "stepserve.image" .) $init.image }}
  imagePullPolicy: {{ $init.imagePullPolicy }}
  command:
    {{- toYaml $init.command | nindent 4 }}
  {{- with $init.args }}
  args:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: STEPSERVE_MODEL_DIR
      value: {{ include "stepserve.modelPath" . | quote }}
    {{- with $init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $init.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $init.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/*
Pod-level settings shared by head and worker pods.
*/}}
{{- define "stepserve.podCommon" -}}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Scrape endpoints of the PodMonitor and the ServiceMonitor; the argument is the monitor's values.
`metrics` (8080): Ray's own metrics, on every Ray pod. `app-metrics` (monitoring.appMetricsPort):
vllm:* and stepserve:*, served by the replicas on worker pods; the head has no such port, so no target.
*/}}
{{- define "stepserve.scrapeEndpoints" -}}
{{- $monitor := . }}
{{- range list "metrics" "app-metrics" }}
- port: {{ . }}
  path: /metrics
  interval: {{ $monitor.interval }}
  scrapeTimeout: {{ $monitor.scrapeTimeout }}
  relabelings:
    # Which Ray node type (head/worker) and group a series comes from.
    - sourceLabels: [__meta_kubernetes_pod_label_ray_io_node_type]
      targetLabel: ray_node_type
    - sourceLabels: [__meta_kubernetes_pod_label_ray_io_group]
      targetLabel: ray_group
{{- end }}
{{- end }}
