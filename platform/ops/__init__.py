"""Operations around a k3 run: cluster YAMLs and the local autoscaling cluster, Prometheus,
Grafana dashboards as code, and HTML run reports."""
