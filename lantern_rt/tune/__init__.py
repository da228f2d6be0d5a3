"""``lantern tune``: this machine's costs and this model's acceptance, measured, and the static
tree, method and batch size they make fastest (:mod:`.costs`, :mod:`.acceptance`, :mod:`.dp`),
kept in a tuning record (:mod:`.record`)."""
