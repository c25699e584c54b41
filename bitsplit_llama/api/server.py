"""``bitsplit serve``: an OpenAI-compatible HTTP server over one split model (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
``"stream": true`` answered as server-sent events (``data: {...}`` lines, then ``data: [DONE]``).
Responses are llama-cpp-python's own (``BitsplitLlama`` reuses its completion layer).

One model, one KV cache: requests are served one at a time; others wait in a bounded queue
(``queue`` waiting at most, each for at most ``wait_s`` seconds; past either, 503 with
``Retry-After``). A client that goes away (streaming or not) has its generation stopped at the next
draft/verify cycle. ``GET /health`` says ``{"status": "ok"|"busy", "queue": N}`` (503
``"loading"`` until the model is loaded). Malformed
requests get a 4xx JSON error (``{"error": {"message", "type", "param"}}``), never a crash.
"""

import asyncio
import json
import signal
import threading
import time
from typing import Any, AsyncIterator, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from . import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_QUEUE, DEFAULT_WAIT_S
from ..errors import BitsplitError, ContextLimitError, InputError
from ..speculative.options import CHAT_TEMPERATURE, GenerationOptions, SamplingParams

_END = object()  # the end of a stream, from next(it, _END)
DISCONNECT_POLL_S = 0.2
MAX_BODY_BYTES = 8 << 20  # a body declared larger than this is refused (413) before it is read


class QueueFull(Exception):
    """No room to wait, or waited too long: answered 503."""


class Cancelled(Exception):
    """The client went away while waiting."""


class Gate:
    """One generation at a time; at most ``depth`` requests waiting, each at most ``wait_s``."""

    def __init__(self, depth: int, wait_s: float, shutdown: threading.Event):
        if depth < 0 or not wait_s > 0:
            raise ValueError(f"queue depth {depth} / wait {wait_s} s: need depth >= 0 and wait > 0")
        self.depth, self.wait_s, self.shutdown = depth, wait_s, shutdown
        self.lock = threading.Lock()
        self._m = threading.Lock()
        self.waiting = 0

    def acquire(self, cancel: threading.Event) -> None:
        with self._m:
            if self.lock.locked() and self.waiting >= self.depth:
                raise QueueFull(f"the server is busy: {self.waiting} request(s) already waiting (--queue {self.depth})")
            self.waiting += 1
        try:
            deadline = time.monotonic() + self.wait_s
            while not self.lock.acquire(timeout=0.05):
                if cancel.is_set() or self.shutdown.is_set():
                    raise Cancelled()
                if time.monotonic() > deadline:
                    raise QueueFull(f"the server is busy: waited {self.wait_s:g} s for the model")
        finally:
            with self._m:
                self.waiting -= 1

    def release(self) -> None:
        self.lock.release()



class Sampling(BaseModel):
    """A request's sampling fields; one left out takes the server's default (``bitsplit serve
    --temp/--top-k/--top-p/--min-p/--seed``, else :class:`SamplingParams`' and CHAT_TEMPERATURE)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=5.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0)
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)  # one choice per request


class CompletionRequest(Sampling):
    prompt: Union[str, List[str]]
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, List[Any]]] = None


class ChatRequest(Sampling):
    messages: List[Message] = Field(min_length=1)


def _error(status: int, message: str, typ: str = "invalid_request_error", param: Optional[str] = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": typ, "param": param}})


def create_app(llm, model_name: str, *, queue: int = DEFAULT_QUEUE, wait_s: float = DEFAULT_WAIT_S,
               shutdown: Optional[threading.Event] = None, sampling: Optional[SamplingParams] = None):
    """A FastAPI app serving ``llm`` (a BitsplitLlama, or any llama_cpp.Llama: then a client that
    goes away does not stop its generation) as ``model_name``. ``sampling`` holds the defaults of
    requests that leave a sampling field out (default: temperature CHAT_TEMPERATURE, the rest
    SamplingParams'). ``llm`` may be None while the model
    loads: set ``app.state.llm`` when it is ready (until then /health says "loading" and requests get
    503). ``shutdown``, when set, stops every generation at its next cycle. The app's
    ``state.gate`` holds the model's lock."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="bitsplit", version="1")
    shutdown = shutdown if shutdown is not None else threading.Event()
    gate = Gate(queue, wait_s, shutdown)  # requests queue here: one generation at a time
    app.state.gate = gate
    app.state.llm = llm

    class _Once:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self):
            fn, self.fn = self.fn, None
            if fn is not None:
                fn()

    class _Stream(StreamingResponse):
        """A stream that frees the model however it ends, even if its body never started."""

        def __init__(self, body, on_close):
            super().__init__(body, media_type="text/event-stream")
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                try:
                    await self.body_iterator.aclose()
                finally:
                    self.on_close()
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"request body: invalid JSON ({first.get('ctx', {}).get('error', 'decode error')})")
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(422, f"{loc or 'request'}: {first.get('msg', 'invalid request')}", param=loc or None)

    class _BodyLimit:
        """A body over MAX_BODY_BYTES gets 413: refused from its Content-Length before it is read, or,
        sent without one (chunked), read here up to the limit and refused as soon as it passes it.
        (Plain ASGI: an @app.middleware("http") wrapper hides the client's disconnect from the
        endpoints.)"""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            size = dict(scope.get("headers") or ()).get(b"content-length")
            if size is not None:
                if not size.isdigit() or int(size) > MAX_BODY_BYTES:
                    msg = f"request body: {size.decode(errors='replace')} bytes; at most {MAX_BODY_BYTES} are accepted"
                    return await _error(413, msg)(scope, receive, send)
                return await self.inner(scope, receive, send)
            # no declared size: take the body in here, then hand it on whole
            parts, total = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client went away before its body ended
                    return
                body = message.get("body", b"")
                total += len(body)
                if total > MAX_BODY_BYTES:
                    msg = f"request body: over {MAX_BODY_BYTES} bytes (sent without a Content-Length); at most " \
                          f"{MAX_BODY_BYTES} are accepted"
                    return await _error(413, msg)(scope, receive, send)
                parts.append(body)
                if not message.get("more_body", False):
                    break
            whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}

            async def replay():
                nonlocal whole
                if whole is not None:
                    message, whole = whole, None
                    return message
                return await receive()  # after the body: the disconnect the endpoints watch for

            return await self.inner(scope, replay, send)

    app.add_middleware(_BodyLimit)

    def loading():
        r = _error(503, "the model is loading", typ="loading")
        r.headers["Retry-After"] = "5"
        return r

    @app.get("/health")
    def health():
        if app.state.llm is None:
            from fastapi.responses import JSONResponse

            return JSONResponse(status_code=503, content={"status": "loading", "queue": 0})
        return {"status": "busy" if gate.lock.locked() else "ok", "queue": gate.waiting}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "bitsplit"}]}

    defaults = sampling if sampling is not None else SamplingParams(temperature=CHAT_TEMPERATURE)

    def sampling_kwargs(req) -> dict:
        def given(name: str, default_name: str | None = None):
            v = getattr(req, name)
            return v if v is not None else getattr(defaults, default_name or name)

        return dict(max_tokens=req.max_tokens if req.max_tokens is not None else 256, temperature=given("temperature"),
                    top_p=given("top_p"), top_k=given("top_k"), min_p=given("min_p"), seed=given("seed"),
                    stop=req.stop or [], stream=req.stream)

    def busy(exc: Exception):
        r = _error(503, str(exc), typ="server_busy")
        r.headers["Retry-After"] = "5"
        return r

    def locked_call(fn, cancel: threading.Event):
        """fn() holding the model, with the generation's cancel flag set on it (a BitsplitLlama stops
        at the next cycle once it is set)."""
        gate.acquire(cancel)
        try:
            if cancel.is_set():
                raise Cancelled()
            llm = app.state.llm
            llm.cancel_event = cancel
            try:
                return fn()
            finally:
                llm.cancel_event = None
        finally:
            gate.release()

    def watch_shutdown(cancel: threading.Event) -> None:
        if shutdown.is_set():
            cancel.set()

    async def run(fn, stream: bool, request):
        """Run fn() for a request; errors become 4xx/5xx JSON. A non-streaming request is watched
        for its client going away; a stream ends when its client does."""
        if app.state.llm is None:
            return loading()
        cancel = threading.Event()
        watch_shutdown(cancel)
        if stream:
            # wait for the model here, so that a full queue is a 503 before any byte is sent
            try:
                await run_in_threadpool(gate.acquire, cancel)
            except QueueFull as exc:
                return busy(exc)
            except Cancelled:
                return busy(QueueFull("the server is shutting down"))
            return _Stream(events(fn, cancel), on_close=_Once(gate.release))
        task = asyncio.ensure_future(run_in_threadpool(locked_call, fn, cancel))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if shutdown.is_set() or await request.is_disconnected():
                    cancel.set()  # the generation stops at its next cycle; nobody reads the answer
        except asyncio.CancelledError:
            cancel.set()
            raise
        try:
            return task.result()
        except QueueFull as exc:
            return busy(exc)
        except Cancelled:
            if shutdown.is_set():
                return busy(QueueFull("the server is shutting down"))
            return _error(499, "the client went away", typ="cancelled")
        except (ContextLimitError, InputError, ValueError) as exc:
            return _error(400, str(exc))
        except BitsplitError as exc:
            return _error(500, str(exc), typ="server_error")

    async def events(fn, cancel: threading.Event) -> AsyncIterator[str]:
        # Holding the model (run() took it). The generation runs in worker threads, one chunk at a
        # time. When the client goes away, Starlette cancels this task; the cancellation arrives once
        # the chunk in progress is done (the thread is not abandoned), and `finally` ends the
        # generation; _Stream then frees the model. (A plain generator here was never closed after a
        # disconnect: the model stayed locked for good.)
        result = None
        llm = app.state.llm
        llm.cancel_event = cancel
        try:
            result = fn()
            it = iter(result)
            while True:
                watch_shutdown(cancel)
                chunk = await run_in_threadpool(next, it, _END)
                if chunk is _END:
                    break
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except (ContextLimitError, InputError, ValueError) as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'invalid_request_error'}})}\n\n"
        except BitsplitError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
        finally:
            cancel.set()
            llm.cancel_event = None
            close = getattr(result, "close", None)
            if close is not None:
                close()  # ends the generation (and frees its KV rows)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return _error(400, f"prompt: one prompt per request is supported, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        kw = sampling_kwargs(req)
        return await run(lambda: app.state.llm.create_completion(prompt, echo=req.echo, model=model_name, **kw), req.stream,
                         request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        kw = sampling_kwargs(req)
        return await run(lambda: app.state.llm.create_chat_completion(messages=messages, model=model_name, **kw), req.stream,
                         request)

    return app


def serve(model_dir: str, options: Optional[GenerationOptions] = None, *, sampling: Optional[SamplingParams] = None,
          host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, model_name: Optional[str] = None,
          log_level: str = "info", queue: int = DEFAULT_QUEUE, wait_s: float = DEFAULT_WAIT_S) -> None:
    """Serve the split model, loaded with ``options``, until SIGINT or SIGTERM; ``sampling`` holds
    the defaults of requests (see :func:`create_app`). The model loads while the server already
    answers (/health: "loading", requests 503); a model that fails to load stops the server and
    its error is raised here. On a signal every generation stops at its next cycle, waiting
    requests get 503, and the model is freed once nothing uses it."""
    import uvicorn

    from .llama import get_class

    shutdown = threading.Event()
    failed: list[BaseException] = []

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # the first signal: stop generating at once
            shutdown.set()
            super().handle_exit(sig, frame)

    options = GenerationOptions.of(options)
    app = create_app(None, model_name or str(model_dir).rstrip("/").split("/")[-1], queue=queue, wait_s=wait_s,
                     shutdown=shutdown, sampling=sampling)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))

    def load() -> None:  # while the server answers /health with "loading"
        try:
            llm = get_class()(model_dir, options)
        except BaseException as exc:  # noqa: BLE001 (re-raised by serve())
            failed.append(exc)
            server.should_exit = True
            return
        if shutdown.is_set():
            llm.close()
        else:
            app.state.llm = llm

    loader = threading.Thread(target=load, name="bitsplit-load", daemon=True)
    loader.start()
    try:
        # uvicorn re-raises the signal that stopped it once it is done, into the handler it found:
        # make that a no-op, so that a clean stop frees the model and exits 0
        main = threading.current_thread() is threading.main_thread()
        sigs = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGBREAK,) if hasattr(signal, "SIGBREAK") else ())  # Windows
        quiet = {sig: signal.signal(sig, lambda *_: None) for sig in sigs} if main else {}
        try:
            server.run()
        finally:
            for sig, handler in quiet.items():
                signal.signal(sig, handler)
    finally:
        shutdown.set()
        loader.join()
        llm = app.state.llm
        # a worker thread may still be finishing its cycle: free the model after it
        if llm is not None and app.state.gate.lock.acquire(timeout=60):
            app.state.llm = None
            llm.close()
    if failed:
        raise failed[0]
