"""TensorRT in one place: plans built from a bundle's graphs and kept inside the bundle per GPU
and version (``plans.py``), the runner that executes them (``runner.py``), version switches
(``compat.py``) and ``lantern build-engines`` (``cli.py``)."""
