"""Prometheus metrics of the control plane (served at /metrics)."""

from prometheus_client import Counter, Histogram

ADMISSIONS = Counter("vmplane_admissions_total", "Admission decisions (create-and-start, start)", ["result"])
MIGRATIONS = Counter("vmplane_migrations_total", "Live migrations that ended, by result", ["result"])
OPERATIONS = Counter("vmplane_operations_total", "Operations that ended", ["kind", "state"])
ADMISSION_SECONDS = Histogram("vmplane_admission_seconds", "Time to admit a start (transaction included)",
                              buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0))
