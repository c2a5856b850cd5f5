"""The elastic learner's runtime: the live side of the cell pool.

`undertow/cells/` decides (pure code, shared with the simulator); this package carries the
decisions out and trains:

    step.py          one training step whose data-parallel membership grows while it
                     runs: `Coordinator` (the learner's process) and `Member` (one per
                     training cell), exact whatever joins, and when
    sharded_cell.py  a cell of several processes that shards one copy of the model with
                     FSDP2 and takes part in the step as one member
    local.py         `CellRoles`, which carries out the policy's role decisions, and
                     the members as processes or threads of this machine
    ray_members.py   the members as Ray actors, one placement group per cell
    learner.py       `ElasticLearner`, the learner whose step is an elastic step

The run's one loop, which drives these as it drives the plain learner, is
`undertow/cells/loop.py`.
"""
