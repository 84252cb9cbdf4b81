"""Hosts: what vmplane drives (hypervisors, BMCs, this machine).

`drivers/` implements `core.driver.Driver` for libvirt and for the simulated fabric; `fencing/` the fence
agents; `guest/` the small test guest; `images` template disk images; `localhosts` the libvirtd hosts of
`vmplane up` and the tests; `liveness` the second liveness signal. Imports only `vmplane.core` (and
the root's `tlscerts`/`heartbeat` commands): hosts know nothing of the store or the control plane.
"""
