"""The message bus library every process uses: CURVE/ZAP security, stream sequencing, socket setup.

May import: protocol, zmq and the standard library; nothing from island, merger, broker or cluster."""
