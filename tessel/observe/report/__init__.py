"""`tessel report RUN_DIR`: one self-contained HTML page about a run.

The page is a single file with inline CSS and inline SVG plots drawn here (no JavaScript,
no fonts, no network; a Content-Security-Policy forbids fetching anything), so it can be
mailed, attached to a ticket or opened from a cluster's shared disk. It reads what the
trainer leaves in the run directory, any of which may be missing except metrics.jsonl:

    metrics.jsonl         training and validation records (non-finite floats as "nan"/"inf")
    events.jsonl          start/resume/restart/alert/rollback/... with unix times
    config.toml           shown verbatim, with secrets (webhook URLs, passwords) redacted
    run.json              device, world size, layout, torch version
    skipped_batches.json  shown raw when present

Every plot section is always present: a metric without data gets a "no data: <reason>"
placeholder, so a reader sees what is missing rather than wondering. Secrets are hidden by
`tessel.observe.secrets`, in every text the page shows.

One module per job: `run` reads the run directory, `summary` computes the figures at the
top, `plots` chooses and draws the SVG plots (and heatmaps), `experts` chooses the "Expert
load" section's figures (Mixture-of-Experts runs only), `page` assembles the HTML and
writes it.
"""

from tessel.observe.report.page import render, write_report
from tessel.observe.report.run import Run, read_run

__all__ = ["Run", "read_run", "render", "write_report"]
