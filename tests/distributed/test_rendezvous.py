"""The roll call names missing and inconsistent processes; the roster spreads failures at once."""

import queue
import socket
import threading

import pytest

from meshtrain.distributed.launcher import free_port
from meshtrain.distributed.rendezvous import Roster, roll_call
from meshtrain.errors import ConfigError, DistributedError


def call_roll(world_sizes: dict[int, int], timeout_s: float = 20.0) -> dict[int, object]:
    """Runs roll_call for each rank (rank → the world size it believes) in threads; rank → result."""
    address = f"127.0.0.1:{free_port()}"
    results: dict[int, object] = {}

    def one(rank: int, world: int) -> None:
        results[rank] = _try(address, world, rank, timeout_s)

    threads = [threading.Thread(target=one, args=item) for item in world_sizes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s + 30)
    return results


def test_everybody_checks_in():
    results = call_roll({0: 3, 1: 3, 2: 3})
    assert all(isinstance(r, Roster) for r in results.values()), results
    assert {rank: r.process_id for rank, r in results.items()} == {0: 0, 1: 1, 2: 2}


def test_a_missing_process_is_named_by_everybody():
    results = call_roll({0: 4, 1: 4, 3: 4}, timeout_s=1.5)
    assert isinstance(results[0], DistributedError)
    assert str(results[0]).startswith(
        "process 2 of 4 did not check in with process 0 at 127.0.0.1:"
    )
    assert "within distributed.timeout_s=1.5s" in str(results[0])
    for rank in (1, 3):
        assert str(results[rank]) == f"process 0 reports: {results[0]}"


def test_process_0_missing():
    results = call_roll({1: 2}, timeout_s=1.0)
    assert isinstance(results[1], DistributedError)
    assert "process 1 could not reach process 0 at 127.0.0.1:" in str(results[1])


def test_different_world_sizes_are_bad_input():
    results = call_roll({0: 3, 1: 2})
    assert isinstance(results[0], ConfigError) and isinstance(results[1], ConfigError)
    assert (
        "was started with 2 processes in all (WORLD_SIZE or distributed.num_processes) but "
        "process 0 with 3" in str(results[0])
    )
    assert str(results[1]) == f"process 0 reports: {results[0]}"


def test_two_processes_with_one_rank():
    address = f"127.0.0.1:{free_port()}"
    results = {}
    server = threading.Thread(target=lambda: results.setdefault(0, _try(address, 3, 0)))
    server.start()
    first = threading.Thread(target=lambda: results.setdefault("a", _try(address, 3, 1)))
    first.start()
    # The second rank-1 process arrives once the first has checked in.
    threading.Timer(0.5, lambda: results.setdefault("b", _try(address, 3, 1))).start()
    server.join(timeout=30)
    first.join(timeout=30)
    assert isinstance(results[0], ConfigError)
    assert "two processes have rank 1" in str(results[0])


def _try(address, world, rank, timeout_s=10.0):
    try:
        return roll_call(address, world, rank, timeout_s)
    except (ConfigError, DistributedError) as err:
        return err


@pytest.fixture(autouse=True)
def short_settle(monkeypatch):
    # Process 0 waits this long for the others to hear news; here nobody exits on news.
    monkeypatch.setattr("meshtrain.distributed.rendezvous.SETTLE_S", 0.2)


def _watched(rosters: dict[int, Roster]) -> dict[int, queue.Queue]:
    heard = {rank: queue.Queue() for rank in rosters}
    for rank, roster in rosters.items():
        roster.watch(lambda code, text, rank=rank: heard[rank].put((code, text)))
    return heard


def test_a_process_that_dies_is_named_by_the_others():
    rosters = call_roll({0: 3, 1: 3, 2: 3})
    heard = _watched({0: rosters[0], 1: rosters[1]})
    conn, _ = rosters[2]._peers[0]  # what the OS does when process 2 dies
    conn.shutdown(socket.SHUT_RDWR)
    conn.close()
    for rank in (0, 1):
        code, text = heard[rank].get(timeout=20)
        assert code == 1
        assert text.startswith("process 2 (on ") and "ended without a word" in text


def test_a_failure_reaches_everybody_with_its_exit_code():
    rosters = call_roll({0: 3, 1: 3, 2: 3})
    heard = _watched({0: rosters[0], 2: rosters[2]})
    rosters[1].say_failed(2, "model.mesh_shape is wrong")
    for rank in (0, 2):
        assert heard[rank].get(timeout=20) == (2, "process 1 failed: model.mesh_shape is wrong")
    assert rosters[0].wait_for_news(0) == (2, "process 1 failed: model.mesh_shape is wrong")


def test_a_process_that_says_done_may_go():
    rosters = call_roll({0: 2, 1: 2})
    heard = _watched({0: rosters[0]})
    rosters[1].say_done()
    conn, _ = rosters[1]._peers[0]
    conn.close()
    rosters[0].wait_until_closed(20)
    assert rosters[0].wait_for_news(0.5) is None
    assert heard[0].empty()


def test_port_in_use_is_named():
    with socket.create_server(("", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(DistributedError) as err:
            roll_call(f"127.0.0.1:{port}", 2, 0, 1.0)
    assert f"process 0 cannot listen on port {port}" in str(err.value)
