"""``tfmigrate verify``: train the legacy and the migrated program side by side and compare.

Layout:

- ``cli``      the ``verify`` command (no TensorFlow, NumPy or matplotlib at import time);
- ``detect``   decides from the source text whether a program needs legacy (TF1) mode;
- ``runner``   runs one program under the harness in a subprocess, with a timeout;
- ``harness``  ``python -m tfmigrate.verify.harness``: sets up devices, seeds and the TF1 shim,
               captures loss and throughput while the program runs unmodified;
- ``compare``  the pure-Python comparison and verdict;
- ``report``   the table, the JSON report and the PNG plot.
"""
