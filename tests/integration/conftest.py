import pytest

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from tests.backends import BackendFleet


@pytest.fixture(scope="module")
def fleet():
    f = BackendFleet(4)
    yield f
    f.close()


@pytest.fixture(scope="module")
def kvroute(fleet):
    with KVRouteProcess(fleet.addresses, extra_args=["--model", "m", "--model", "other"]) as k:
        yield k


@pytest.fixture(scope="module")
def envoy(kvroute, fleet):
    with EnvoyProcess("epp.yaml", kvroute_port=kvroute.ext_proc_port, pods=fleet.addresses) as e:
        yield e
