"""Data parallelism across hosts: engine cores that dial the API server over TCP.

vLLM spreads `--data-parallel-size N` over hosts with the same command on each: the API server's
host runs ranks 0..L-1 (`--data-parallel-size-local L`) and listens at `--data-parallel-address`
: `--data-parallel-rpc-port`; every other host runs `vllm serve --headless` with its own local
count and `--data-parallel-start-rank S`, and its engine cores connect to that address and take
part in the server's handshake (vllm/v1/engine/utils.py `CoreEngineProcManager`,
`wait_for_engine_startup`). minivllm does the same with the standard library:

- On the API server's host, `accept_remote_cores` listens and waits for the ranks it does not run.
  Each connection first passes multiprocessing's HMAC challenge (`MINIVLLM_DP_AUTHKEY`, envs.py),
  so nothing is unpickled from a peer that lacks the key; then the core says `CoreHello` (its rank,
  the DP size it was started with, its host and pid) and is answered `None` (welcome) or why it is
  refused. It becomes a `RemoteEngineCoreClient`: an `EngineCoreClient` whose pipe is the TCP
  connection -- `multiprocessing.connection.Connection` over a socket has the pipe's `send`,
  `recv` and `poll`, so the core, its handshake (`CoreReady`) and the frontend's reader thread are
  the local ones, unchanged.
- On every other host, `run_headless_cores` (`minivllm serve --headless`) spawns that host's
  cores, ranks S..S+L2-1. Each dials the server (again and again while it is not listening yet),
  says hello and runs `run_engine_core` on the connection. The headless process only watches them:
  a core that dies fails the whole server anyway (dp_client.py), so the headless process then
  stops its other cores and exits 1; after the server's shutdown every core exits 0, and so does
  it. Each core dies with the headless process (`PR_SET_PDEATHSIG`).

Each host builds its engine from its own command line, as in vLLM, so the model must be the same
files everywhere; the server checks the DP size at the hello and the vocabulary at the handshake.
The connection carries pickles: as with vLLM's RPC port, keep it inside a trusted network, and set
`MINIVLLM_DP_AUTHKEY` on every host where anyone else can reach the port.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import (
    Client,
    Connection,
    answer_challenge,
    deliver_challenge,
    wait,
)
from multiprocessing.process import BaseProcess

from minivllm.config import EngineConfig
from minivllm.engine.core import Shutdown, die_with_parent, run_engine_core
from minivllm.engine.core_client import SHUTDOWN_TIMEOUT_S, STARTUP_TIMEOUT_S, EngineCoreClient
from minivllm.envs import dp_authkey

logger = logging.getLogger("minivllm")

DIAL_RETRY_S = 0.5  # a headless host may start before the API server listens


@dataclass
class CoreHello:  # remote core -> API server, first: who it is
    data_parallel_rank: int
    data_parallel_size: int  # what its host was started with: must be the server's
    host: str
    pid: int


# ---------------------------------------------------------------------- the API server's host
class RemoteEngineCoreClient(EngineCoreClient):
    """A core on another host, driven over its TCP connection; it has no process here, so its
    liveness is its connection's, and its errors name its host."""

    def __init__(self, config: EngineConfig, conn: Connection, hello: CoreHello) -> None:
        self._load_tokenizer(config)
        self.conn = conn
        self.hello = hello
        self.name = f"engine core {hello.data_parallel_rank} (pid {hello.pid} on {hello.host})"
        self._send_lock = threading.Lock()
        self._closed = False
        atexit.register(self.shutdown)

    def alive(self) -> bool:
        return not self._closed

    def exit_status(self, timeout: float) -> str:
        self._closed = True  # its connection ended: that is all this host can know
        return "its connection closed"

    def shutdown(self) -> None:
        """Tell the core to stop (it answers and exits), wait for its connection to end (the
        reader thread, if any, has taken the answer), and close it; idempotent."""
        if self.conn.closed:
            return
        self.send(Shutdown())
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        with contextlib.suppress(EOFError, OSError):
            while time.monotonic() < deadline:
                if self.conn.poll(0.1):
                    self.conn.recv()  # its last outputs, when no reader took them
        self._closed = True
        self.conn.close()


def accept_remote_cores(
    config: EngineConfig, server: socket.socket, give_up: Callable[[], bool] = lambda: False
) -> list[RemoteEngineCoreClient]:
    """The cores of ranks data_parallel_size_local..N-1, in rank order, once each has dialed
    `server` (a listening socket at the coordinator's address) and said hello. A core whose hello
    disagrees with this server is refused: the start fails, naming the field. Returns early, with
    those connected so far, once `give_up()` (a local core died: its own error says why)."""
    parallel = config.parallel
    n, local = parallel.data_parallel_size, parallel.data_parallel_size_local
    assert local is not None
    cores: dict[int, RemoteEngineCoreClient] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    host, port = parallel.coordinator_address
    address = f"{host}:{port}"
    logger.info("data parallel: waiting for ranks %d..%d to connect at %s", local, n - 1, address)
    try:
        while len(cores) < n - local and not give_up():
            if time.monotonic() > deadline:
                missing = sorted(set(range(local, n)) - set(cores))
                raise RuntimeError(
                    f"data-parallel ranks {missing} did not connect to {address} in "
                    f"{STARTUP_TIMEOUT_S:.0f} s: start them with `minivllm serve MODEL --headless "
                    f"--data-parallel-size {n} ...` on their host"
                )
            if not select.select([server], [], [], 0.5)[0]:
                continue
            sock, peer = server.accept()
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, dp_authkey())  # as multiprocessing's Listener.accept
                answer_challenge(conn, dp_authkey())
                hello = conn.recv() if conn.poll(30.0) else None
            except (OSError, EOFError, mp.AuthenticationError) as exc:
                logger.warning("data parallel: refused a connection from %s: %s", peer, exc)
                conn.close()
                continue
            refusal = _refusal(hello, n, local, cores)
            conn.send(refusal)
            if refusal is not None:
                conn.close()
                raise ValueError(refusal)
            assert isinstance(hello, CoreHello)
            cores[hello.data_parallel_rank] = RemoteEngineCoreClient(config, conn, hello)
            logger.info("data parallel: %s connected", cores[hello.data_parallel_rank].name)
    except BaseException:
        for core in cores.values():
            core.shutdown()
        raise
    return [cores[rank] for rank in sorted(cores)]


def _refusal(
    hello: object, n: int, local: int, taken: dict[int, RemoteEngineCoreClient]
) -> str | None:
    """Why this server cannot take the core that said `hello`, or None."""
    if not isinstance(hello, CoreHello):
        return f"expected a CoreHello from an engine core, got {type(hello).__name__}"
    where = f"the core of data-parallel rank {hello.data_parallel_rank} on {hello.host}"
    if hello.data_parallel_size != n:
        return (
            f"{where} was started with data_parallel_size={hello.data_parallel_size}; the API "
            f"server's is {n}: give every host the same --data-parallel-size"
        )
    if not local <= hello.data_parallel_rank < n:
        return (
            f"{where}: the API server's host runs ranks 0..{local - 1} itself and waits for ranks "
            f"{local}..{n - 1}: check --data-parallel-start-rank and --data-parallel-size-local"
        )
    if hello.data_parallel_rank in taken:
        return (
            f"{where}: rank {hello.data_parallel_rank} is already connected "
            f"({taken[hello.data_parallel_rank].name}): check --data-parallel-start-rank"
        )
    return None


def listen_for_cores(config: EngineConfig) -> socket.socket:
    """The coordinator's listening socket, opened before the local cores start loading, so that
    the other hosts' cores can dial in meanwhile."""
    address = config.parallel.coordinator_address
    try:
        return socket.create_server(address, backlog=config.parallel.data_parallel_size)
    except OSError as exc:
        raise ValueError(
            f"data_parallel_address:data_parallel_rpc_port {address[0]}:{address[1]} cannot be "
            f"listened on ({exc.strerror}); pick another port or an address of this host"
        ) from None


# ---------------------------------------------------------------------- the other hosts
def run_remote_engine_core(
    config: EngineConfig, rank: int, parent_pid: int, torch_threads: int, visible: str | None
) -> None:
    """A headless host's core (a spawned process): dial the API server, say hello, and run the
    engine core on the connection."""
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s (core): %(message)s")
    address = config.parallel.coordinator_address
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            conn = Client(address, authkey=dp_authkey())
            break
        except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(DIAL_RETRY_S)
    conn.send(
        CoreHello(rank, config.parallel.data_parallel_size, socket.gethostname(), os.getpid())
    )
    refusal = conn.recv()
    if refusal is not None:
        logger.error("the API server at %s:%d refused this core: %s", *address, refusal)
        raise SystemExit(1)
    run_engine_core(conn, config, parent_pid, torch_threads, visible)


def run_headless_cores(
    config: EngineConfig, torch_threads: int, visible_devices: list[str | None]
) -> int:
    """`minivllm serve --headless` with data parallelism: this host's cores, ranks start..
    start+local-1, each dialing the API server; returns once they are all gone (0: the server shut
    them down; 1: one died, and the others were stopped)."""
    parallel = config.parallel
    start, local = parallel.data_parallel_start_rank, parallel.data_parallel_size_local
    assert start is not None and local is not None
    ctx = mp.get_context("spawn")
    processes: list[BaseProcess] = []
    for i, rank in enumerate(range(start, start + local)):
        args = (config, rank, os.getpid(), torch_threads, visible_devices[i])
        process = ctx.Process(target=run_remote_engine_core, args=args,
                              name=f"minivllm-engine-core-{rank}")  # fmt: skip
        process.start()
        processes.append(process)
    logger.info(
        "headless: data-parallel ranks %d..%d (pids %s) dialing the API server at %s:%d",
        start,
        start + local - 1,
        ", ".join(str(p.pid) for p in processes),
        *parallel.coordinator_address,
    )
    # SIGTERM ends this process as Ctrl-C does: through the finally below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    failed = False
    try:
        remaining = list(processes)
        while remaining:
            wait([p.sentinel for p in remaining])
            for p in [p for p in remaining if not p.is_alive()]:
                remaining.remove(p)
                if p.exitcode != 0:
                    logger.error("headless: %s ended (exit code %s)", p.name, p.exitcode)
                    failed = True
            if failed:
                break
    except KeyboardInterrupt:
        failed = True
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()  # its connection's end tells the API server which rank is gone
            p.join()
    return 1 if failed else 0
