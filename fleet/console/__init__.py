"""The web console: server-rendered pages over the ledger's read side, served from the server
process (`fleet serve --console-listen`), for the people who run, audit and evaluate fleets
without a shell.

Signed-in with a tenant API key; the browser holds only a signed session naming the key, never
the key itself. Every page is rendered by Jinja2 with autoescape on (labels, Smolfile text,
step output and file names are attacker-controlled), served under a Content-Security-Policy
that allows no inline script, and every action carries a CSRF token.
"""
