"""Who is calling: the fleet CA, host certificates, TLS credentials."""
