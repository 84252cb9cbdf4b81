"""The shared runtime of one control-plane process: what every controller is handed.

`context.Plane` (store, catalog, drivers, capacity, membership, operations runner, executor), the capacity
mirror (`capacity`), the operation runner where kinds register their body and failure hook
(`operations`), this process among its peers (`membership`), settling a VM from what its host says
(`settle`), placement's group and failover reads (`reserves`), the loop shape (`loops`), counters
(`metrics`) and overdue operations (`overdue`). Imports `vmplane.store`, `vmplane.hosts` and
`vmplane.core`; never a controller.
"""
