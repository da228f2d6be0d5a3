"""Backends run the graphs; the decode loop in ``lantern_rt.runtime.decode`` drives them all."""
