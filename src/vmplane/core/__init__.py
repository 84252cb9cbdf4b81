"""The pure core: vmplane's rules and value types over plain data, with no I/O.

Quota, placement, scaling, migration, failover, groups, storage rules, drift, settings, scopes, names and
units; the Driver interface and the values it speaks (`driver.py`: what a host is asked and answers), the
errors, and the named crash points. Imports only `vmplane.core`. Tested exhaustively and fast.
"""
