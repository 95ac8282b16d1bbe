"""``unified-models report``: one self-contained HTML page of an ``rl`` or ``check`` run.

* :mod:`.load`     find and validate RUN_DIR's files (metrics JSONL, check JSON, checkpoint)
* :mod:`.plots`    matplotlib figures rendered to PNG
* :mod:`.page`     the HTML page (inline CSS, plots as ``data:`` URIs, no script)
* :mod:`.command`  the subcommand (``add_parser``, ``run``)

Importing this package imports neither matplotlib nor torch (the CLI registers the
subcommand at start-up).
"""
