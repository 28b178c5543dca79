"""The API's contract: the .proto sources (proto/kvserve/v1/*.proto) and, beside each, its
generated protobuf/gRPC stubs (regenerate with ``python tools/gen_proto.py``). Installed as
``kvserve.proto``; the server (kvserve.service) and the clients (kvserve.clients) both
import the stubs from here, and this package imports nothing of either."""
