{{/* The picker's configuration (llm-d-router v0.10 EndpointPickerConfig). */}}
{{- define "sluice.eppConfig" -}}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
  parameters:
    scheme: http
    path: /metrics
# Pods labelled llm-d.ai/engine-type=sluice are read with these names
# (README, Observability: the gauges and their meaning).
- type: core-metrics-extractor
  parameters:
    defaultEngine: sluice
    engineConfigs:
    - name: sluice
      queuedRequestsSpec: sluice_queue_size
      runningRequestsSpec: sluice_batch_current_size
      kvUsageSpec: sluice_kv_cache_usage_ratio
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: {{ int64 .Values.inferencePool.endpointPicker.weights.queue }}
  - pluginRef: kv-cache-utilization-scorer
    weight: {{ int64 .Values.inferencePool.endpointPicker.weights.kvCacheUtilization }}
  - pluginRef: prefix-cache-scorer
    weight: {{ int64 .Values.inferencePool.endpointPicker.weights.prefixCache }}
{{- end -}}
