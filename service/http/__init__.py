"""The OpenAI-compatible HTTP front (``--http-port``): ``service.http.openai`` translates
JSON <-> domain, ``service.http.app`` serves it (Starlette on uvicorn, in the gRPC
server's event loop). See docs/api.md."""
