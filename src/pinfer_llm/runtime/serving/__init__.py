"""pi-serve's library half: the OpenAI-compatible HTTP app (server.py), request shapes (openai_api.py) and the
worker thread that owns the model (worker.py)."""
