"""The OpenAI-compatible HTTP front (``--http-port``): one module of routes per protocol
(``completions``: chat and text completions; ``responses``: the Responses API) over the
shared ``plumbing`` (tenant, body, errors, counts, and ``Plumbing.start_turn``, the turn
prologue of ``service.turns``); ``openai`` translates JSON <-> domain; ``app`` composes
the routes into one Starlette app on uvicorn, in the gRPC server's event loop. See
docs/api.md."""
