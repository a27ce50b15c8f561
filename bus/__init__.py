"""The message bus library every process uses: CURVE/ZAP security, stream sequencing and gaps,
socket setup.

May import: protocol, zmq and the standard library; no other package of the project."""
