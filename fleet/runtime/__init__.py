"""Machine runtimes behind one small protocol: smol (microVMs) and namespace (Linux namespaces)."""
