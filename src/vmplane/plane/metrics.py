"""Prometheus metrics of the control plane (served at /metrics): events counted where they happen.
The cluster's state (VMs, projects, hosts, what is in flight) is read at scrape time: metricscollect."""

from prometheus_client import Counter, Gauge, Histogram

ADMISSIONS = Counter("vmplane_admissions_total", "Admission decisions (create-and-start, start)", ["result"])
MIGRATIONS = Counter("vmplane_migrations_total", "Live migrations that ended, by result", ["result"])
for _result in ("succeeded", "failed", "moved-unhealthy", "cancelled"):  # served at 0 before the first one ends
    MIGRATIONS.labels(_result)
OPERATIONS = Counter("vmplane_operations_total", "Operations that ended", ["kind", "state"])
ADMISSION_SECONDS = Histogram(
    "vmplane_admission_seconds",
    "Time to admit a start (transaction included)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
)
MIGRATION_SECONDS = Histogram(
    "vmplane_migration_duration_seconds",
    "Live migrations that ended after their copy started: copy start to end, by result",
    ["result"],
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600),
)
MIGRATION_DOWNTIME_SECONDS = Histogram(
    "vmplane_migration_downtime_seconds",
    "Guest pause at switch-over of migrations whose copy completed (libvirt's downtime)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
MIGRATION_BYTES = Histogram(
    "vmplane_migration_transferred_bytes",
    "Bytes sent by migrations whose copy completed (memory and copied disks)",
    buckets=tuple(float(2**n) for n in range(24, 42, 2)),
)  # 16 MiB .. 1 TiB
SCALES = Counter(
    "vmplane_scales_total",
    "Live scales that ended, by result and path (in-place, migrate-then-scale)",
    ["result", "path"],
)
API_REQUEST_SECONDS = Histogram(
    "vmplane_api_request_duration_seconds",
    "Time to the response's headers, by method, route template and status class",
    ["method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

CONSOLE_SESSIONS = Gauge("vmplane_console_sessions", "Serial console sessions open in this process", ["mode"])
CONSOLE_TICKETS_REFUSED = Counter(
    "vmplane_console_tickets_refused_total", "Serial console tickets refused, by reason", ["reason"]
)
