"""Offline image-quality evaluation: ``classifier`` (the in-repo feature extractor) and ``metrics``."""
