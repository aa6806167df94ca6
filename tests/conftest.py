"""The suite's order under ``make test-parallel`` (``pytest -n 2 --dist loadfile``): each worker takes the next file
in collection order when it is free, so the files that run longest go first and the short in-process ones fill the
end; in collection order a long file taken last would run alone while the other worker sits idle. A run in one
process (``make test``) keeps pytest's own order."""

from __future__ import annotations

import pytest

#: the files that took longest in a full run on 2 cores (minutes each; 3-6 min for the first), longest first
LONGEST_FIRST = ("test_demo.py", "test_redundancy_mp.py", "test_chaos.py", "test_cluster_netns.py",
                 "test_deepspeed_door.py", "test_strategy_mp.py", "test_async_checkpoint.py", "test_launcher_local.py",
                 "test_precision_mp.py", "test_refusal.py", "test_peers.py", "test_runner.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not (getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput")):
        return  # not under pytest-xdist
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.helpers import stop_shared_fork_server

    stop_shared_fork_server()  # and with it every worker it forked that still runs
