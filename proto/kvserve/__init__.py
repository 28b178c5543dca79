"""Generated protobuf/gRPC stubs of proto/ (regenerate with `python tools/gen_proto.py`)."""
