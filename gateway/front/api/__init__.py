"""The gateway's HTTP APIs: one module per API family, each with `add_routes(app, ...)`."""
