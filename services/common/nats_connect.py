"""How a process connects to the run's broker: its role's nkey, its reply inbox and the broker's TLS trust.

The identities and permissions themselves are in ``services.common.nats_auth``.
"""

from __future__ import annotations

import ssl
from typing import Any

from services.common.config import NatsConfig

SERVICE_ROLES = ("trainer", "rollout", "reward", "reference")
ROLES = (*SERVICE_ROLES, "operator")


def inbox_prefix(role: str) -> str:
    """Where ``role``'s replies arrive: the broker lets only that role subscribe there."""
    return f"_INBOX_{role}"


def connect_options(nats_cfg: NatsConfig, role: str) -> dict[str, Any]:
    """``nats.connect`` keywords for ``role`` (a tool that is no service connects as ``operator``)."""
    options: dict[str, Any] = {}
    if nats_cfg.nkey_seed_file is not None:
        options["nkeys_seed"] = str(nats_cfg.nkey_seed_file)
        options["inbox_prefix"] = inbox_prefix(role if role in ROLES else "operator")
    if nats_cfg.tls_ca_file is not None:
        options["tls"] = ssl.create_default_context(cafile=str(nats_cfg.tls_ca_file))
    return options
