"""The HTTP routes (FastAPI): OpenAI's images, videos and models, plus ``/health`` and ``/metrics``.

Every reply that is not a success is OpenAI's error envelope (:mod:`.errors`), FastAPI's own errors (an
unknown route, a wrong method, a body that is not JSON) included. With an API key set, every route but
``/health`` answers 401 unless the request carries ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from .card import VIDEO_FPS
from .errors import ApiError
from .requests import image_request, video_request
from .scheduler import Pending, Scheduler, outcome_of
from .settings import ServeSettings

#: The largest request body taken (bytes): a prompt at the limit is far smaller.
BODY_LIMIT = 1 << 20


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _body(http: Request) -> dict:
    """The request's fields, from a JSON object or a form (OpenAI's client sends ``/v1/videos`` as a form)."""
    length = http.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > BODY_LIMIT:
        raise ApiError(413, f"the request body is {length} bytes; this server takes at most {BODY_LIMIT}")
    kind = http.headers.get("content-type", "")
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await http.form(max_files=0, max_fields=64, max_part_size=BODY_LIMIT)
        return dict(form.items())
    raw = await http.body()
    if len(raw) > BODY_LIMIT:
        raise ApiError(413, f"the request body is {len(raw)} bytes; this server takes at most {BODY_LIMIT}")
    try:
        body = json.loads(raw)
    except ValueError:
        raise ApiError(400, "the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


class Authorize:
    """Every route but ``/health`` answers 401 without ``Authorization: Bearer KEY``.

    Plain ASGI: Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from the routes (the queue
    drops a request whose client left before it started).
    """

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                error = ApiError(401, "a valid API key is needed: send the header Authorization: Bearer KEY")
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(settings: ServeSettings, scheduler: Scheduler, ranks, stop_server) -> FastAPI:
    started = int(time.time())
    key = settings.key
    waiting: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.attach(ranks, asyncio.get_running_loop(), stop_server)
        ranks.start(scheduler)
        yield
        await scheduler.drain()
        await asyncio.get_running_loop().run_in_executor(None, ranks.stop)

    app = FastAPI(title="paradiff", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    if key is not None:
        app.add_middleware(Authorize, key=key)

    @app.exception_handler(ApiError)
    async def api_error(http: Request, error: ApiError):
        return _error(error)

    @app.exception_handler(HTTPException)
    async def http_error(http: Request, error: HTTPException):
        message = "no such route" if error.status_code == 404 else str(error.detail)
        return _error(ApiError(error.status_code, f"{http.method} {http.url.path}: {message}"))

    @app.exception_handler(RequestValidationError)
    async def invalid(http: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return _error(ApiError(400, first.get("msg", "invalid request"), param))

    @app.exception_handler(Exception)
    async def unexpected(http: Request, error: Exception):
        return _error(ApiError(500, f"the server failed: {type(error).__name__}: {error}"))

    @app.get("/health")
    async def health():
        card = scheduler.card
        body = {
            "status": scheduler.health,
            "model": settings.model,
            "ranks": card.nproc if card else settings.nproc,
            "queued": len(scheduler.queue),
            "running": len(scheduler.running),
            "restarts": scheduler.metrics.restarts,
            "last_error": scheduler.last_error,
        }
        return JSONResponse(body, status_code=200 if scheduler.health == "ready" else 503)

    @app.get("/metrics")
    async def metrics():
        text = scheduler.metrics.text(len(scheduler.queue), len(scheduler.running), scheduler.health == "ready")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def model_object() -> dict:
        return {"id": settings.model, "object": "model", "created": started, "owned_by": "paradiff"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != settings.model:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {settings.model!r}", "model")
        return model_object()

    async def accepted(parse, http: Request) -> Pending:
        """Read, check and queue a request; a refusal is counted here (an accepted request, at its reply)."""
        try:
            request, asked = parse(await _body(http), scheduler.model_card(), settings)
            return scheduler.accept(request, asked)
        except ApiError as error:
            scheduler.metrics.answered(outcome_of(error.status))
            raise

    @app.post("/v1/images/generations")
    async def images(http: Request):
        pending = await accepted(image_request, http)
        drawn = await scheduler.reply(pending, http.is_disconnected)
        if drawn is None:  # the client left before its request started
            return Response(status_code=499)
        request = pending.request
        return {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(picture).decode()} for picture in drawn.pictures],
            "output_format": request.output_format,
            "size": f"{request.width}x{request.height}",
            "paradiff": {**drawn.report(), "seed": request.seed},
        }

    def video_object(pending: Pending) -> dict:
        request, future = pending.request, pending.future
        status = {"queued": "queued", "in_progress": "in_progress"}.get(pending.state)
        error = drawn = None
        if status is None:
            error = future.exception() if not future.cancelled() else ApiError(499, "the job was dropped")
            status = "failed" if error else "completed"
            drawn = None if error else future.result()
        body = {
            "id": request.id,
            "object": "video",
            "model": settings.model,
            "status": status,
            "progress": {"queued": 0, "in_progress": 50}.get(status, 100),
            "created_at": pending.created_at,
            "completed_at": pending.completed_at,
            "prompt": request.prompt,
            "size": f"{request.width}x{request.height}",
            "seconds": f"{request.frames / VIDEO_FPS:g}" if request.frames else None,
            "error": None if error is None else {"code": error.body()["error"]["code"], "message": error.message},
        }
        if drawn is not None:
            body["paradiff"] = {**drawn.report(), "seed": request.seed, "frames": request.frames, "fps": VIDEO_FPS}
        return body

    def video_job(video_id: str) -> Pending:
        pending = scheduler.videos.get(video_id)
        if pending is None:
            raise ApiError(404, f"no video {video_id!r} here (finished videos are kept for a while, then forgotten)")
        return pending

    @app.post("/v1/videos")
    async def create_video(http: Request):
        pending = await accepted(video_request, http)
        settling = asyncio.get_running_loop().create_task(_settle(scheduler, pending))
        waiting.add(settling)  # the loop keeps only a weak reference to a task
        settling.add_done_callback(waiting.discard)
        return video_object(pending)

    @app.get("/v1/videos/{video_id}")
    async def retrieve_video(video_id: str):
        return video_object(video_job(video_id))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video"):
        pending = video_job(video_id)
        if variant != "video":
            raise ApiError(400, f"variant {variant!r} is not kept here; ask variant=video", "variant")
        state = video_object(pending)["status"]
        if state != "completed":
            raise ApiError(400, f"video {video_id} is {state}, not completed; ask GET /v1/videos/{video_id}")
        return Response(pending.future.result().pictures[0], media_type="video/mp4")

    return app


async def _settle(scheduler: Scheduler, pending: Pending) -> None:
    """A video job's wait for its outcome (the deadline included); the outcome stays on ``pending``."""
    with contextlib.suppress(ApiError):
        await scheduler.reply(pending)
