"""An island: one region's training process (JAX/Flax NNX/Optax).

Pure parts: `fragments` (partition, schedule, pseudo-gradient, adoption).  Model and data:
`model`, `data`.  Training: `train` (inner optimizer, sharded step).  The loop: `loop`.
"""
