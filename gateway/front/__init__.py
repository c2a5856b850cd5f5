"""The gateway's HTTP front: the APIs scaffolds call (`api/`), the app and its config,
sessions, calls rendered to token IDs and captured into trees, the tree store, and tool-call
parsing (`toolparsers/`). Drives the engines through `undertow.gateway.engines`.
"""
