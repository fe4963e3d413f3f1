"""ferrum-service: ferrum's ModelExecutor contract served over gRPC."""

__version__ = "0.1.0"
