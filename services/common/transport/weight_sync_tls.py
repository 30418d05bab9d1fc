"""TLS of the ports that serve weights: the trainer's WeightSync port and a relaying rollout's gRPC port.

Both use the run's one weight-sync certificate (``weight_sync.tls_cert``/``tls_key``), and every client checks it
against ``weight_sync.tls_ca`` under one name, the trainer's host (``service.trainer_host``, else
``service.host``): a peer's relay is dialled at its pod IP and the container probe at 127.0.0.1, neither of which
the certificate names, but both must be talking to a holder of the run's certificate. The rules live here, with
grpc and the config as the only imports, because the health probe (services/cli/healthcheck.py) follows them
every few seconds and must not import torch.
"""

from __future__ import annotations

import grpc

from services.common.config import RolloutConfig, ServiceConfig, WeightSyncConfig

# Roles whose gRPC port speaks TLS when the weight-sync certificate is set.
TRAINER, ROLLOUT = "trainer", "rollout"


def serves_tls(weight_sync: WeightSyncConfig, rollout: RolloutConfig, role: str) -> bool:
    """Whether ``role``'s gRPC port speaks TLS only: the trainer's when the certificate is set; a rollout's when
    it also relays weights to its peers (its port carries the relay)."""
    if weight_sync.tls_cert is None:
        return False
    return role == TRAINER or (role == ROLLOUT and rollout.weight_relay)


def server_credentials(
    weight_sync: WeightSyncConfig, rollout: RolloutConfig, role: str
) -> grpc.ServerCredentials | None:
    """TLS credentials for ``role``'s port, or None where it stays plaintext."""
    if not serves_tls(weight_sync, rollout, role):
        return None
    tls = weight_sync
    assert tls.tls_cert is not None and tls.tls_key is not None  # config: both or neither
    return grpc.ssl_server_credentials([(tls.tls_key.read_bytes(), tls.tls_cert.read_bytes())])


def certificate_name(service: ServiceConfig) -> str:
    """The name every client checks the weight-sync certificate against."""
    return service.trainer_host or service.host


def channel_credentials(weight_sync: WeightSyncConfig) -> grpc.ChannelCredentials | None:
    """TLS to a weight-sync port when ``weight_sync.tls_ca`` is set."""
    ca = weight_sync.tls_ca
    return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()) if ca is not None else None


def name_override(service: ServiceConfig) -> tuple[tuple[str, str], ...]:
    """Channel options that check the certificate against ``certificate_name`` whatever address is dialled."""
    return (("grpc.ssl_target_name_override", certificate_name(service)),)


def probe_credentials(
    weight_sync: WeightSyncConfig, rollout: RolloutConfig, role: str
) -> grpc.ChannelCredentials | None:
    """What the health probe in ``role``'s container dials its own port with: TLS where the port speaks it, trusting
    tls_ca, or where a trainer's container has none (it needs no CA to serve), its own certificate chain."""
    if not serves_tls(weight_sync, rollout, role):
        return None
    trusted = weight_sync.tls_ca or weight_sync.tls_cert
    assert trusted is not None
    return grpc.ssl_channel_credentials(root_certificates=trusted.read_bytes())
