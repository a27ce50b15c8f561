"""The broker: XSUB/XPUB proxies for the delta bus and the snapshot bus; never decodes payloads.

May import: bus, protocol, telemetry, zmq and the standard library; no other package of the project.
"""
