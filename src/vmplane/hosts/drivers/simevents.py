"""libvirt's lifecycle event numbers (virDomainEventType and its details) that the sim hosts send.

Their own module so that the fabric (simfabric.py), its storage (simstorage.py) and the driver (sim.py)
all import them without importing one another; hostevents.py takes these numbers as libvirt's.
"""

UNDEFINED, STARTED, SUSPENDED, RESUMED, STOPPED, SHUTDOWN, CRASHED = 1, 2, 3, 4, 5, 6, 8
STOPPED_SHUTDOWN, STOPPED_DESTROYED, STOPPED_CRASHED, STOPPED_MIGRATED, STOPPED_FAILED = 0, 1, 2, 3, 5
SHUTDOWN_GUEST = 1
SUSPENDED_IOERROR, SUSPENDED_POSTCOPY_FAILED = 2, 8
