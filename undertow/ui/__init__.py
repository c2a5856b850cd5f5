"""`undertow ui`: a run viewer in the browser, read-only over run directories and tree stores.

- `runs.py` reads what a run directory holds (config, metrics, checkpoints, the
  store's trees) and says what it lacks;
- `views.py` turns a group tree into what the page shows (a step's groups and
  advantages, a session's calls with per-token logprobs, a tree's drawing);
- `server.py` serves the JSON of both, the static page (`static/`: plain HTML, JS and
  CSS, nothing fetched from elsewhere) and, with a gateway, server-sent events of
  its open sessions;
- `undertow/commands/ui.py` is the command line.
"""
