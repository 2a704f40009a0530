"""The ``sharpi`` command line: one module per subcommand (``cmd_<name>.py``)."""
