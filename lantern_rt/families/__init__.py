"""Model families: everything lantern-rt knows about one family of models is a ``Family``
(``base.py``) in its own folder, registered by name in ``registry.py`` (docs/architecture.md)."""
