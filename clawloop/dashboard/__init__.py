"""A live, read-only dashboard of the learning loop (docs/dashboard.md): ``readmodel`` reads a run, ``routes``
serves it under ``/dashboard`` of ``clawloop serve`` or of ``clawloop dashboard RUN_DIR`` (``standalone``)."""
