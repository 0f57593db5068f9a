"""UI-free services of the Clef Workbench: schema library, state input, answers, store, stats, review, runs."""

import logging

# A library's loggers stay silent until the application configures logging (the workbench's server, a test's
# caplog): without this, Python's last-resort handler would print every logged traceback to the command line's
# stderr, where `python -m clef_workbench run` promises one clear message.
logging.getLogger(__name__).addHandler(logging.NullHandler())
