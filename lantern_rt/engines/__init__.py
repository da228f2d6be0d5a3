"""TensorRT: plans built from a bundle's graphs, kept inside the bundle per GPU and version."""
