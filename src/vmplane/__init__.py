"""vmplane: a control plane for KVM clusters."""

__version__ = "0.1.0"
