"""An island: one region's training process (JAX/Flax NNX/Optax) and its network side (outbox,
uplink, downlink).

May import: protocol, bus, telemetry, cliargs and third-party libraries; no other package of the
project.
"""
