"""fleet: a gRPC fleet manager for microVM sandboxes."""

__version__ = "0.1.0"
