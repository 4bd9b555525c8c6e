"""`dora learn`: the trainer. Receives assigned groups, trains, publishes versions, checkpoints."""
