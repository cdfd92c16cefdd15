"""TierError: the one exception a tier raises inside itself for backend trouble (a leaf module).

    backend exception ──> Tier._run (base.py) ──> TierError(kind) ──> the public operation's miss
                                                                  └─> `call`'s caller (a purge)

It never reaches callers of a tier's public operations (base.Tier turns it into a miss or a
dropped write); tier-specific operations that must know (a purge) raise it. Kept apart from
base.py so that fault injection (faults.py), the data keys (keyring.py) and the tenant
administration (tenants.py) can name it without loading the tier machinery.
"""

from __future__ import annotations


class TierError(Exception):
    """A backend failure. `kind` names it: "timeout", "connection", "disk_full", "io",
    "injected", ... Tiers raise it internally; it never reaches callers of the public methods."""

    def __init__(self, kind: str, message: str = "") -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind
