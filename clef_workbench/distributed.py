"""Batch runs on a Ray cluster (docs/operations.md says what a person sees): one engine replica per GPU as a Ray
actor; the driver streams a run's cases to them in token-sized chunks. `RayJobRunner` is a JobRunner whose work loop
sends chunks to replicas, so the lease, progress, cancel, resume and every store field are JobRunner's.

Plain actors rather than Ray Data's `map_batches`, for less code of ours: a chunk and its results pass through an
actor call as they are (Ray Data would turn nested responses into Arrow columns and back), and what a run needs
beyond "call the replicas" (record each chunk as it returns, stop on cancel, put a dead replica's chunks back) is a
few lines of `on_replicas`. A replica Ray restarts (up to MAX_RESTARTS) loads the release again and gets its chunks
again; one dead for good is dropped and its chunks go to the others first. Store.record_results keeps the first
result of a (run, case), so a chunk computed twice is stored once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from clef_engine.errors import ClefError, ReleaseError
from clef_engine.interface import DecisionEngine
from clef_workbench.casesets import build_request
from clef_workbench.jobs import JobRunner, _LiveJob, validated
from clef_workbench.settings import ENVIRONMENT, WorkbenchSettings
from clef_workbench.store import NewResult, Run, RunSettings, Store, now_iso

log = logging.getLogger(__name__)

# `ray` is imported where a run goes to Ray, not here: the workbench imports this module for make_job_runner, and
# importing Ray takes seconds that a workbench without a cluster should not pay.
ADDRESS_ENV = ENVIRONMENT["ray_address"]
IN_FLIGHT_PER_REPLICA = 2  # the next chunk waits on the replica while one runs: no round trip between chunks
MAX_RESTARTS = 3  # per replica; one that dies more often is dropped and the others go on
CASES_PER_READ = 256  # cases read from the store at a time while cutting chunks (a run can hold millions)
# A replica's engine refuses work past 4,096 records waiting (BusyError): its IN_FLIGHT_PER_REPLICA chunks of short
# cases stay under that.
MAX_CASES_PER_CHUNK = 1_024
# Chunks are cut before tokenizing (the driver may have no release): a case's tokens are estimated from its text,
# then scaled by what the replicas counted in the chunks already answered (TokenEstimate).
CHARS_PER_TOKEN = 4  # English text under Qwen's tokenizer is ~4 characters a token
TOKENS_PER_IMAGE = 1_024  # order of magnitude of a resized photo under the Qwen3.5 processor
TOKENS_PER_VIDEO = 8_192


class ReplicaError(RuntimeError):
    """No replica could be started, or every replica failed; the message names the node and the cause."""


def ray_address(explicit: str | None = None) -> str | None:
    """The cluster to run batch runs on: an explicit address, else CLEF_RAY_ADDRESS; None means in-process."""
    if explicit is None:
        return WorkbenchSettings.from_env().ray_address
    return explicit.strip() or None


def connect(address: str) -> None:
    """Join the Ray cluster at `address` (`auto` or the head's `host:6379`) unless already connected."""
    import ray

    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:  # no cluster there, a malformed address
            # Ray's own advice names its CLI's `--address` flag and RAY_ADDRESS; ours are --ray and CLEF_RAY_ADDRESS.
            reason = str(exc).split(" Please specify the one to connect to")[0]
            raise ReplicaError(f"cannot join the Ray cluster at {address!r}: {reason} Start one with `ray start "
                               f"--head`, or name a running one with --ray ADDRESS or {ADDRESS_ENV} ('auto' or the "
                               "head's host:6379).") from None


# -- the replica: one engine on one GPU (or on the CPUs) of some node --------------------------------------------

class Replica:
    """A Ray actor holding one resident engine. The engine loads on first use, so a replica that Ray restarts after
    a crash loads the release again by itself."""

    def __init__(self, source: str, revision: str | None, device: str | None, dtype: str | None):
        self.source, self.revision, self.device, self.dtype = source, revision, device, dtype
        self.engine: DecisionEngine | None = None
        # chunks run in IN_FLIGHT_PER_REPLICA threads: after a restart, the first two both find no engine, and
        # two threads importing transformers' lazy modules at once fail with ImportError
        self.loading = threading.Lock()

    def node(self) -> str:
        import ray

        return f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"

    def pid(self) -> int:
        return os.getpid()

    def load(self) -> dict:
        """Load the release from this node's Hugging Face cache (or folder); a missing release names the node."""
        with self.loading:
            if self.engine is None:
                import clef_engine

                try:
                    self.engine = clef_engine.load(self.source, revision=self.revision, device=self.device,
                                                   dtype=self.dtype)
                except ReleaseError as exc:
                    raise ReleaseError(f"on node {self.node()}: {exc}") from None
                except Exception as exc:  # out of memory, no GPU visible …: the driver's message names the node too
                    log.exception("on node %s: loading %s failed", self.node(), self.source)
                    raise ReplicaError(f"on node {self.node()}: {type(exc).__name__}: {exc}") from None
            engine = self.engine
        info = engine.info()
        return {"node": self.node(), "device": info["device"], "dtype": info["dtype"], "revision": info["revision"],
                "token_budget": engine.token_budget}

    def decide(self, items: list[tuple[int, dict]], settings: RunSettings) -> list[NewResult]:
        self.load()
        return decide_chunk(self.engine, items, settings)

    def decide_variants(self, requests: list[dict], settings: dict) -> tuple[list, int]:
        """One case of a schema sweep (`decide_case`): its state prefilled once here, every variant after."""
        self.load()
        return decide_case(self.engine, requests, settings)


def decide_case(engine: Any, requests: list[dict],
                settings: dict[str, Any]) -> tuple[list[tuple[Any, str | None]], int]:
    """One case's variants: (response, None) or (None, error) per variant, and how many states were prefilled for
    them. The local engine continues every variant from one prefilled state (its responses say which did not compute
    their state: `x_state_cached`); any other engine gets them as separate requests, a state each."""
    from clef_engine import Engine

    max_length, overflow = settings.get("max_length"), settings.get("overflow") or "refuse"
    try:
        if isinstance(engine, Engine):
            outcomes: list[Any] = engine.decide_variants(requests, max_length=max_length, overflow=overflow)
        else:
            outcomes = engine.decide_many(requests, errors="return", max_length=max_length, overflow=overflow)
    except ClefError as exc:  # the case's state cannot be decided (over the token budget): an error for each variant
        return [(None, str(exc))] * len(requests), 0
    answers: list[tuple[Any, str | None]] = [(None, str(o)) if isinstance(o, Exception) else (o, None)
                                             for o in outcomes]
    return answers, state_prefills(answers)


def state_prefills(answers: list[tuple[Any, str | None]]) -> int:
    """How many of these answers computed their state rather than continuing a kept one (`x_state_cached`)."""
    return sum(1 for response, _ in answers if response is not None and not response.get("x_state_cached"))


def decide_chunk(engine: Any, items: list[tuple[int, dict]], settings: RunSettings) -> list[NewResult]:
    """Results of one chunk, in the form Store.record_results takes and JobRunner writes: a bad case (invalid, over
    the token budget) becomes an error result and the others are still answered."""
    started_at = now_iso()
    valid, results = validated(engine, items, settings, started_at)
    if valid:
        began = time.perf_counter()
        outcomes = engine.decide_many([request for _, request in valid], priority="bulk", errors="return")
        results.extend(JobRunner._results(valid, outcomes, started_at, (time.perf_counter() - began) * 1000))
    return results


# -- the pool of replicas --------------------------------------------------------------------------------------

@dataclass
class _Slot:
    actor: Any
    node: str
    in_flight: int = 0


@dataclass
class ReplicaPool:
    """Replicas of one release on the cluster the driver is connected to; `start` makes one."""

    slots: list[_Slot]
    info: dict  # device, dtype, revision and token budget of the first replica; nodes of all
    dropped: list[str] = field(default_factory=list)  # nodes of replicas dead for good

    @classmethod
    def start(cls, source: str, *, revision: str | None = None, replicas: int | None = None,
              dtype: str | None = None) -> ReplicaPool:
        """One replica per GPU of the cluster (or `replicas` of them); on a cluster without GPUs, `replicas` CPU
        replicas (default 1). Waits until every replica has loaded the release; raises ReplicaError naming the
        node where one could not."""
        import ray
        from ray.exceptions import RayTaskError

        gpus = int(ray.cluster_resources().get("GPU", 0))
        count = replicas or gpus or 1
        resources = {"num_gpus": 1} if gpus else {"num_cpus": 1}
        actor_class = ray.remote(Replica).options(
            **resources, max_restarts=MAX_RESTARTS, max_task_retries=-1, max_concurrency=IN_FLIGHT_PER_REPLICA,
            # a release missing from a node's cache is an error there, not a 55 GB download
            runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
        actors = [actor_class.remote(str(source), revision, "cuda" if gpus else "cpu", dtype) for _ in range(count)]
        try:
            infos = ray.get([actor.load.remote() for actor in actors])
        except RayTaskError as exc:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise ReplicaError(f"a replica of {source} could not start: {_cause(exc)}") from None
        slots = [_Slot(actor, info["node"]) for actor, info in zip(actors, infos)]
        info = dict(infos[0], nodes=[i["node"] for i in infos], replicas=count)
        return cls(slots, info)

    def close(self) -> None:
        import ray

        for slot in self.slots:
            ray.kill(slot.actor, no_restart=True)
        self.slots = []

    def drop(self, slot: _Slot) -> None:
        """Forget a replica that is dead for good."""
        if slot in self.slots:
            self.slots.remove(slot)
            self.dropped.append(slot.node)


def _cause(exc: Exception) -> str:
    cause = getattr(exc, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(exc).strip().splitlines()[-1]


# -- chunks ------------------------------------------------------------------------------------------------------

def estimate_tokens(request: dict) -> int:
    state = request.get("state")
    text = state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)
    questions = json.dumps(request.get("questions"), ensure_ascii=False)
    return ((len(text) + len(questions)) // CHARS_PER_TOKEN + TOKENS_PER_IMAGE * len(request.get("images") or [])
            + TOKENS_PER_VIDEO * len(request.get("videos") or []))


@dataclass
class TokenEstimate:
    """Tokens of a request from its text, scaled by the ratio of counted to estimated tokens seen so far (the
    schema's share, templates and the tokenizer's own ratio are not in the text estimate)."""

    estimated: int = 0
    counted: int = 0

    def __call__(self, request: dict) -> int:
        ratio = self.counted / self.estimated if self.estimated and self.counted else 1.0
        return max(1, round(estimate_tokens(request) * ratio))

    def observe(self, chunk: list[tuple[int, dict]], results: list[NewResult]) -> None:
        requests = dict(chunk)
        for result in results:
            if tokens := result.get("input_tokens"):  # error results were not tokenized
                self.estimated += estimate_tokens(requests[result["case_id"]])
                self.counted += tokens


def token_chunks(store: Store, run: Run, case_ids: list[int], chunk_tokens: int,
                 tokens: TokenEstimate | None = None) -> Iterator[list[tuple[int, dict]]]:
    """The cases as (case id, request) chunks of about `chunk_tokens` estimated tokens each (at least one case, at
    most MAX_CASES_PER_CHUNK), read from the store a few hundred at a time. Lazy: each chunk is cut with the
    estimate as it is then."""
    tokens = tokens or TokenEstimate()
    chunk: list[tuple[int, dict]] = []
    total = 0
    for start in range(0, len(case_ids), CASES_PER_READ):
        for case in store.get_cases(case_ids[start:start + CASES_PER_READ]):
            request = build_request(case, run["schema"], model=run["model_id"])
            size = tokens(request)
            if chunk and (total + size > chunk_tokens or len(chunk) == MAX_CASES_PER_CHUNK):
                yield chunk
                chunk, total = [], 0
            chunk.append((case["id"], request))
            total += size
    if chunk:
        yield chunk


# -- the runner ----------------------------------------------------------------------------------------------------

class RayJobRunner(JobRunner):
    """A JobRunner whose runs execute on Ray replicas. Given a pool, every run uses it (the CLI starts one before
    creating its run); otherwise each run starts a pool of the release the caller's engine holds and stops it at the
    end, so that the cluster's GPUs are not held between runs."""

    def __init__(self, store: Store, *, pool: ReplicaPool | None = None, address: str | None = None,
                 replicas: int | None = None, chunk_tokens: int | None = None, **kwargs: Any):
        super().__init__(store, **kwargs)
        self.pool = pool
        self.address = address
        self.replicas = replicas
        self.replica_chunk_tokens = chunk_tokens  # None: the run's setting, else the replica's token budget

    def _compute(self, run_id: int, engine: Any, job: _LiveJob, in_flight: deque) -> None:
        pool = self.pool
        if pool is None:
            connect(self.address or "auto")
            info = engine.info()  # the replicas load the release the local engine has loaded
            pool = ReplicaPool.start(info["model"], revision=info["revision"], replicas=self.replicas)
            job.session_started = time.monotonic()  # the rate (and ETA) counts computing, not loading
        try:
            self._stream(run_id, pool, job)
        finally:
            if pool is not self.pool:
                pool.close()

    def _stream(self, run_id: int, pool: ReplicaPool, job: _LiveJob) -> None:
        run = self.store.get_run(run_id)
        # the setting JobRunner reads too; by default a chunk is one full batch of the replica's engine
        chunk_tokens = self.replica_chunk_tokens or run["settings"].chunk_tokens or pool.info["token_budget"]
        tokens = TokenEstimate()
        chunks = token_chunks(self.store, run, self.store.unfinished_case_ids(run_id), chunk_tokens, tokens)
        settings = run["settings"]
        for chunk, results in on_replicas(pool, chunks, lambda actor, chunk: actor.decide.remote(chunk, settings),
                                          lambda: job.cancel.is_set() or job.lease_lost.is_set()):
            self.store.record_results(run_id, results)
            job.processed += len(results)
            tokens.observe(chunk, results)


def on_replicas(pool: ReplicaPool, items: Iterator[Any], call: Any, stop: Any) -> Iterator[tuple[Any, Any]]:
    """(item, result) of each item as its replica returns it: `call(actor, item)` sends it to the least busy replica
    (an object ref), IN_FLIGHT_PER_REPLICA at a time per replica. Once `stop()` is true no item is sent and those
    in flight are awaited. An item of a replica dead for good goes to another first; ReplicaError when none is left
    or a replica raised."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    retry: deque[Any] = deque()  # items of a crashed replica, sent again first
    in_flight: dict[Any, tuple[Any, _Slot]] = {}
    while True:
        while not stop() and pool.slots:
            slot = min(pool.slots, key=lambda s: s.in_flight)
            if slot.in_flight >= IN_FLIGHT_PER_REPLICA:
                break
            item = retry.popleft() if retry else next(items, None)
            if item is None:
                break
            in_flight[call(slot.actor, item)] = (item, slot)
            slot.in_flight += 1
        if not in_flight:
            return
        # a timeout, so that a stop is seen while a long item runs
        ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.5)
        for ref in ready:
            item, slot = in_flight.pop(ref)
            slot.in_flight -= 1
            try:
                result = ray.get(ref)
            except RayActorError:  # dead for good: Ray has already restarted it MAX_RESTARTS times
                pool.drop(slot)
                retry.appendleft(item)
                if not pool.slots:
                    raise ReplicaError(f"every replica died (nodes: {', '.join(pool.dropped)}); the finished "
                                       "results are kept, resume to go on") from None
                continue
            except RayTaskError as exc:
                raise ReplicaError(f"a replica failed: {_cause(exc)}") from None
            yield item, result


def make_job_runner(store: Store, *, address: str | None = None, **kwargs: Any) -> JobRunner:
    """The batch-run runner the configuration asks for: on Ray when an address is given or CLEF_RAY_ADDRESS is
    set, else in-process on the resident engine."""
    address = ray_address(address)
    if address is None:
        return JobRunner(store, **kwargs)
    return RayJobRunner(store, address=address, **kwargs)
