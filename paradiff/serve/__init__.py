"""``paradiff serve``: one persistent group of ranks holding a loaded pipeline, behind an OpenAI-compatible HTTP API.

The pieces, from the client inwards:

* :mod:`.app` answers HTTP (FastAPI): the OpenAI routes, the error envelope, the API key. It checks every
  request against what the loaded model can do (:mod:`.requests`, :mod:`.card`) before any rank works.
* :mod:`.scheduler` keeps the bounded queue, the deadlines and the one reply each accepted request gets;
  it hands one batch at a time to the ranks and tracks health and metrics (:mod:`.metrics`).
* :mod:`.group` is the scheduler's way to the ranks: worker processes of paradiff's own launcher, which it
  restarts when one is lost (the HTTP front stays up meanwhile), or, under ``torchrun``, the rank-0 process
  itself.
* :mod:`.ranks` is what every rank runs: load the pipeline once, then take each batch rank 0 hands out,
  lay the ranks out for it (:mod:`.layout`: the strategy per request, ``auto`` planned once per request
  shape) and draw; rank 0 encodes the pictures (:mod:`.media`) and sends them back (:mod:`.link`).

This package sits above the library (``paradiff.parallelize`` and friends); the library never imports it.
FastAPI and uvicorn come with the ``serve`` extra (``pip install 'paradiff[serve]'``).
"""
