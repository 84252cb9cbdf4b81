"""Hypervisor drivers behind one interface: sim (in-memory) and, later, libvirt."""
