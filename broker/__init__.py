"""The broker: XSUB/XPUB proxies for the delta bus and the snapshot bus; never decodes payloads.

May import: bus, protocol, telemetry, zmq and the standard library; nothing from island, merger, cluster or benchmarks."""
