"""``POST /v1/videos``' frame counts, read without a server: a model whose denoiser fixes the count or bounds it
answers 400 naming the count to ask, on the field the request used."""

from __future__ import annotations

import dataclasses

import pytest

from paradiff.serve.card import VIDEO_FPS, ModelCard
from paradiff.serve.errors import ApiError
from paradiff.serve.requests import video_request
from paradiff.serve.settings import ServeSettings

CARD = ModelCard(
    model="m", pipeline="Pipe", video=True, nproc=2, default_size=(64, 64), pixels=8, frames_parameter="num_frames"
)
SETTINGS = ServeSettings(model="m", nproc=2)


@pytest.mark.parametrize(
    ("card", "body", "field", "message"),
    [
        (
            dataclasses.replace(CARD, default_frames=16, fixed_frames=16),
            {"num_frames": 8},
            "num_frames",
            f"m draws 16 frames ({16 / VIDEO_FPS:g} s at {VIDEO_FPS} fps) and no other count; ask num_frames 16",
        ),
        (
            dataclasses.replace(CARD, default_frames=16, most_frames=16),
            {"seconds": 4},
            "seconds",
            f"m draws at most 16 frames ({16 / VIDEO_FPS:g} s at {VIDEO_FPS} fps); ask num_frames 16 or fewer",
        ),
    ],
)
def test_a_frame_count_the_model_cannot_draw_is_refused_naming_the_count_to_ask(card, body, field, message):
    with pytest.raises(ApiError) as refused:
        video_request({"prompt": "a circle", **body}, card, SETTINGS)
    assert refused.value.status == 400 and refused.value.param == field
    assert refused.value.message.startswith(message), refused.value.message


def test_a_count_up_to_the_bound_is_drawn_as_asked_and_none_asked_is_the_models_own():
    card = dataclasses.replace(CARD, default_frames=16, most_frames=16)
    assert video_request({"prompt": "a circle", "num_frames": 8}, card, SETTINGS)[0].frames == 8
    assert video_request({"prompt": "a circle"}, card, SETTINGS)[0].frames == 16
