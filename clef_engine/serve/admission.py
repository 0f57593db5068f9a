"""Admission of big requests, kept apart from the handlers: big bodies are parsed in worker processes, one at a time
per client address, and big requests are prepared in turns per client, so that one client sending costly requests
back to back takes at most a share of the time every other request needs too."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from .bodies import api_error, request_from_json

BIG_BODY_BYTES = 1 << 20  # bodies from this size on are parsed in the big-body processes
BIG_BODY_WORKERS = 2
# Requests whose Content-Length is at least this (or not given) are prepared in turns per client: see Turns.
PACED_REQUEST_BYTES = 64 * 1024
PACED_SHARE = 0.25  # of the time, at most, that one client's big requests are prepared while others wait
PACED_CLIENTS_KEPT = 1024  # clients resting after a big request, remembered; past it those done resting are dropped


class BigBodies:
    """Big bodies are parsed in processes of their own, one at a time per client address: json.loads of a body of
    many megabytes is one C call holding the GIL throughout, so in a thread of the server's process it would stall
    every other request (and the engine's thread) for as long; in a worker process it only takes a core. The pool
    is started at the first big body (a process pool costs its workers' memory, and most servers never see one)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._turns = Turns(share=1.0)  # one at a time per client, no rest after

    async def parse(self, client: str, raw: bytes, parts: dict) -> tuple[dict, dict[int, str]]:
        """`request_from_json(raw, parts)` off the event loop: a small body in the thread pool, a big one here."""
        if len(raw) < BIG_BODY_BYTES:
            return await run_in_threadpool(request_from_json, raw, parts)
        turn = await self._turns.begin(client, lambda: False, None)
        try:
            return await self._in_pool(raw, parts)
        finally:
            turn.end()

    async def _in_pool(self, raw: bytes, parts: dict) -> tuple[dict, dict[int, str]]:
        pool = self._pool
        if pool is None:
            # spawn, not fork: this process holds the engine's threads (and a GPU context) that a fork would copy
            # half-way; the workers import only the torch-free contract and bodies.py.
            pool = self._pool = concurrent.futures.ProcessPoolExecutor(
                BIG_BODY_WORKERS, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent,
                initargs=(os.getpid(),))
        try:
            # The body travels through a file, not the pool's pipe: pickling tens of megabytes holds the GIL for as
            # long as parsing them would, while a file's write is a system call that lets go of it.
            with tempfile.NamedTemporaryFile(prefix="clef-body-") as spool:
                await run_in_threadpool(spool.write, raw)  # a body this big skips the file's buffer
                spool.flush()
                return await asyncio.wrap_future(pool.submit(request_from_json, spool.name, parts))
        except BrokenProcessPool:
            # a worker died under this body (the kernel's out-of-memory killer): the body's size, not a fault; the
            # next big body gets fresh workers
            if self._pool is pool:
                self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise MemoryError from None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """A big-body worker's initializer: the kernel kills it when the server's process dies, however it dies
    (SIGKILL included: no handler of the server's runs then, and a worker blocked on its task queue would otherwise
    wait forever, keeping multiprocessing's resource tracker alive with it, since the tracker exits when the last
    process holding its pipe is gone). The signal comes when the thread that started the worker ends: that is the
    event loop's thread, which `submit` starts workers from and which lives as long as the server."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the server died before the line above: no signal will come
        os._exit(0)


class Turns:
    """Big requests are prepared (read, parsed, validated, encoded: the work done in this process before the engine
    queues them) one at a time per client address, and while other requests are in flight a client's next big one
    waits in proportion to what its last one cost: after one that took t seconds to prepare, t × (1/share − 1).
    A client sending costly requests back to back (30 MB bodies refused over budget, thousands of questions) so
    takes at most `share` of the time, and of the GIL, that every other request needs too; alone on the server it
    is never held back. Whoever waits longer than `timeout` for its turn gets 429."""

    def __init__(self, share: float):
        self.rest_per_second = 1 / share - 1
        self._clients: dict[str, Turn] = {}

    async def begin(self, client: str, others_in_flight: Callable[[], bool], timeout: float | None) -> Paced:
        """The client's turn once its earlier one has ended (and rested while `others_in_flight()`); 429 past
        `timeout` seconds (None: no limit)."""
        turn = self._clients.setdefault(client, Turn())
        turn.users += 1
        acquired = False
        try:
            await asyncio.wait_for(turn.lock.acquire(), timeout)
            acquired = True
            delay = turn.ready_at - time.monotonic()
            if delay > 0 and others_in_flight():
                await asyncio.sleep(delay if timeout is None else min(delay, timeout))
        except BaseException as exc:  # timed out, or the client went away while waiting
            if acquired:
                turn.lock.release()
            self.leave(client, turn)
            if isinstance(exc, TimeoutError):
                raise api_error(429, "overloaded", "this client's earlier large requests are still being prepared; "
                                "send large requests one at a time", retry_after=1) from None
            raise
        return Paced(self, client, turn)

    def leave(self, client: str, turn: Turn) -> None:
        turn.users -= 1
        if not turn.users and turn.ready_at <= time.monotonic():
            del self._clients[client]
        if len(self._clients) > PACED_CLIENTS_KEPT:  # clients whose rest is over are forgotten
            now = time.monotonic()
            for stale in [name for name, kept in self._clients.items() if not kept.users and kept.ready_at <= now]:
                del self._clients[stale]


@dataclass
class Paced:
    """A big request's turn, from its start until `end` (called once it is queued in the engine, or answered)."""

    turns: Turns
    client: str
    turn: Turn
    started: float = field(default_factory=time.monotonic)
    _ended: bool = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            ended = time.monotonic()
            self.turn.ready_at = ended + (ended - self.started) * self.turns.rest_per_second
            self.turn.lock.release()
            self.turns.leave(self.client, self.turn)


@dataclass
class Turn:
    """One client's turn, how many of its requests want it, and when its next one may start."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    ready_at: float = 0.0
