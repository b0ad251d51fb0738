"""The OpenAI-compatible HTTP server: ``build_app`` (the FastAPI app) and ``run_server`` (uvicorn).

Imports stay lazy: ``pegainfer.server.config`` is read by the CLI without loading FastAPI or torch.
"""
