"""How to reach a run: what a TARGET names, the client, the ssh transport, runtime files."""
