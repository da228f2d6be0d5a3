"""``lantern serve``: an OpenAI-shaped image-generation HTTP service over the Python API
(:mod:`lantern_rt.api`): the app (:mod:`.app`), the engine thread that runs the one decode loop
with continuous batching (:mod:`.engine`) and its Prometheus metrics (:mod:`.metrics`)."""
