"""The `fleet` command line: the presentation layer (it writes to the terminal on purpose)."""
