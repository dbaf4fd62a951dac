"""The platform around the jobs: GitOps output, metrics and alerts, the MLflow tracking server, backups."""
