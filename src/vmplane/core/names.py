"""The one rule for names of everything vmplane stores (they end up in domain XML, paths, URLs)."""

from __future__ import annotations

import re

from vmplane.core.errors import Invalid

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def check_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        shown = name if isinstance(name, str) and len(name) <= 80 else f"{str(name)[:80]}..."
        raise Invalid(
            f"{field} {shown!r} is not valid: use 1-63 lowercase letters, digits and '-', "
            f"starting and ending with a letter or digit",
            field=field,
        )
    return name


DOMAIN_PREFIX = "vmplane-"  # a VM's libvirt domain is named DOMAIN_PREFIX + its name


def domain_name(vm_name: str) -> str:
    """The libvirt domain of VM `vm_name`."""
    return DOMAIN_PREFIX + vm_name


def local_pool_name(host: str) -> str:
    """The local pool `host add` and `vmplane up` make on a host: `local-HOST` (cut to a name's 63
    characters)."""
    return f"local-{host}"[:63].rstrip("-")
