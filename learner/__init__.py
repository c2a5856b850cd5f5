"""The learner: tree-packed policy optimisation, checkpoints, weight sync and the cell pool."""
