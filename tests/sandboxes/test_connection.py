"""The connection to a Docker daemon (`sandboxes/connection.py`): a daemon out of reach is
`HostLost`, naming it, whatever the call; an error of the call itself stays what it was.

A daemon killed outright leaves its socket file with no one listening on it (connection
refused); a host taken away leaves none (no such file). Both are made here without a
daemon: a bound, never listening Unix socket, and a path with nothing at it.
"""

import gc
import socket

import docker
import pytest
from docker.constants import DEFAULT_DOCKER_API_VERSION

from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import HostLost, SandboxError

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    # The SDK's unix transport leaks the socket of a connect that fails (docker 7.2,
    # transport/unixconn.py; tests/sandboxes/test_hosts.py).
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(autouse=True)
def collect_leaked_sockets():
    """The leaked sockets' warnings show up here, within this module's tests."""
    yield
    gc.collect()


def _connection(url: str) -> Connection:
    """A client that does not ask the daemon its API version (it could not answer)."""
    return Connection(docker.DockerClient(base_url=url, version=DEFAULT_DOCKER_API_VERSION),
                      url=url)


@pytest.fixture
def dead_socket(tmp_path):
    """The socket file of a daemon that was killed: there, but refusing connections."""
    path = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(path))
        yield f"unix://{path}"


@pytest.mark.parametrize("where", ["dead_socket", "no_socket"])
async def test_a_daemon_out_of_reach_is_host_lost_naming_it(where, request, tmp_path):
    url = (request.getfixturevalue("dead_socket") if where == "dead_socket"
           else f"unix://{tmp_path}/nothing.sock")
    with _connection(url) as connection:
        for call in (connection.client.containers.list, connection.client.api.version):
            with pytest.raises(HostLost, match=f"the Docker daemon at {url} does not answer"):
                await connection.call(call)


async def test_an_error_of_the_call_itself_is_not_a_lost_host():
    with (_connection("unix:///tmp/undertow-nowhere.sock") as connection,
          pytest.raises(ValueError, match="bad")):
        await connection.call(_raise_value_error)
    assert issubclass(HostLost, SandboxError)


def _raise_value_error():
    raise ValueError("bad")
