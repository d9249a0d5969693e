"""Serving: ONNX export with parity checks, and an HTTP server with dynamic batching."""
