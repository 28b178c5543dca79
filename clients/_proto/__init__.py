"""Generated protobuf/gRPC stubs of proto/ (regenerate with `python tools/gen_proto.py`).
The clients and the server both import them from here: clients need no server code."""
