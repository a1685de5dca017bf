"""A real S3-compatible server on loopback for the tests: moto's ThreadedMotoServer, bound to
127.0.0.1 on a free port, with s3fs pointed at it. Its objects live in this (pytest) process, so
a stopped server restarted on the same port still holds them: the store going away and coming
back, as a real outage does."""

from __future__ import annotations

import s3fs
from moto.server import ThreadedMotoServer

from checkpointing.manifest import MANIFEST, checkpoint_step, verify
from checkpointing.storage import FsspecStorage
from tests.conftest import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Fail fast when the server is down: one botocore attempt (our own retries still apply).
FAST_FAIL = "{config_kwargs: {retries: {max_attempts: 1}, connect_timeout: 2, read_timeout: 20}}"


class S3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None
        self.start()

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def env(self) -> dict[str, str]:
        """What a client process needs: test credentials and the endpoint (botocore reads
        AWS_ENDPOINT_URL), so no option names the server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def fs(self) -> s3fs.S3FileSystem:
        key, secret = CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
        return s3fs.S3FileSystem(
            key=key, secret=secret, endpoint_url=self.endpoint, skip_instance_cache=True
        )

    def bucket(self, name: str) -> str:
        self.fs().mkdir(name)
        return f"s3://{name}"

    def storage(self, url: str) -> FsspecStorage:
        return FsspecStorage(self.fs(), url[len("s3://") :], url)


def checkpoints_in(storage: FsspecStorage) -> tuple[list[int], list[int]]:
    """(committed steps, steps with objects but no manifest), each ascending."""
    committed, partial = [], []
    for name in storage.listdir():
        step = checkpoint_step(name)
        if step is not None:
            (committed if storage.exists(f"{name}/{MANIFEST}") else partial).append(step)
    return sorted(committed), sorted(partial)


def assert_committed_are_whole(storage: FsspecStorage) -> list[int]:
    """Every committed checkpoint in the store has all its objects, with the recorded bytes."""
    committed, _ = checkpoints_in(storage)
    for step in committed:
        verify(storage.child(f"checkpoint-{step}"))
    return committed
