"""Pure logic: no grpc, SQL, smol or torch imports; values in, values out."""
