"""The disk calls the SSD tier goes through and how many writes it keeps in flight.

Module attributes rather than direct `os` calls so fault tests and probes can replace them in one place
(a failing, slow or gated pwritev) without patching `os` for the whole process.
"""

import os

pwritev = os.pwritev
preadv = os.preadv
WRITE_DEPTH = (
    3  # groups a directory's writer keeps in flight, so a writer late by one write's time leaves no gap
)
