"""The Metal backend: launchers (launch.py) of the kernels in the top-level metal/ sources."""
