"""The REST API (FastAPI): one router per noun under /api/v1."""
