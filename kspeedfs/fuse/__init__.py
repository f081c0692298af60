"""① The FUSE boundary: ``operations.py`` (the request handlers), ``boundary.py`` (errors
to errno, access log), ``tuning.py`` (kernel knobs set through sysfs after mounting)."""
