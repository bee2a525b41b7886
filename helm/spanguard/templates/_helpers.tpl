{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "spanguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, plus the chart name unless it contains it. */}}
{{- define "spanguard.fullname" -}}
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

{{- define "spanguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's pods, whatever their component. */}}
{{- define "spanguard.instanceLabels" -}}
app.kubernetes.io/name: {{ include "spanguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The worker pods (StatefulSet, Services, PodDisruptionBudget). */}}
{{- define "spanguard.selectorLabels" -}}
{{ include "spanguard.instanceLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{/* Labels on every object, except the component. */}}
{{- define "spanguard.commonLabels" -}}
helm.sh/chart: {{ include "spanguard.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: spanguard
{{- end }}

{{- define "spanguard.labels" -}}
{{ include "spanguard.commonLabels" . }}
{{ include "spanguard.selectorLabels" . }}
{{- end }}

{{- define "spanguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spanguard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "spanguard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/*
Checks that stop the render with a message, before anything reaches the cluster.
*/}}
{{- define "spanguard.validate" -}}
{{- $replicas := int .Values.replicaCount }}
{{- $partitions := int .Values.kafka.partitions }}
{{- if lt $partitions 1 }}
{{- fail (printf "kafka.partitions must be at least 1 (got %d)" $partitions) }}
{{- end }}
{{- if gt $replicas $partitions }}
{{- fail (printf "replicaCount (%d) must not exceed kafka.partitions (%d): each worker pod needs at least one partition of %s, and a pod beyond the partition count would sit idle. Lower replicaCount or raise kafka.partitions." $replicas $partitions .Values.kafka.topics.input) }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- $min := int .Values.autoscaling.minReplicas }}
{{- $max := int .Values.autoscaling.maxReplicas }}
{{- if lt $min 1 }}
{{- fail (printf "autoscaling.minReplicas must be at least 1 (got %d)" $min) }}
{{- end }}
{{- if gt $max $partitions }}
{{- fail (printf "autoscaling.maxReplicas (%d) must not exceed kafka.partitions (%d): a worker beyond the partition count would hold no partition. Lower it, or 0 for the partition count." $max $partitions) }}
{{- end }}
{{- if gt $min (int (include "spanguard.maxReplicas" .)) }}
{{- fail (printf "autoscaling.minReplicas (%d) must not exceed autoscaling.maxReplicas (%s)" $min (include "spanguard.maxReplicas" .)) }}
{{- end }}
{{- end }}
{{- if not (has .Values.worker.store (list "rocksdb" "memory")) }}
{{- fail (printf "worker.store must be rocksdb or memory (got %q)" .Values.worker.store) }}
{{- end }}
{{- if and .Values.signingKey.value .Values.signingKey.existingSecret }}
{{- fail "set signingKey.value or signingKey.existingSecret, not both" }}
{{- end }}
{{- if and .Values.signingKey.value (lt (len .Values.signingKey.value) 16) }}
{{- fail (printf "signingKey.value has %d bytes; the worker needs at least 16 (e.g. openssl rand -hex 32)" (len .Values.signingKey.value)) }}
{{- end }}
{{- if not (or (include "spanguard.signingKeySecret" .) .Values.worker.allowUnsigned) }}
{{- fail "kill signals are signed: set signingKey.value (--set-file), signingKey.existingSecret or signingKey.generate=true; worker.allowUnsigned=true sends unsigned signals instead (insecure)" }}
{{- end }}
{{- if and .Values.pagerduty.routingKey .Values.pagerduty.existingSecret }}
{{- fail "set pagerduty.routingKey or pagerduty.existingSecret, not both" }}
{{- end }}
{{- if and .Values.webhook.url .Values.webhook.existingSecret }}
{{- fail "set webhook.url or webhook.existingSecret, not both" }}
{{- end }}
{{- if and .Values.webhook.signingKeyKey (not .Values.webhook.existingSecret) }}
{{- fail "webhook.signingKeyKey names a key of webhook.existingSecret: put the URL and the signing key in one Secret of yours" }}
{{- end }}
{{- $sec := .Values.kafka.security }}
{{- if has $sec.protocol (list "SASL_PLAINTEXT" "SASL_SSL") }}
{{- if not (and $sec.saslMechanism $sec.saslUsername $sec.existingSecret $sec.keys.saslPassword) }}
{{- fail (printf "kafka.security.protocol %s needs saslMechanism, saslUsername, and existingSecret with keys.saslPassword" $sec.protocol) }}
{{- end }}
{{- else if or $sec.saslMechanism $sec.saslUsername }}
{{- fail (printf "kafka.security.saslMechanism/saslUsername are set but protocol is %s: use SASL_SSL" $sec.protocol) }}
{{- end }}
{{- if ne (not $sec.keys.sslCertificateLocation) (not $sec.keys.sslKeyLocation) }}
{{- fail "kafka.security.keys.sslCertificateLocation and sslKeyLocation go together (mutual TLS)" }}
{{- end }}
{{- end }}

{{/* Where the Kafka Secret's files are mounted. */}}
{{- define "spanguard.kafkaSecretPath" -}}/etc/spanguard/kafka{{- end }}

{{/* key=>file items of the Kafka Secret that the protocol uses: "" when none is mounted. */}}
{{- define "spanguard.kafkaSecretItems" -}}
{{- $sec := .Values.kafka.security }}
{{- $sasl := has $sec.protocol (list "SASL_PLAINTEXT" "SASL_SSL") }}
{{- $tls := has $sec.protocol (list "SSL" "SASL_SSL") }}
{{- if $sec.existingSecret }}
{{- if and $sasl $sec.keys.saslPassword }}
- key: {{ $sec.keys.saslPassword }}
  path: sasl-password
{{- end }}
{{- if $tls }}
{{- with $sec.keys.sslCaLocation }}
- key: {{ . }}
  path: ca.crt
{{- end }}
{{- with $sec.keys.sslCertificateLocation }}
- key: {{ . }}
  path: tls.crt
{{- end }}
{{- with $sec.keys.sslKeyLocation }}
- key: {{ . }}
  path: tls.key
{{- end }}
{{- with $sec.keys.sslKeyPassword }}
- key: {{ . }}
  path: tls-key-password
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* SPANGUARD_KAFKA_* for the worker and the topics job. */}}
{{- define "spanguard.kafkaEnv" -}}
{{- $sec := .Values.kafka.security }}
{{- $dir := include "spanguard.kafkaSecretPath" . }}
{{- $sasl := has $sec.protocol (list "SASL_PLAINTEXT" "SASL_SSL") }}
{{- $tls := has $sec.protocol (list "SSL" "SASL_SSL") }}
- name: SPANGUARD_KAFKA_SECURITY_PROTOCOL
  value: {{ $sec.protocol | quote }}
{{- if $sasl }}
- name: SPANGUARD_KAFKA_SASL_MECHANISM
  value: {{ $sec.saslMechanism | quote }}
- name: SPANGUARD_KAFKA_SASL_USERNAME
  value: {{ $sec.saslUsername | quote }}
- name: SPANGUARD_KAFKA_SASL_PASSWORD_FILE
  value: {{ printf "%s/sasl-password" $dir | quote }}
{{- end }}
{{- if $tls }}
- name: SPANGUARD_KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM
  value: {{ $sec.sslEndpointIdentificationAlgorithm | quote }}
{{- if and $sec.existingSecret $sec.keys.sslCaLocation }}
- name: SPANGUARD_KAFKA_SSL_CA_LOCATION
  value: {{ printf "%s/ca.crt" $dir | quote }}
{{- end }}
{{- if and $sec.existingSecret $sec.keys.sslCertificateLocation }}
- name: SPANGUARD_KAFKA_SSL_CERTIFICATE_LOCATION
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: SPANGUARD_KAFKA_SSL_KEY_LOCATION
  value: {{ printf "%s/tls.key" $dir | quote }}
{{- end }}
{{- if and $sec.existingSecret $sec.keys.sslKeyPassword }}
- name: SPANGUARD_KAFKA_SSL_KEY_PASSWORD_FILE
  value: {{ printf "%s/tls-key-password" $dir | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret (name) holding the signing key, or "" when signals are unsigned (only with
worker.allowUnsigned). */}}
{{- define "spanguard.signingKeySecret" -}}
{{- if .Values.signingKey.existingSecret }}
{{- .Values.signingKey.existingSecret }}
{{- else if or .Values.signingKey.value (and .Values.signingKey.generate (not .Values.worker.allowUnsigned)) }}
{{- printf "%s-signing-key" (include "spanguard.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Secret (name) holding the PagerDuty routing key, or "" when paging is off. */}}
{{- define "spanguard.pagerdutySecret" -}}
{{- if .Values.pagerduty.existingSecret }}
{{- .Values.pagerduty.existingSecret }}
{{- else if .Values.pagerduty.routingKey }}
{{- printf "%s-pagerduty" (include "spanguard.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Secret (name) holding the webhook URL, or "" when no webhook is configured. */}}
{{- define "spanguard.webhookSecret" -}}
{{- if .Values.webhook.existingSecret }}
{{- .Values.webhook.existingSecret }}
{{- else if .Values.webhook.url }}
{{- printf "%s-webhook" (include "spanguard.fullname" .) }}
{{- end }}
{{- end }}

{{/* The ConfigMap (name) holding the policy, or "" for the built-in defaults. */}}
{{- define "spanguard.policyConfigMap" -}}
{{- if .Values.existingPolicyConfigMap.name }}
{{- .Values.existingPolicyConfigMap.name }}
{{- else if .Values.policy }}
{{- printf "%s-policy" (include "spanguard.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The settings `spanguard worker` and `spanguard topics create` share, as SPANGUARD_* variables.
Numbers go through int/toString so that large values are not rendered as 1e+06.
*/}}
{{- define "spanguard.settingsEnv" -}}
- name: SPANGUARD_BOOTSTRAP
  value: {{ required "kafka.bootstrap is required (HOST:PORT)" .Values.kafka.bootstrap | quote }}
- name: SPANGUARD_APP_ID
  value: {{ .Values.worker.appId | quote }}
- name: SPANGUARD_MODE
  value: {{ .Values.worker.mode | quote }}
- name: SPANGUARD_INPUT_TOPIC
  value: {{ .Values.kafka.topics.input | quote }}
- name: SPANGUARD_KILL_TOPIC
  value: {{ .Values.kafka.topics.kill | quote }}
- name: SPANGUARD_DETECTIONS_TOPIC
  value: {{ .Values.kafka.topics.detections | quote }}
- name: SPANGUARD_DEAD_LETTER_TOPIC
  value: {{ .Values.kafka.topics.deadLetter | quote }}
- name: SPANGUARD_REPARTITION_TOPIC
  value: {{ .Values.kafka.topics.repartition | quote }}
- name: SPANGUARD_PARTITIONS
  value: {{ int .Values.kafka.partitions | quote }}
- name: SPANGUARD_SCOPE_PARTITIONS
  value: {{ int .Values.kafka.scopePartitions | quote }}
- name: SPANGUARD_REPLICATION_FACTOR
  value: {{ int .Values.kafka.replicationFactor | quote }}
- name: SPANGUARD_STORE
  value: {{ .Values.worker.store | quote }}
- name: SPANGUARD_DATA_DIR
  value: {{ .Values.persistence.mountPath | quote }}
- name: SPANGUARD_STATE_TTL
  value: {{ .Values.worker.stateTtl | toString | quote }}
- name: SPANGUARD_SESSION_TIMEOUT
  value: {{ .Values.worker.sessionTimeout | toString | quote }}
- name: SPANGUARD_COMMIT_INTERVAL
  value: {{ .Values.worker.commitInterval | toString | quote }}
- name: SPANGUARD_RECOVERY_DELAY
  value: {{ .Values.worker.recoveryDelay | toString | quote }}
- name: SPANGUARD_STANDBY_REPLICAS
  value: {{ int .Values.worker.standbyReplicas | quote }}
- name: SPANGUARD_STATE_CACHE
  value: {{ int .Values.worker.stateCache | quote }}
- name: SPANGUARD_DEAD_AFTER
  value: {{ .Values.worker.deadAfter | toString | quote }}
- name: SPANGUARD_METRICS_HOST
  value: "0.0.0.0"
- name: SPANGUARD_METRICS_PORT
  value: {{ int .Values.metrics.port | quote }}
- name: SPANGUARD_LOG_LEVEL
  value: {{ .Values.worker.logLevel | quote }}
{{ include "spanguard.kafkaEnv" . }}
{{- end }}

{{/*
The most worker pods the autoscaler may run: autoscaling.maxReplicas, or with 0 the partition
count (a pod beyond it would hold no partition).
*/}}
{{- define "spanguard.maxReplicas" -}}
{{- $max := int .Values.autoscaling.maxReplicas }}
{{- if eq $max 0 }}{{ int .Values.kafka.partitions }}{{ else }}{{ $max }}{{ end }}
{{- end }}
