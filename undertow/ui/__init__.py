"""`undertow ui`: a run viewer in the browser, read-only over run directories and tree
stores (docs/ui.md). `runs.py` reads a run directory and says what it lacks, `views.py`
turns its trees into what each page shows, `server.py` serves that JSON, the static page
(`static/`) and live sessions; the command line is `undertow/commands/ui.py`.
"""
