"""Roll call and roster: the processes of a run check in with process 0 and stay connected.

jax.distributed.initialize waits for all processes in one barrier and, at its timeout, aborts
with "Deadline Exceeded" without saying who is missing. The roll call runs first, on the
coordinator's own port (its listening socket is closed again before JAX binds that port, so no
other port must be open), and names the processes that are missing or that disagree on the
number of processes.

The connections stay open for the whole run (process 0 ↔ every other process): a process that
ends says so first ("done", or "failed" with its exit code and error), so a connection that
closes without a word means its process died. Process 0 relays failures to everybody, so every
process learns within moments which process failed and why, instead of waiting for JAX's
heartbeat timeout.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress

from meshtrain.errors import ConfigError, DistributedError

# How long a connected process waits past its own deadline for process 0's verdict.
VERDICT_GRACE_S = 10.0
# How long process 0 waits for the others to hear a failure before it ends itself (when it
# ends, JAX ends the others with its own, less telling message).
SETTLE_S = 5.0
_MAX_MESSAGE = 65536


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of an address written host:port or [v6 host]:port."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket, timeout: float) -> dict | None:
    """One JSON line, or None if the peer closed, timed out or sent something else."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n") and len(data) < _MAX_MESSAGE:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(1)  # byte by byte: nothing after the line may be consumed here
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16])
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > 16 else "")


class Roster:
    """The open connections after the roll call: process 0 to each other process, each other
    process to process 0 (`peers`: rank → (socket, host name))."""

    def __init__(self, process_id: int, peers: dict[int, tuple[socket.socket, str]]) -> None:
        self.process_id = process_id
        self.news: tuple[int, str] | None = None  # (exit code, message): the first failure heard
        self._news_at = 0.0
        self._peers = peers
        self._open = set(peers)
        self._finished: set[int] = set()  # peers that said "done"
        self._leaving = False  # this process said "failed": news no longer matters
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()  # news heard or a connection closed
        for conn, _ in peers.values():
            conn.settimeout(None)

    def _broadcast(self, message: dict, skip: int | None = None) -> None:
        with self._send_lock:
            for rank, (conn, _) in self._peers.items():
                if rank != skip and rank in self._open:
                    with suppress(OSError):  # it is gone; the watch thread notices
                        _send(conn, message)

    def say_done(self) -> None:
        """This process ends normally: its connection closing is no news."""
        self._broadcast({"done": True})

    def say_failed(self, code: int, error: str) -> None:
        """This process fails with exit code `code`; process 0 relays it to everybody."""
        self._leaving = True
        text = f"process {self.process_id} failed: {error}"
        self._broadcast({"failed": self.process_id, "code": code, "text": text})

    def wait_until_closed(self, timeout: float) -> None:
        """Waits until every peer has closed its connection (on process 0: all have heard)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._open, timeout)

    def wait_for_news(self, timeout: float) -> tuple[int, str] | None:
        """The first failure of another process, waiting up to `timeout` seconds to hear one."""
        with self._changed:
            self._changed.wait_for(lambda: self.news is not None, timeout)
            return self.news

    def watch(self, on_failure: Callable[[int, str], None]) -> None:
        """Calls on_failure(exit code, message) from a thread when another process fails or dies."""
        thread = threading.Thread(
            target=self._watch, args=(on_failure,), name="meshtrain-roster", daemon=True
        )
        thread.start()

    def _hear(self, code: int, text: str, relay: dict, sender: int) -> None:
        if self.news is not None:
            return
        with self._changed:
            self.news, self._news_at = (code, text), time.monotonic()
            self._changed.notify_all()
        if self.process_id == 0:
            self._broadcast(relay, skip=sender)

    def _closed(self, rank: int) -> None:
        with self._changed:
            self._open.discard(rank)
            self._changed.notify_all()
        if rank not in self._finished:
            role = ", the coordinator," if rank == 0 else ""
            log = "train.log" if rank == 0 else f"rank{rank}.log"
            text = (
                f"process {rank} (on {self._peers[rank][1]}){role} ended without a word: killed, "
                f"out of memory or crashed inside JAX; see its output (or {log} in the run "
                "directory)"
            )
            code = DistributedError.exit_code
            self._hear(code, text, {"failed": rank, "code": code, "text": text}, rank)

    def _received(self, rank: int, message: dict) -> None:
        if message.get("done"):
            self._finished.add(rank)
        elif "failed" in message:
            self._hear(int(message["code"]), str(message["text"]), message, rank)

    def _watch(self, on_failure: Callable[[int, str], None]) -> None:
        selector = selectors.DefaultSelector()
        for rank, (conn, _) in self._peers.items():
            selector.register(conn, selectors.EVENT_READ, rank)
        pending = {rank: b"" for rank in self._peers}
        while True:
            for key, _ in selector.select(timeout=0.5):
                rank, conn = key.data, key.fileobj
                try:
                    chunk = conn.recv(4096)
                except OSError:
                    chunk = b""
                if not chunk:
                    selector.unregister(conn)
                    conn.close()
                    self._closed(rank)
                    continue
                *lines, pending[rank] = (pending[rank] + chunk).split(b"\n")
                for line in lines:
                    with suppress(ValueError):
                        self._received(rank, json.loads(line))
            if self.news is None or self._leaving:
                if not self._open:
                    return
                continue
            # Process 0 gives the others a moment to hear the news before it goes.
            if self.process_id == 0 and self._open and time.monotonic() - self._news_at < SETTLE_S:
                continue
            on_failure(*self.news)
            return


def roll_call(address: str, num_processes: int, process_id: int, timeout_s: float) -> Roster:
    """Returns once all processes have checked in; raises DistributedError or ConfigError otherwise.

    Process 0 listens on the port of `address` and answers everybody at once; the others
    connect to `address`, retrying until process 0 is up.
    """
    host, port = split_address(address)
    if process_id == 0:
        return _collect(port, num_processes, timeout_s, address)
    return _check_in(host, port, num_processes, process_id, timeout_s, address)


def _check_hello(hello: dict, num_processes: int, seen: dict) -> str | None:
    rank, world, where = hello.get("rank"), hello.get("world_size"), hello.get("host", "?")
    if not isinstance(rank, int) or not isinstance(world, int):
        return f"a process on {where} sent a malformed check-in"
    if world != num_processes:
        return (
            f"process {rank} on {where} was started with {world} processes in all (WORLD_SIZE or "
            f"distributed.num_processes) but process 0 with {num_processes}; give every process "
            "the same value"
        )
    if not 0 < rank < num_processes:
        return (
            f"a process on {where} has rank {rank}, but process 0 is already up and ranks run "
            f"0..{num_processes - 1}; give every process its own RANK"
        )
    if rank in seen:
        return (
            f"two processes have rank {rank} ({seen[rank][1]} and {where}); give every process its "
            "own RANK (with `meshtrain.launch`, RANK is the machine's first rank)"
        )
    return None


def _collect(port: int, num_processes: int, timeout_s: float, address: str) -> Roster:
    deadline = time.monotonic() + timeout_s
    dual = socket.has_dualstack_ipv6()
    try:
        server = socket.create_server(
            ("", port), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual
        )
    except OSError as err:
        raise DistributedError(
            f"process 0 cannot listen on port {port} (coordinator {address}): {err.strerror}; "
            "another run may hold it: choose another MASTER_PORT or distributed.coordinator_address"
        ) from None
    peers: dict[int, tuple[socket.socket, str]] = {}
    rejected: list[socket.socket] = []
    problem: str | None = None
    with server:  # closed before JAX binds the port; the accepted connections stay open
        while len(peers) < num_processes - 1 and problem is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            server.settimeout(remaining)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            hello = _receive(conn, min(remaining, 10.0))
            if hello is None:  # not one of ours (a port scanner, a stale client): ignore it
                conn.close()
                continue
            problem = _check_hello(hello, num_processes, peers)
            if problem is None:
                peers[hello["rank"]] = (conn, str(hello.get("host", "?")))
            else:
                rejected.append(conn)
    missing = [rank for rank in range(1, num_processes) if rank not in peers]
    if problem is None and not missing:
        for conn, _ in peers.values():
            _send(conn, {"ok": True})
        return Roster(0, peers)
    verdict = (
        {"error": problem, "kind": "config"}
        if problem
        else {
            "error": (
                f"process{'es' if len(missing) > 1 else ''} {_ranks(missing)} of {num_processes} "
                f"did not check in with process 0 at {address} within distributed.timeout_s="
                f"{timeout_s:g}s: not started, crashed before joining, or unable to reach "
                "that address (wrong coordinator address, firewall); see their logs"
            )
        }
    )
    for conn in [*(c for c, _ in peers.values()), *rejected]:
        with conn, suppress(OSError):
            _send(conn, verdict)
    error = ConfigError if verdict.get("kind") == "config" else DistributedError
    raise error(verdict["error"])


def _check_in(
    host: str, port: int, num_processes: int, process_id: int, timeout_s: float, address: str
) -> Roster:
    deadline = time.monotonic() + timeout_s
    hello = {"rank": process_id, "world_size": num_processes, "host": socket.gethostname()}
    reached = False
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            conn = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError:
            time.sleep(min(0.2, remaining))
            continue
        reached = True
        try:
            _send(conn, hello)
            verdict = _receive(conn, remaining + VERDICT_GRACE_S)
        except OSError:
            verdict = None
        if verdict is not None and verdict.get("ok"):
            return Roster(process_id, {0: (conn, host)})
        conn.close()
        if verdict is None:  # process 0 went away or this port is not ours: try again
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
            continue
        error = ConfigError if verdict.get("kind") == "config" else DistributedError
        raise error(f"process 0 reports: {verdict.get('error')}")
    if reached:
        raise DistributedError(
            f"process {process_id} reached {address} but process 0 did not confirm that all "
            f"{num_processes} processes arrived within distributed.timeout_s={timeout_s:g}s; see "
            "process 0's log"
        )
    raise DistributedError(
        f"process {process_id} could not reach process 0 at {address} within "
        f"distributed.timeout_s={timeout_s:g}s: process 0 was not started or failed, the address "
        f"is wrong, or a firewall blocks port {port}"
    )
