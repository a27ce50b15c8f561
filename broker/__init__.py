"""The broker: XSUB/XPUB proxies for the delta bus and the snapshot bus; never decodes payloads.

`security` holds the CURVE key handling shared by every process (keys, ZAP allowlist)."""
