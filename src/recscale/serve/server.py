"""``recscale serve``: an HTTP JSON scoring service (FastAPI on uvicorn) over one loaded model.

    POST /score   {"rows": [{feature: value, ...}, ...]} -> {"scores": [p, ...]} in row order
    GET  /healthz  200 while the process serves
    GET  /readyz   200 once the model is loaded and warmed up, 503 before and while shutting down

Requests are validated (``RowParser``: 400 malformed JSON, 413 too large, 422 a bad row, each with a
one-line ``{"error": ...}``; a large body in a thread, off the event loop) and handed to a ``Batcher``:
scoring threads that each take the queued requests, up to ``max_batch`` rows (waiting up to ``max_wait_ms`` for more, 0 by
default: under load the queue fills while the last batch is scored), score them as one batch and
answer each request with its own slice. uvicorn's graceful shutdown (SIGINT / SIGTERM) stops
accepting, lets in-flight requests finish, then the batcher drains and stops.

``workers > 1`` runs that many server processes on the one listening socket (uvicorn's multiprocess
supervisor), each loading the model and scoring with its share of the torch threads: one process is
bound by its GIL (the event loop's parsing and the forward's Python both need it), not by the cores.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.supervisors import multiprocess

from recscale.errors import DataError
from recscale.quiet import quiet_upstream
from recscale.retrieval.pipeline import RetrieveRank
from recscale.serve.retrieval_artifact import Catalog, is_retrieval_dir, load_retriever, recommend
from recscale.serve.rows import RequestError
from recscale.serve.scorer import Scorer
from recscale.train.dcp_safety import one_line

In = TypeVar("In")  # a request, as a Batcher takes it
Out = TypeVar("Out")  # its answer


@dataclass(frozen=True)
class ServeOptions:
    max_batch: int = 1024  # rows scored together at most (a larger single request is scored alone)
    max_wait_ms: float = 0.0  # how long the first request of a batch waits for others
    batching: bool = True  # False: every request is scored alone, at once
    threads: int = 1  # scoring threads (torch releases the GIL in its kernels)
    max_body_bytes: int = 8 << 20
    workers: int = 1  # server processes, each with its own model
    torch_threads: int | None = None  # intra-op threads per process (None: torch's default / workers)


class Batcher(Generic[In, Out]):
    """Dynamic batching: ``submit(request)`` returns a future of its answer. ``answer`` answers a list of
    requests at once (one forward over them all), ``size`` counts a request's rows against ``max_batch``."""

    def __init__(
        self, answer: Callable[[list[In]], list[Out]], size: Callable[[In], int], opts: ServeOptions
    ) -> None:
        self.answer, self.size, self.opts = answer, size, opts
        self._queue: queue.Queue[tuple[In, Future[Out]] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, name=f"recscale-scorer-{i}", daemon=True)
            for i in range(opts.threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, request: In) -> Future[Out]:
        fut: Future[Out] = Future()
        self._queue.put((request, fut))
        return fut

    def stop(self) -> None:
        """Answer every queued request, then end the threads."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()

    def _gather(
        self, first: tuple[In, Future[Out]]
    ) -> tuple[list[tuple[In, Future[Out]]], tuple[In, Future[Out]] | None, bool]:
        """``first`` and the requests that arrive within the wait, up to ``max_batch`` rows; the request that
        did not fit (the next batch's first: put back at the end of the queue, it waited behind every later
        request and behind the stop marker, never answered); and whether the stop marker was met."""
        jobs, rows = [first], self.size(first[0])
        if not self.opts.batching:
            return jobs, None, False
        deadline = time.perf_counter() + self.opts.max_wait_ms / 1000
        while rows < self.opts.max_batch:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if job is None:
                return jobs, None, True
            if rows + self.size(job[0]) > self.opts.max_batch:
                return jobs, job, False  # this batch is full
            jobs.append(job)
            rows += self.size(job[0])
        return jobs, None, False

    def _run(self) -> None:
        held: tuple[In, Future[Out]] | None = None
        while (first := held if held is not None else self._queue.get()) is not None:
            jobs, held, stop = self._gather(first)
            # A request cancelled while it waited (its handler was cancelled) is not answered: setting its
            # result would raise in this thread and end it, and every later request would hang.
            jobs = [job for job in jobs if job[1].set_running_or_notify_cancel()]
            if jobs:
                self._answer(jobs)
            if stop:
                break

    def _answer(self, jobs: list[tuple[In, Future[Out]]]) -> None:
        try:
            answers = self.answer([request for request, _ in jobs])
        except Exception as e:
            if len(jobs) > 1:  # one bad request must not fail the others: answer each alone
                for job in jobs:
                    self._answer([job])
            else:
                jobs[0][1].set_exception(e)
            return
        for (_, fut), answer in zip(jobs, answers, strict=True):
            fut.set_result(answer)


def scoring(scorer: Scorer, opts: ServeOptions) -> Batcher[pa.RecordBatch, np.ndarray]:
    """A ``Batcher`` of scoring requests (rows): each answered with its rows' probabilities, (rows,)."""

    def answer(batches: list[pa.RecordBatch]) -> list[np.ndarray]:
        probs = scorer.probabilities(pa.concat_batches(batches))
        return np.split(probs, np.cumsum([b.num_rows for b in batches])[:-1])

    return Batcher(answer, lambda b: b.num_rows, opts)


# Bodies up to this size are parsed on the event loop (~1-2 ms); larger ones in a thread.
INLINE_PARSE_BYTES = 16 << 10


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


def create_app(scorer: Scorer, opts: ServeOptions) -> FastAPI:
    state: dict[str, Batcher[pa.RecordBatch, np.ndarray] | None] = {"batcher": None}
    app = _new_app(
        "recscale",
        _serving(state, lambda: scoring(scorer, opts), lambda: scorer.parser.parse(_example_body(scorer))),
    )

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if state["batcher"] is None:
            return _error(503, "not ready: the model is loading or the server is shutting down")
        m = scorer.manifest
        return JSONResponse(
            {"ready": True, "model": m.model, "tables": m.tables, "dense": m.dense, "pid": os.getpid()}
        )

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        batcher = state["batcher"]
        if batcher is None:
            return _error(503, "not ready: the server is starting or shutting down; retry")
        try:
            body = await _read_body(request, opts.max_body_bytes)
            # A large body is parsed and validated in a thread: a 4,096-row request takes ~110 ms, which on the
            # event loop held up every other request (reading, answering). A small one (most) stays here, where
            # it costs less than the hop to a thread would.
            if len(body) <= INLINE_PARSE_BYTES:
                batch = scorer.parser.parse(body)
            else:
                batch = await asyncio.to_thread(scorer.parser.parse, body)
        except RequestError as e:
            return _error(e.status, str(e))
        try:
            probs = await asyncio.wrap_future(batcher.submit(batch))
        except DataError as e:
            return _error(422, one_line(e, 300))
        except Exception as e:  # the model failed on valid input: a bug; this request fails, the server stays
            return _error(500, f"internal error {type(e).__name__}: {one_line(e)}")
        return JSONResponse({"scores": probs.tolist()})

    return app


def create_retrieval_app(
    model: RetrieveRank, catalog: Catalog, max_users: int, opts: ServeOptions
) -> FastAPI:
    """``POST /retrieve {"users": [raw id, ...]}`` -> ``{"items": {user: [{"item", "logit"}, ...]}}``: each
    user's top unseen items (``retrieval_artifact.recommend``), the requests batched as /score's rows are (up
    to ``max_batch`` users a forward); /healthz and /readyz as for scoring."""

    def answer(requests: list[list[str]]) -> list[dict]:
        # The requests gathered meanwhile as one forward: each user's items do not depend on the others'.
        items = recommend(model, catalog, list(dict.fromkeys(u for users in requests for u in users)))
        return [{u: items[u] for u in users} for users in requests]

    state: dict[str, Batcher[list[str], dict] | None] = {"batcher": None}
    app = _new_app(
        "recscale retrieval",
        _serving(state, lambda: Batcher(answer, len, opts), lambda: catalog.user_keys[:1]),
    )

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if state["batcher"] is None:
            return _error(503, "not ready: the model is loading or the server is shutting down")
        return JSONResponse(
            {"ready": True, "model": "retrieval", "users": len(catalog.user_keys), "pid": os.getpid()}
        )

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        try:
            # pydantic's parser, as /score's: json.loads raised RecursionError (a 500) on deeply nested arrays.
            body = from_json(await _read_body(request, opts.max_body_bytes))
        except RequestError as e:
            return _error(e.status, str(e))
        except ValueError as e:
            return _error(400, f"the body is not valid JSON: {one_line(e, 120)}")
        users = body.get("users") if type(body) is dict and body.keys() == {"users"} else None
        if type(users) is not list or not users or not all(type(u) in (str, int) for u in users):
            return _error(
                422, 'the body must be {"users": [raw user id, ...]}: a non-empty list of strings or integers'
            )
        if len(users) > max_users:
            return _error(413, f"users: at most {max_users} per request; split it")
        if (batcher := state["batcher"]) is None:
            return _error(503, "not ready: the server is starting or shutting down; retry")
        try:
            return JSONResponse({"items": await asyncio.wrap_future(batcher.submit([str(u) for u in users]))})
        except DataError as e:
            return _error(422, one_line(e, 300))

    return app


def _serving(
    state: dict[str, Any], start: Callable[[], Batcher[In, Out]], warm: Callable[[], In]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """An app's lifespan: ``start()`` its batcher, answer the request ``warm()`` through it (the first forward
    pays for lazy initialisation), then serve with it as ``state["batcher"]`` (None: not ready, 503) until
    shutdown, which drains its queue."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher = start()
        await asyncio.wrap_future(batcher.submit(warm()))
        # The model and the app are long-lived: keep them out of the collector's full passes, which would
        # otherwise walk them all and stall every request in flight.
        gc.collect()
        gc.freeze()
        state["batcher"] = batcher
        try:
            yield
        finally:
            state["batcher"] = None  # not ready: new requests get 503 while the queue drains
            await asyncio.to_thread(batcher.stop)

    return lifespan


def _new_app(
    title: str, lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None
) -> FastAPI:
    """An app without the interactive docs, with ``GET /healthz``: 200 while the process serves."""
    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own answers (an unknown path, a wrong method) in the server's error shape, not {"detail"}.
        return JSONResponse({"error": str(e.detail)}, status_code=e.status_code, headers=e.headers)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to pass ``limit`` bytes (declared or streamed)."""
    too_big = RequestError(413, f"the body is larger than {limit:,} bytes; send fewer rows per request")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _example_body(scorer: Scorer) -> bytes:
    """A one-row request of missing values (valid for every schema): the warm-up."""
    return json.dumps({"rows": [dict.fromkeys(scorer.parser.arrow_schema.names)]}).encode()


def build_app(model_dir: Path, max_rows: int, opts: ServeOptions) -> tuple[FastAPI, str]:
    """The app serving ``model_dir`` (an exported scoring model or a retrieval model), and what it serves."""
    if is_retrieval_dir(model_dir):
        model, catalog = load_retriever(model_dir)
        what = f"a retrieval model ({len(catalog.user_keys):,} users, {len(catalog.item_keys):,} items)"
        return create_retrieval_app(model, catalog, max_rows, opts), what
    scorer = Scorer(model_dir, max_rows)
    return create_app(scorer, opts), scorer.manifest.model


@dataclass(frozen=True)
class _WorkerApp:
    """What a worker process calls (pickled to it) to load the model and build its app."""

    model_dir: str
    max_rows: int
    opts: ServeOptions

    def __call__(self) -> FastAPI:
        quiet_upstream()  # a spawned process: the CLI's filters are not inherited
        _set_threads(self.opts)
        return build_app(Path(self.model_dir), self.max_rows, self.opts)[0]


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in the block (and blocked in this thread, so that one coming meanwhile waits): the
    processes started in it ignore SIGINT until uvicorn handles it (a graceful stop, in ``Server.serve``),
    as the disposition is inherited. A Ctrl-C reaches the whole process group: a worker still importing
    torch took it as a KeyboardInterrupt and printed a traceback, and the supervisor restarted it; now the
    supervisor alone acts on it, stopping its workers with SIGTERM. Only for the milliseconds of starting
    processes: another thread of this one may take a Ctrl-C meanwhile, which is then lost."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class _QuietStart(multiprocess.Process):
    """uvicorn's server worker, started ignoring SIGINT (``_sigint_ignored``). At module level: the spawned
    process unpickles it by name."""

    def start(self) -> None:
        with _sigint_ignored():
            super().start()


WORKER_HEALTHCHECK_S = 60


def _set_threads(opts: ServeOptions) -> None:
    torch.set_num_threads(opts.torch_threads or max(1, torch.get_num_threads() // opts.workers))


def serve(
    app: FastAPI | None, model_dir: Path, max_rows: int, sock: socket.socket, opts: ServeOptions
) -> None:
    """Serve ``app`` (``build_app(model_dir, max_rows, opts)``) on the bound, listening ``sock`` until SIGINT /
    SIGTERM, then shut down gracefully. With ``opts.workers > 1`` each worker process builds its own (``app``
    is not used: pass None, so this process does not keep a model it never serves)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    def config(app: Any, **extra: Any) -> uvicorn.Config:
        return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30, **extra)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # A second Ctrl-C exits without draining, as asked; uvicorn would then log the cancelled
            # lifespan as an error with its traceback.
            if self.should_exit and sig == signal.SIGINT:
                logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
            super().handle_exit(sig, frame)

    if opts.workers == 1:
        assert app is not None
        _set_threads(opts)
        Server(config(app)).run(sockets=[sock])
        return

    class Supervisor(Multiprocess):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # uvicorn takes over every signal it knows, ignored ones too: under nohup a hang-up killed the
            # workers (SIGHUP's default action, which they started with) and the supervisor restarted them. A
            # signal ignored when the server started stays ignored, in it and its workers; SIGTERM stops it.
            ignored = [s for s in signal.valid_signals() if signal.getsignal(s) == signal.SIG_IGN]
            super().__init__(*args, **kwargs)
            for sig in ignored:
                if sig != signal.SIGTERM:
                    signal.signal(sig, signal.SIG_IGN)
            self.stopped_by: list[int] = []

        def handle_int(self) -> None:
            self.stopped_by.append(signal.SIGINT)
            super().handle_int()

        def handle_term(self) -> None:
            self.stopped_by.append(signal.SIGTERM)
            super().handle_term()

    worker = _WorkerApp(str(model_dir), max_rows, opts)
    # The supervisor kills a worker that does not answer its ping within timeout_worker_healthcheck (uvicorn's
    # default 5 s). A worker importing torch and loading its model on a busy machine can hold the GIL longer,
    # and was killed and restarted every few seconds, never ready: a minute tells slow from hung.
    cfg = config(worker, factory=True, workers=opts.workers, timeout_worker_healthcheck=WORKER_HEALTHCHECK_S)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    supervisor = Supervisor(cfg, sockets=[sock])  # takes both signals over
    # Every worker starts ignoring SIGINT (_sigint_ignored): the first ones, and those the supervisor starts
    # later in place of one that died (uvicorn makes each through its module's ``Process``).
    process = multiprocess.Process
    setattr(multiprocess, "Process", _QuietStart)  # noqa: B010 (mypy refuses assigning to a class name)
    try:
        supervisor.run()
    finally:
        setattr(multiprocess, "Process", process)  # noqa: B010
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    # Once its workers are stopped, the signal that stopped it acts as on one server (uvicorn's Server raises
    # it again): Ctrl-C is "interrupted" and 130, SIGTERM ends the process by SIGTERM, whatever --workers.
    for stopped_by in reversed(supervisor.stopped_by):
        signal.raise_signal(stopped_by)
