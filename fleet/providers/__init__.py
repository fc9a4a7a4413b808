"""Providers that let evaluation harnesses run their sandboxes in fleet machines (optional
extras: `pip install fleet[inspect]`)."""
