"""fleet's wire boundary: what a call looks like on gRPC, for servers, agents and clients alike.

The only package that imports the code protoc generates from proto/ (it lives in
`fleet.api._proto`, written by `scripts/gen-protos`); the rest of fleet, the gateway, the
benchmarks and the tests reach it through this package's public modules:

- `fleet.api.pb`: the generated messages and service stubs (`fleet_pb2`, `types_pb2`, `host_pb2`,
  `inference_pb2` and their `*_grpc`).
- `fleet.api.convert`: wire messages to fleet.core's domain values and back, checking what it
  reads; an agent encodes with it without loading the server or the ledger.
- `fleet.api.status`: fleet's errors as gRPC statuses with rich details, and back again.
- `fleet.api.interceptor`: the one server interceptor (request context, authentication,
  error mapping) every fleet gRPC server runs.

Importing this package loads none of them, so a caller pays only for what it uses.
"""
