"""fleet's wire boundary: what a call looks like on gRPC, for servers and clients alike.

- `fleet.api.status`: fleet's errors as gRPC statuses with rich details, and back again.
- `fleet.api.interceptor`: the one server interceptor (request context, authentication,
  error mapping) every fleet gRPC server runs.
"""
