"""``paradiff serve`` as a client sees it: a real server in a subprocess (2 CPU ranks, a built-in model, a free
loopback port), driven by OpenAI's own client and by plain HTTP.

One image server (paradiff's launcher) serves most of the module (it carries an API key, so the key is tested
on it too); its last tests kill a rank and then SIGTERM it. A video server, started under torchrun, serves the
video test. Requests are small (64 or 128 px, 2 to 3 steps), so each costs well under a second of the ranks'
time.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import psutil
import pytest
from PIL import Image
from serve_process import ROOT, ServerProcess

KEY = "serve-test-key"
MODEL = "paradiff-tiny"
#: A small queue (the load test fills it), configured limits for the bad-input tests, few steps by default.
ARGS = ("--model", MODEL, "--nproc", "2", "--threads", "1", "--steps", "3", "--max-queue", "3")
LIMITS = ("--max-steps", "50", "--max-size", "512", "--max-n", "4", "--max-prompt-chars", "300")
PROMPT = "a large red circle at the top left on a white background"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")  # the staleness guard's calibrations: this server's own
    started = ServerProcess(*ARGS, *LIMITS, key=KEY, env={"PARADIFF_CACHE_DIR": str(cache)})
    try:
        started.wait_ready()
        yield started
    finally:
        started.kill()


def _client(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def _pixels(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def _draw(server, **body) -> httpx.Response:
    return server.http.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", **body})


@pytest.mark.timeout(600)
def test_the_openai_client_gets_images_under_the_setting_asked(server):
    client = _client(server)
    asked = {"num_inference_steps": 3, "seed": 7, "strategy": "cfg"}
    first = client.images.generate(
        model=MODEL, prompt=PROMPT, n=2, size="128x128", response_format="b64_json", extra_body=asked
    )
    report = first.model_extra["paradiff"]
    assert [_pixels(image.b64_json).shape for image in first.data] == [(128, 128, 3)] * 2
    assert not np.array_equal(_pixels(first.data[0].b64_json), _pixels(first.data[1].b64_json)), "seeds 7 and 8"
    assert report["strategy"] == "cfg" and report["why"] == "the request asked for it" and report["seed"] == 7
    assert report["bytes_per_step"] > 0 and report["seconds"] > 0
    # the same request under patch, warm-up covering every step (exact), then under cfg again
    patch = client.images.generate(
        model=MODEL, prompt=PROMPT, n=2, size="128x128", extra_body={**asked, "strategy": "patch", "warmup_steps": 3}
    )
    assert patch.model_extra["paradiff"]["strategy"] == "patch, warm-up 3"
    again = client.images.generate(model=MODEL, prompt=PROMPT, n=2, size="128x128", extra_body=asked)
    for one, other, third in zip(first.data, patch.data, again.data, strict=True):
        assert np.abs(_pixels(one.b64_json) - _pixels(other.b64_json)).max() <= 1  # exact: 8-bit rounding at most
        assert one.b64_json == third.b64_json  # switching back: the same bits


@pytest.mark.timeout(600)
def test_auto_plans_a_request_shape_once(server):
    first = _draw(server, size="128x64", seed=1)
    second = _draw(server, size="128x64", seed=2)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    planned, reused = first.json()["paradiff"], second.json()["paradiff"]
    assert planned["planning_seconds"] > 0 and "the fastest of the exact strategies" in planned["why"], planned
    assert reused["planning_seconds"] == 0 and reused["why"].endswith("(planned at an earlier request of this shape)")
    assert reused["strategy"] == planned["strategy"]


def _psnr(one: np.ndarray, other: np.ndarray) -> float:
    error = float(np.mean((one.astype(np.float64) - other) ** 2))
    return math.inf if error == 0 else 10 * math.log10(255.0**2 / error)


@pytest.mark.timeout(600)
def test_a_request_holds_its_fidelity_floor_under_the_staleness_guard(server):
    """The floor reaches the ranks' setting (warm-up 0, the guard on), the reply says which steps ran in sync, the
    picture holds the floor against the exact one, the calibration is paid once per shape and floor, and a floor
    above reach refreshes every step (exact)."""
    same = {"strategy": "patch", "num_inference_steps": 8, "seed": 3, "size": "128x128"}
    exact = _draw(server, **same, warmup_steps=8)
    first, second = (_draw(server, **same, fidelity_floor_db=30) for _ in range(2))
    above = _draw(server, **same, fidelity_floor_db=500)
    replies = [exact, first, second, above]
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    reference = _pixels(exact.json()["data"][0]["b64_json"])
    assert "guard" not in exact.json()["paradiff"]
    report, again = first.json()["paradiff"], second.json()["paradiff"]
    assert report["strategy"] == "patch fidelity_floor_db=30, warm-up 0", report
    guard = report["guard"]
    # step 0 runs in sync as every first step does; step 1 refreshes (one prediction: nothing measured yet)
    assert guard["refreshed_steps"][0] == 1 and len(guard["refreshed_steps"]) < 7, guard  # some steps displaced
    assert guard["calibration_seconds"] > 0 and guard["threshold_db"] is not None, guard
    assert again["guard"]["calibration_seconds"] == 0 and again["guard"]["refreshed_steps"] == guard["refreshed_steps"]
    assert _psnr(_pixels(first.json()["data"][0]["b64_json"]), reference) >= 30
    assert above.json()["paradiff"]["guard"]["refreshed_steps"] == list(range(1, 8))
    assert np.abs(_pixels(above.json()["data"][0]["b64_json"]) - reference).max() <= 1  # exact: 8-bit rounding


@pytest.mark.timeout(600)
def test_auto_keeps_the_floor_of_a_shape_it_planned(server):
    """``auto`` with a floor runs its pick guarded, and so does the next request of the shape, without planning."""
    asked = {"size": "64x128", "fidelity": "displaced", "fidelity_floor_db": 30, "num_inference_steps": 6}
    first, second = _draw(server, **asked, seed=1), _draw(server, **asked, seed=2)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    planned, reused = first.json()["paradiff"], second.json()["paradiff"]
    assert planned["planning_seconds"] > 0 and reused["planning_seconds"] == 0
    assert reused["strategy"] == planned["strategy"] and "fidelity_floor_db=30" in planned["strategy"], planned
    assert ("guard" in planned) == ("guard" in reused), (planned, reused)  # a displaced pick: guarded both times


def test_health_models_and_metrics_over_plain_http(server):
    health = httpx.get(f"{server.url}/health")  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ready" and health.json()["ranks"] == 2
    models = server.http.get("/v1/models").json()
    assert [model["id"] for model in models["data"]] == [MODEL] and models["object"] == "list"
    assert server.http.get(f"/v1/models/{MODEL}").json()["owned_by"] == "paradiff"
    text = server.http.get("/metrics").text
    for name in ("paradiff_requests_total", "paradiff_request_seconds_bucket", "paradiff_queue_depth"):
        assert f"# TYPE {name.removesuffix('_bucket')}" in text
    assert server.metric('paradiff_requests_total{outcome="ok"}') >= 0 and server.metric("paradiff_ready") == 1


BAD_INPUT = [
    ({"model": "sdxl"}, 404, "model", "not served here"),
    ({"model": "/etc/passwd"}, 404, "model", "this server serves 'paradiff-tiny'"),
    ({"image": "/etc/passwd"}, 400, "image", "this server does not take image"),
    ({"size": "100x128"}, 400, "size", "use 96 or 104"),
    ({"size": "128x120", "strategy": "patch"}, 400, "size", "heights near it that work: 64 or 128"),
    ({"size": "1024x1024"}, 400, "size", "between 8 and 512 pixels"),
    ({"size": "big"}, 400, "size", "WIDTHxHEIGHT"),
    ({"n": 5}, 400, "n", "between 1 and 4"),
    ({"num_inference_steps": 51}, 400, "num_inference_steps", "between 2 and 50"),
    ({"prompt": "a circle " * 40}, 400, "prompt", "at most 300"),
    ({"prompt": " "}, 400, "prompt", "must not be empty"),
    ({"response_format": "url"}, 400, "response_format", "b64_json"),
    ({"strategy": "cfg", "guidance_scale": 1}, 400, "strategy", "runs no guidance"),
    ({"strategy": "warp"}, 400, "strategy", "unknown strategy 'warp'"),
    ({"strategy": "ulysses"}, 400, "strategy", "cannot run here"),
    ({"seed": -1}, 400, "seed", "between 0 and"),
    ({"guidance_scale": "lots"}, 400, "guidance_scale", "must be a number"),
    ({"fidelity_floor_db": 0}, 400, "fidelity_floor_db", "above 0 dB"),
    ({"fidelity_floor_db": "high"}, 400, "fidelity_floor_db", "must be a number"),
]


def test_bad_input_is_answered_before_any_rank_works(server):
    calls = server.metric("paradiff_step_seconds_count")
    invalid = server.metric('paradiff_requests_total{outcome="invalid"}')
    for body, status, param, words in BAD_INPUT:
        reply = _draw(server, **body)
        error = reply.json()["error"]
        assert (reply.status_code, error["param"]) == (status, param), (body, reply.text)
        assert words in error["message"] and error["type"] == "invalid_request_error", (body, error)
    others = [
        server.http.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"}),
        server.http.post("/v1/videos", json={"prompt": PROMPT}),  # an image model
        server.http.get("/v1/videos/vid_missing"),
        server.http.get("/v1/no-such-route"),
    ]
    assert [reply.status_code for reply in others] == [400, 400, 404, 404]
    assert all(set(reply.json()["error"]) == {"message", "type", "param", "code"} for reply in others)
    assert server.metric("paradiff_step_seconds_count") == calls, "no rank drew anything"
    assert server.metric('paradiff_requests_total{outcome="invalid"}') == invalid + len(BAD_INPUT) + 2  # the POSTs


def test_the_api_key_guards_every_route_but_health(server):
    bare = httpx.Client(base_url=server.url)
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/images/generations"), ("GET", "/x")]:
        reply = bare.request(method, path)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", (path, reply.text)
    wrong = bare.get("/v1/models", headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401
    assert bare.get("/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="not-the-key").images.generate(model=MODEL, prompt=PROMPT)


def _process_figures(server) -> tuple[list[int], list[int]]:
    processes = server.processes()
    return [process.memory_info().rss for process in processes], [process.num_threads() for process in processes]


def _threads_settled_within(server, limits: list[int], seconds: float = 20) -> list[int]:
    """Each process's thread count once none is above ``limits``, or after ``seconds`` (the counts then).

    A rank's libraries start and end short-lived threads, so one reading may be a few above or below the
    steady count; a leak is a count that stays above it."""
    deadline = time.monotonic() + seconds
    while True:
        counts = [process.num_threads() for process in server.processes()]
        if all(count <= limit for count, limit in zip(counts, limits, strict=True)) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_load_every_request_is_answered_once_and_the_server_stays_flat(server):
    """40 requests from 8 clients at once against a queue of 3: each answered 200 or 429, its own pictures."""
    small = {"num_inference_steps": 2, "strategy": "cfg"}
    for seed in range(3):  # warm: this shape and setting have run before the figures are taken
        assert _draw(server, seed=seed, **small).status_code == 200
    ok_before = server.metric('paradiff_requests_total{outcome="ok"}')
    memory_before, threads_before = _process_figures(server)

    def client(number: int) -> list[tuple[int, int, dict]]:
        with httpx.Client(base_url=server.url, headers=server.http.headers, timeout=300) as http:
            answers = []
            for seed in range(100 + 5 * number, 105 + 5 * number):
                reply = http.post(
                    "/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", "seed": seed, **small}
                )
                answers.append((seed, reply.status_code, reply.json(), reply.headers.get("retry-after")))
            return answers

    with ThreadPoolExecutor(8) as pool:
        answers = [answer for answers in pool.map(client, range(8)) for answer in answers]
    memory_after, _ = _process_figures(server)
    threads_after = _threads_settled_within(server, threads_before)
    assert len(answers) == 40
    statuses = [status for _, status, _, _ in answers]
    assert set(statuses) <= {200, 429}, statuses
    drawn = [(seed, body) for seed, status, body, _ in answers if status == 200]
    assert all(body["paradiff"]["seed"] == seed and len(body["data"]) == 1 for seed, body in drawn)
    assert all(retry and int(retry) >= 1 for _, status, _, retry in answers if status == 429)
    assert drawn and server.metric('paradiff_requests_total{outcome="ok"}') == ok_before + len(drawn)
    assert all(after <= before for after, before in zip(threads_after, threads_before, strict=True)), (
        f"threads before the load {threads_before}, after it {threads_after}"
    )
    for before, after in zip(memory_before, memory_after, strict=True):
        assert after < before + 64 * 2**20, f"resident memory grew from {before / 2**20:.0f} to {after / 2**20:.0f} MB"


def _in_flight(server, body: dict) -> tuple[threading.Thread, dict]:
    """A request sent from a thread, once the ranks are drawing it."""
    reply: dict = {}
    thread = threading.Thread(target=lambda: reply.update(answer=_draw(server, **body)))
    thread.start()
    deadline = time.monotonic() + 120
    while server.health()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return thread, reply


@pytest.mark.timeout(600)
def test_a_client_gone_before_its_request_starts_is_dropped(server):
    calls = server.metric("paradiff_step_seconds_count")
    cancelled = server.metric('paradiff_requests_total{outcome="cancelled"}')
    # the first request must outlast the second's client (1 s) by far, on a fast machine too: seconds of drawing
    thread, reply = _in_flight(server, {"size": "256x256", "num_inference_steps": 50, "strategy": "cfg"})
    with pytest.raises(httpx.TimeoutException):  # queued behind the first; the client gives up and disconnects
        server.http.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64"}, timeout=1.0)
    thread.join(120)
    assert reply["answer"].status_code == 200
    deadline = time.monotonic() + 30
    while server.metric('paradiff_requests_total{outcome="cancelled"}') == cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric('paradiff_requests_total{outcome="cancelled"}') == cancelled + 1
    assert server.metric("paradiff_step_seconds_count") == calls + 1, "the dropped request never ran"


@pytest.mark.timeout(900)
def test_a_rank_killed_mid_request_is_named_and_the_ranks_restart(server):
    restarts = server.metric("paradiff_restarts_total")
    thread, reply = _in_flight(server, {"size": "128x128", "num_inference_steps": 50, "strategy": "cfg"})
    server.ranks()[1].kill()
    thread.join(120)
    answer = reply["answer"]
    assert answer.status_code == 503, answer.text
    assert "rank 1 " in answer.json()["error"]["message"] and "killed by SIGKILL" in answer.json()["error"]["message"]
    assert server.health()["status"] == "restarting"
    server.wait_ready()
    assert server.metric("paradiff_restarts_total") == restarts + 1
    assert _draw(server, seed=3, num_inference_steps=2, strategy="cfg").status_code == 200


@pytest.mark.timeout(600)
def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(server):
    """Last: it stops the module's server."""
    thread, reply = _in_flight(server, {"size": "128x128", "num_inference_steps": 20, "strategy": "cfg"})
    ranks = list(server.ranks().values())
    code = server.stop()
    thread.join(60)
    assert reply["answer"].status_code == 200, reply["answer"].text
    assert code == 0, "".join(server.errors)[-2000:]
    assert not [rank for rank in ranks if rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(600)
def test_one_rank_serves_and_a_server_out_of_restarts_exits_1():
    """One device (``--nproc 1``: a worker of its own), and ``--max-restarts 0``: the first lost rank fails it."""
    alone = ServerProcess("--model", MODEL, "--nproc", "1", "--threads", "1", "--steps", "3", "--max-restarts", "0")
    try:
        alone.wait_ready()
        first = _draw(alone, seed=1)
        assert first.status_code == 200 and first.json()["paradiff"]["strategy"] == "one device", first.text
        thread, reply = _in_flight(alone, {"size": "128x128", "num_inference_steps": 50})
        alone.ranks()[0].kill()
        thread.join(120)
        assert reply["answer"].status_code == 503 and "rank 0 " in reply["answer"].json()["error"]["message"]
        assert alone.process.wait(120) == 1
        assert "gave up after 0 restarts in a row" in "".join(alone.errors)
    finally:
        alone.kill()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--port", "{busy}"], "cannot listen on 127.0.0.1:{busy}: Address already in use; pick another --port"),
        (["--strategy", "cfg", "--nproc", "3"], "strategy='cfg' runs the two CFG halves on 2 ranks, got a world of 3"),
        (["--fidelity-floor", "-3"], "--fidelity-floor must be a positive number of dB (e.g. 30), got -3"),
    ],
)
def test_a_server_that_cannot_start_says_why_before_loading(args, says):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        command = [
            sys.executable,
            "-m",
            "paradiff.cli",
            "serve",
            "--model",
            MODEL,
            *(a.format(busy=port) for a in args),
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    assert done.returncode == 2 and says.format(busy=port) in done.stderr, done.stderr[-1000:]


@pytest.fixture(scope="module")
def video_server():
    """Under torchrun: the same entry on ranks the user launched (rank 0 answers)."""
    started = ServerProcess("--model", "paradiff-tiny-video", "--threads", "1", "--steps", "3", torchrun=2)
    try:
        started.wait_ready()
        yield started
    finally:
        started.kill()


@pytest.mark.timeout(600)
def test_the_openai_client_gets_a_video_job_and_its_mp4(video_server):
    import imageio.v3 as iio

    client = _client(video_server, key="none")
    with warnings.catch_warnings():  # the client marks its video API as deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        job = client.videos.create(
            model="paradiff-tiny-video",
            prompt="a large red circle moving from left to right on a white background",
            size="128x128",
            extra_body={"num_inference_steps": 3, "seed": 5, "strategy": "cfg"},
        )
        assert job.status in ("queued", "in_progress") and job.id.startswith("vid_")
        done = client.videos.poll(job.id, poll_interval_ms=200)
        assert done.status == "completed", done
        assert done.model_extra["paradiff"]["frames"] == 16 and done.size == "128x128"
        content = client.videos.download_content(job.id).read()
    frames = iio.imread(content, extension=".mp4")
    assert frames.shape == (16, 128, 128, 3), frames.shape
    refused = video_server.http.post("/v1/videos", json={"prompt": "a circle", "seconds": 4})
    assert refused.status_code == 400 and "draws at most 16 frames" in refused.json()["error"]["message"]
    images = video_server.http.post("/v1/images/generations", json={"prompt": "a circle"})
    assert images.status_code == 400 and "makes videos" in images.json()["error"]["message"]


def _serve_example(path) -> tuple[str, str]:
    """The ``paradiff serve`` command of ``path`` (``pip install ... &&`` dropped) and the Python client after it."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.S | re.M)
    index = next(i for i, (_, body) in enumerate(blocks) if "paradiff serve --model" in body)
    command = blocks[index][1].strip().split("&&")[-1].strip()
    client = next(body for language, body in blocks[index + 1 :] if language == "python")
    return command, client


@pytest.mark.timeout(600)
def test_the_readme_serve_command_and_client_run_as_written(tmp_path, monkeypatch):
    """The README's command (on a free port instead of 8000), then its Python client against it."""
    command, client = _serve_example(ROOT / "README.md")
    assert _serve_example(ROOT / "docs" / "serve.md") == (command, client), "README and docs/serve.md show one example"
    words = shlex.split(command)
    assert words[:2] == ["paradiff", "serve"]
    started = ServerProcess(*words[2:])
    try:
        started.wait_ready()
        monkeypatch.chdir(tmp_path)
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(client.replace("http://127.0.0.1:8000", started.url), {})
        assert Image.open(tmp_path / "square.png").size == (128, 128)
        assert "'strategy':" in output.getvalue() and "'why':" in output.getvalue()
        assert started.stop() == 0
    finally:
        started.kill()
