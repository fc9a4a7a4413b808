"""The host agent: capabilities, claim loop, heartbeats, machine lifecycle."""
