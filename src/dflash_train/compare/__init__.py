"""`dflash-train compare`: train variants at several seeds and compare their tau with intervals.

command.py (the command and the loop over runs), runs.py (the files, the subprocesses and the
record of one run), reference.py (the reference client's tau, run as a subprocess). The
statistics are `dflash_train.metrics.intervals` and `dflash_train.metrics.seeds`.
"""
