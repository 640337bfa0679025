"""The weight server: versioned parameters over ZeroMQ, verified by content hash."""
