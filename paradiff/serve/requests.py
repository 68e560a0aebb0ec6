"""A client's request body, checked against the model's card and the server's limits, as a :class:`.jobs.Request`.

Everything that can be checked without the pipeline is checked here, on the front, before any rank works: the
model name (404), each field's type and range, the size against the model (every side a multiple of its
latent patch) and against the strategy (a height it can cut over these ranks: the answer names heights that
work), the frames, and the limits (:class:`.settings.Limits`). Nothing in a request names a file: the model
is the one the server loaded, and pictures come back in the reply.
"""

from __future__ import annotations

import math
import re
import secrets
import uuid

from ..loading import frames_to_ask
from .card import VIDEO_FPS, ModelCard
from .errors import ApiError
from .jobs import Request
from .media import IMAGE_FORMATS
from .settings import ServeSettings

#: Fields of OpenAI's image and video requests the server takes, and paradiff's own.
OPENAI_IMAGE_FIELDS = ("model", "prompt", "n", "size", "response_format", "output_format", "user")
OPENAI_VIDEO_FIELDS = ("model", "prompt", "size", "seconds", "user")
PARADIFF_FIELDS = (
    "negative_prompt",
    "num_inference_steps",
    "guidance_scale",
    "seed",
    "strategy",
    "warmup_steps",
    "fidelity",
    "fidelity_floor_db",
)
VIDEO_FIELDS = ("num_frames",)
SIZE = re.compile(r"(\d{1,6})x(\d{1,6})")
SEED_LIMIT = 2**63 - 1
#: The highest PSNR floor a request may ask: far above what any displaced step reaches (such a floor is exact).
FLOOR_LIMIT_DB = 1000.0


def _text(body: dict, name: str, limit: int, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{name} is required", name)
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string, got {type(value).__name__}", name)
    if required and not value.strip():
        raise ApiError(400, f"{name} must not be empty", name)
    if len(value) > limit:
        raise ApiError(400, f"{name} is {len(value)} characters long; this server takes at most {limit}", name)
    return value


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):  # a form field
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high} on this server, got {value}", name)
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ApiError(400, f"{name} must be a number, got {value!r}", name) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a finite number, got {value!r}", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low:g} and {high:g}, got {value:g}", name)
    return float(value)


def _choice(body: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if value not in choices:
        raise ApiError(400, f"{name} must be one of {', '.join(choices)}; got {value!r}", name)
    return value


def _unknown(body: dict, known: tuple[str, ...]) -> None:
    extra = sorted(name for name, value in body.items() if name not in known and value is not None)
    if extra:
        raise ApiError(
            400,
            f"this server does not take {', '.join(extra)}; it takes {', '.join(known)}",
            extra[0],
        )


def _model(body: dict, card: ModelCard) -> None:
    model = body.get("model")
    if model is not None and model != card.model:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {card.model!r}", "model")


def _size(body: dict, card: ModelCard, settings: ServeSettings) -> tuple[int, int]:
    """(height, width) from ``size`` ("WxH", or "auto": the model's own)."""
    size = body.get("size")
    if size is None or size == "auto":
        return card.default_size
    match = SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise ApiError(400, f"size must be WIDTHxHEIGHT in pixels (e.g. 512x512) or auto; got {size!r}", "size")
    width, height = int(match.group(1)), int(match.group(2))
    limit, step = settings.limits.size, card.pixels
    for side, value in (("width", width), ("height", height)):
        if not step <= value <= limit:
            raise ApiError(400, f"size {size}: the {side} must be between {step} and {limit} pixels here", "size")
        if value % step:
            lower, upper = value - value % step, value - value % step + step
            near = f"{lower} or {upper}" if lower else str(upper)
            raise ApiError(
                400,
                f"size {size}: the {side} {value} is not a multiple of {step} pixels (a row of the model's latent "
                f"patches); use {near}",
                "size",
            )
    return height, width


def _strategy(body: dict, card: ModelCard, settings: ServeSettings, height: int, size: str) -> tuple[str, bool]:
    """The strategy the request runs under and whether it named it; refused if it cannot cut ``height``."""
    strategy = body.get("strategy")
    asked = strategy is not None
    strategy = settings.strategy if strategy is None else strategy
    if strategy != "auto" and strategy not in card.strategy_names:
        names = ", ".join(("auto", *card.strategy_names))
        raise ApiError(400, f"unknown strategy {strategy!r}; paradiff's strategies are {names}", "strategy")
    if card.nproc == 1 or strategy == "auto":  # one rank runs the pipeline as loaded; auto picks what fits
        return strategy, asked
    fit = card.strategies[strategy]
    if fit.refusal is not None:
        raise ApiError(400, f"strategy {strategy} cannot run here: {fit.refusal}", "strategy")
    if height not in fit.heights:
        near = card.sizes_near(height, fit.heights) if fit.heights else "none up to the size limit"
        raise ApiError(
            400,
            f"size {size}: strategy {strategy} cannot cut a height of {height} px over {card.nproc} ranks; heights "
            f"near it that work: {near}",
            "size",
        )
    return strategy, asked


def _floor(body: dict, settings: ServeSettings) -> float | None:
    """The request's PSNR floor: its own ``fidelity_floor_db``, else the server's ``--fidelity-floor``."""
    floor = _number(body, "fidelity_floor_db", 0.0, FLOOR_LIMIT_DB)
    if floor == 0:
        raise ApiError(400, "fidelity_floor_db must be above 0 dB (e.g. 30)", "fidelity_floor_db")
    return settings.fidelity_floor if floor is None else floor


def _common(body: dict, card: ModelCard, settings: ServeSettings, kind: str) -> dict:
    """The fields images and videos share, checked."""
    limits = settings.limits
    _model(body, card)
    prompt = _text(body, "prompt", limits.prompt_chars, required=True)
    negative = _text(body, "negative_prompt", limits.prompt_chars)
    if negative is not None and not card.negative_prompt:
        raise ApiError(400, f"{card.model} takes no negative prompt", "negative_prompt")
    height, width = _size(body, card, settings)
    steps = _integer(body, "num_inference_steps", 2, limits.steps)
    guidance = _number(body, "guidance_scale", 0.0, 100.0)
    guidance = card.guidance if guidance is None else guidance
    seed = _integer(body, "seed", 0, SEED_LIMIT)
    warmup = _integer(body, "warmup_steps", 0, limits.steps)
    fidelity = _choice(body, "fidelity", ("exact", "displaced"), settings.fidelity)
    floor = _floor(body, settings)
    if warmup is None:
        warmup = settings.warmup if floor is None else 0  # under a floor the staleness guard decides every step
    strategy, asked = _strategy(body, card, settings, height, body.get("size") or f"{width}x{height}")
    guided = guidance is None or guidance > 1
    if strategy == "cfg" and card.nproc > 1 and not guided:
        raise ApiError(
            400,
            f"strategy cfg runs the two halves of classifier-free guidance on two ranks, and at guidance_scale "
            f"{guidance:g} the pipeline runs no guidance; ask for guidance_scale above 1, or another strategy",
            "strategy",
        )
    return {
        "id": f"{kind[:3]}_{uuid.uuid4().hex}",
        "kind": kind,
        "prompt": prompt,
        "negative_prompt": negative,
        "height": height,
        "width": width,
        "steps": settings.steps if steps is None else steps,
        "guidance": guidance,
        "seed": secrets.randbelow(2**32) if seed is None else seed,
        "strategy": strategy,
        "warmup": warmup,
        "fidelity": fidelity,
        "floor": floor,
        "guided": guided,
        "asked": asked,
    }


def image_request(body: dict, card: ModelCard, settings: ServeSettings) -> tuple[Request, bool]:
    """``POST /v1/images/generations``: the request and whether it named its strategy."""
    _unknown(body, (*OPENAI_IMAGE_FIELDS, *PARADIFF_FIELDS))
    if card.video:
        raise ApiError(400, f"{card.model} makes videos; ask POST /v1/videos", "model")
    if body.get("response_format") not in (None, "b64_json"):
        raise ApiError(
            400, "this server returns pictures in the reply only: response_format must be b64_json", "response_format"
        )
    fields = _common(body, card, settings, "image")
    n = _integer(body, "n", 1, settings.limits.n)
    output_format = _choice(body, "output_format", tuple(IMAGE_FORMATS), "png")
    asked = fields.pop("asked")
    return Request(**fields, n=1 if n is None else n, frames=None, output_format=output_format), asked


def _frames_refusal(card: ModelCard, frames: int) -> str | None:
    """Why ``card``'s model cannot draw ``frames`` frames and the count to ask instead, or None when it can."""
    ask = frames_to_ask(frames, card.fixed_frames, card.most_frames)
    if ask is None:
        return None
    seconds = f"{ask / VIDEO_FPS:g} s at {VIDEO_FPS} fps"
    if card.fixed_frames is not None:
        return f"draws {ask} frames ({seconds}) and no other count; ask num_frames {ask} or leave it out"
    return f"draws at most {ask} frames ({seconds}); ask num_frames {ask} or fewer"


def video_request(body: dict, card: ModelCard, settings: ServeSettings) -> tuple[Request, bool]:
    """``POST /v1/videos`` (JSON or a form): the request and whether it named its strategy."""
    _unknown(body, (*OPENAI_VIDEO_FIELDS, *PARADIFF_FIELDS, *VIDEO_FIELDS))
    if not card.video:
        raise ApiError(400, f"{card.model} makes images; ask POST /v1/images/generations", "model")
    frames = _integer(body, "num_frames", 1, settings.limits.frames)
    seconds = _integer(body, "seconds", 1, max(1, settings.limits.frames // VIDEO_FPS))
    if frames is None and seconds is not None:
        frames = seconds * VIDEO_FPS
    refusal = None if frames is None else _frames_refusal(card, frames)
    if refusal is not None:
        raise ApiError(
            400, f"{card.model} {refusal}", "num_frames" if body.get("num_frames") is not None else "seconds"
        )
    fields = _common(body, card, settings, "video")
    asked = fields.pop("asked")
    frames = card.default_frames if frames is None else frames
    return Request(**fields, n=1, frames=frames, output_format="mp4"), asked
