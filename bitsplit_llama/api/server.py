"""``bitsplit serve``: an OpenAI-compatible HTTP server over one split model (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
``"stream": true`` answered as server-sent events (``data: {...}`` lines, then ``data: [DONE]``).
Responses are llama-cpp-python's own (``BitsplitLlama`` reuses its completion layer).

One model, one KV cache: requests are served one at a time, in arrival order; others wait (a
request never sees another's state). Malformed requests get a 4xx JSON error
(``{"error": {"message", "type", "param"}}``), never a crash.
"""

import json
import threading
import time
from typing import Any, AsyncIterator, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..errors import BitsplitError, ContextLimitError, InputError

_END = object()  # the end of a stream, from next(it, _END)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: float = Field(default=0.8, ge=0.0, le=5.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
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


def create_app(llm, model_name: str):
    """A FastAPI app serving ``llm`` (a BitsplitLlama, or any llama_cpp.Llama) as ``model_name``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="bitsplit", version="1")
    lock = threading.Lock()  # requests queue here: one generation at a time
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"request body: invalid JSON ({first.get('ctx', {}).get('error', 'decode error')})")
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(422, f"{loc or 'request'}: {first.get('msg', 'invalid request')}", param=loc or None)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "bitsplit"}]}

    def sampling_kwargs(req) -> dict:
        return dict(max_tokens=req.max_tokens if req.max_tokens is not None else 256, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop or [],
                    stream=req.stream)

    def run(fn, stream: bool):
        """Call fn() holding the model; errors become 4xx/5xx JSON. A stream takes the model when
        its first chunk is asked for and keeps it until it ends or the client goes away."""
        if stream:
            return StreamingResponse(events(fn), media_type="text/event-stream")
        with lock:
            try:
                return fn()
            except (ContextLimitError, InputError, ValueError) as exc:
                return _error(400, str(exc))
            except BitsplitError as exc:
                return _error(500, str(exc), typ="server_error")

    async def events(fn) -> AsyncIterator[str]:
        # The generation runs in worker threads, one chunk at a time. When the client goes away,
        # Starlette cancels this task; the cancellation arrives once the chunk in progress is done
        # (the thread is not abandoned), and `finally` ends the generation and frees the model. (A
        # plain generator here was never closed after a disconnect: the model stayed locked for
        # good.) The lock is taken here, not before the response starts, so that a response that is
        # never iterated holds nothing.
        acquired = False
        result = None
        try:
            await run_in_threadpool(lock.acquire)
            acquired = True
            result = fn()
            it = iter(result)
            while True:
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
            close = getattr(result, "close", None)
            try:
                if close is not None:
                    close()  # ends the generation (and frees its KV rows)
            finally:
                if acquired:
                    lock.release()

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return _error(400, f"prompt: one prompt per request is supported, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        kw = sampling_kwargs(req)
        return run(lambda: llm.create_completion(prompt, echo=req.echo, model=model_name, **kw), req.stream)

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        kw = sampling_kwargs(req)
        return run(lambda: llm.create_chat_completion(messages=messages, model=model_name, **kw), req.stream)

    return app


def serve(model_dir: str, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, model_name: Optional[str] = None,
          log_level: str = "info", **llama_kwargs) -> None:
    """Load the split model and serve it until interrupted."""
    import uvicorn

    from .llama import get_class

    llm = get_class()(model_dir, verbose=False, **llama_kwargs)
    try:
        app = create_app(llm, model_name or str(model_dir).rstrip("/").split("/")[-1])
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        llm.close()
