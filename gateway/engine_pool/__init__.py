"""The engine pool: between the front, which hands it each generation, and the drivers of
`undertow.gateway.engines`: admission, routing, resumes, draining, migration and weight
updates across engines. Its contract with the front: docs/engines.md. Never imports the
front or the built-in engine."""
