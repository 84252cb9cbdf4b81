"""Controllers: one module per concern, each handed the Plane and its named peers in its constructor.

VM lifecycle (`vms`, `starts`, `resize`), hosts (`hostadmin`, `hostmonitor`, `hostsync`, `hostevents`,
`adopt`, `reconcile`), migration (`migrator`, `migrationsettle`, `diskmoves`, `maintenance`), scaling
(`scaler`), HA (`ha`, `harecovery`), storage (`pools`, `volumes`, `storagesettle`), start-up
(`recovery`) and the audit (`audit`, `storageaudit`). They import `vmplane.plane`, `vmplane.store`,
`vmplane.hosts` and `vmplane.core`, and peers within this folder without a circle; never the
orchestrator, the API or the console. Only `vmplane.orchestrator` constructs them.
"""
