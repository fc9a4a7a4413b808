"""Thin gRPC servicers: decode, call the ledger and core, encode, map errors."""
