"""The defaults of ``lantern serve``'s connection limits, shared by its command line and its app
(this module imports nothing: the command line reads it before FastAPI is imported)."""

READ_TIMEOUT = 30.0  # seconds for a request's head, and then for its body, to arrive
MAX_CONNECTIONS = 256  # open at once
