"""The suite's order in ``make test``'s two lanes (``pytest -n 2 --dist loadfile``): each worker takes the next file
in collection order when it is free, so the files that run longest go first and the short in-process ones fill the
end; in collection order a long file taken last would run alone while the other worker sits idle. A run in one
process (``make test-one``) keeps pytest's own order. Tests marked ``serial`` run after the lanes, alone."""

from __future__ import annotations

import os
import time

import pytest

#: the files that took longest in a full run on 2 cores (minutes each; 3-6 min for the first), longest first
LONGEST_FIRST = ("test_demo.py", "test_redundancy_mp.py", "test_chaos.py", "test_cluster_netns.py",
                 "test_deepspeed_door.py", "test_doors.py", "test_strategy_mp.py", "test_async_checkpoint.py", "test_launcher_local.py",
                 "test_precision_mp.py", "test_refusal.py", "test_peers.py", "test_runner.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "serial: timing-bound under a second lane's load (an outage that must stay "
                                       "shorter than a lease): `make test` runs these alone, after the lanes")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not (getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput")):
        return  # not under pytest-xdist
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.helpers import stop_shared_fork_server

    stop_shared_fork_server()  # and with it every worker it forked that still runs


#: where a run writes, for each test, its wall seconds and the CPU seconds the whole machine used meanwhile (one JSON
#: line each; unset: nothing is written). On a machine that runs nothing else, in one process, that is what the test
#: costs in CPU, its workers, servers and forks included: what decides how it shares cores with another lane.
CPU_LOG_ENV = "BAMBOO_TEST_CPU_LOG"


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = os.environ.get(CPU_LOG_ENV)
    if not path:
        yield
        return
    wall, busy = time.monotonic(), _busy_seconds()
    yield
    import json

    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - wall, 2),
                            "cpu": round(_busy_seconds() - busy, 2)}) + "\n")
