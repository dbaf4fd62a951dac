# Written by kubetrain (--format helm); rendered again, it is replaced. Change values, not templates.
{{- /* The chart's default values (values.yaml): fields keep the render's exact text under them. */ -}}
{{- define "kubetrain.defaults" }}
namespace: ml
mlflow:
  image: ghcr.io/kubetrain/kubetrain:0.1.0
  cpu: 500m
  postgres:
    secretName: kubetrain-postgres
    image: postgres:16
    size: 10Gi
    uri: ''
  artifacts:
    size: 20Gi
  auth:
    enabled: false
    secretName: kubetrain-mlflow-auth
monitoring:
  interval: 30s
  dashboardNamespace: monitoring
{{- end }}
{{- /* A scalar in the config text: as rendered under the default, else as JSON (which YAML reads). */ -}}
{{- define "kubetrain.scalar" -}}
{{- if eq (toJson (index . 0)) (toJson (index . 1)) }}{{ index . 2 }}{{ else }}{{ toJson (index . 0) }}{{ end }}
{{- end }}
{{- /* A mapping or list in the config text: its block under the default, else JSON after the key. */ -}}
{{- define "kubetrain.block" -}}
{{- if eq (toJson (index . 0)) (toJson (index . 1)) }}{{ index . 2 | replace "\n" (print "\n" (index . 3)) }}{{ else }} {{ toJson (index . 0) }}{{ end }}
{{- end }}
