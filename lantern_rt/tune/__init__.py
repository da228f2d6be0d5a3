"""``lantern tune``: this machine's costs and this model's acceptance, measured, and the static
tree, method and batch size they make fastest (:mod:`.costs`, :mod:`.acceptance`, :mod:`.dp`),
kept in a tuning record (:mod:`.record`)."""

# The command's defaults, here so that `lantern tune --help` reads them without importing torch.
# Calibration images per tree, classes in turn from the seed: two of each of the demo's ten.
# Acceptance differs by class (chain-8's tau 4.8-6.7 across the demo's); eight images left its
# two hardest out and predicted chain-8's tau 6% over 64 images' estimate
CALIBRATION_IMAGES = 20
# Images measured per candidate and batch size: each of the demo's ten classes once, as the
# calibration covers them (eight left classes 8 and 9 out: chain-8's tau 6.2 on classes 0-7,
# 5.9 on all ten)
MEASURED_IMAGES = 10
# Cost rounds per batch size before the search, at most (lantern_rt.tune.costs: they stop sooner
# once every candidate's mean step settles)
MAX_ROUNDS = 6
