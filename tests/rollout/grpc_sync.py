"""A weight sync as the rollout does it: a trainer's WeightSyncServer on a real gRPC port, the rollout's
PolicyFollower pulling from it into a running engine."""

from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.pb import weights_pb2_grpc
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot
from services.rollout.engines import Engine
from services.rollout.service import PolicyFollower
from tests.support.servers import free_port


async def sync_over_grpc(engine: Engine, engine_thread: ThreadPoolExecutor, snapshot: Snapshot) -> int:
    """Serve ``snapshot`` and sync ``engine`` to it; returns the version the follower loaded."""
    weights = WeightSyncServer(snapshot)
    server = grpc.aio.server()
    weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    follower = PolicyFollower(engine, engine_thread, WeightSyncClient(f"127.0.0.1:{port}"))
    try:
        follower.newest = (await follower.client.version()).version
        await follower.sync()
        assert not follower.torn
        return follower.loaded
    finally:
        await follower.client.close()
        await server.stop(0)
